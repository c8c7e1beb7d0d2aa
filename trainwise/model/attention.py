"""Attention: multi-head (MHA, with GQA/MQA through n_kv_heads; gpt-oss's sliding windows and attention
sinks) and multi-head latent (MLA), the KV cache of generation, and the explicit form a compiled CPU step
uses.

Shapes in comments: B batch, T tokens (S with the cached ones), H d_model, nh query heads, nkv key/value
heads, hd head dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from trainwise.config import ModelConfig
from trainwise.model.layers import Rotary, split_matmuls

# The eps of MLA's two latent RMSNorms (q_a_layernorm, kv_a_layernorm): RMSNorm's default 1e-6 whatever the
# block norms' eps (model.norm_eps), as in DeepSeek's reference inference/model.py and transformers'
# DeepseekV3Attention.
LATENT_NORM_EPS = 1e-6


class KVCache:
    """What attention keeps of past positions, so each generated token costs one position of work: keys
    and values (MHA/GQA/MQA), or the compressed latent and the rotated shared key (MLA)."""

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype):
        self.max_len, self.device, self.dtype = cfg.max_seq_len, device, dtype
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(cfg.n_layers)]
        self.length = 0  # positions filled (shared by all layers)

    def update(self, layer: int, dim: int, **new: torch.Tensor) -> list[torch.Tensor]:
        """Write each tensor of `new` at the next positions along `dim` of its buffer (max_seq_len
        positions, made on first use) and return every buffer's filled part, in the order given."""
        stored, out = self.layers[layer], []
        for name, t in new.items():
            if name not in stored:
                shape = list(t.shape)
                shape[dim] = self.max_len
                stored[name] = torch.zeros(shape, device=self.device, dtype=self.dtype)
            stored[name].narrow(dim, self.length, t.shape[dim]).copy_(t)
            out.append(stored[name].narrow(dim, 0, self.length + t.shape[dim]))
        return out


class Attention(nn.Module):
    split = False  # q, k and v as three matmuls (split_matmuls): op-level checkpointing sets it

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv_bias = cfg.bias or cfg.qkv_bias
        # One matmul for q, k and v: (H) -> (nh + 2 nkv) hd. Same parameters as three projections.
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=qkv_bias)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks else None  # (nh,) logits
        # The positions each query sees, itself included. Every layer of a model with windows or sinks runs
        # local_attention, the full ones with a window no sequence exceeds, so that all its layers run the same
        # operators (the operator recorder takes one block for all); plain causal attention runs SDPA.
        self.window = cfg.sliding_window if cfg.is_sliding_layer(layer) else cfg.max_seq_len
        self.plain_causal = not (cfg.attention_sinks or cfg.sliding_window)
        self.use_rope = cfg.position == "rope"
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rope: tuple | None, cache: KVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        nh, nkv = self.n_heads, self.n_kv_heads
        # (B, T, nh + 2 nkv, hd): q and k heads first, so one RoPE call turns both
        hd = self.head_dim
        qkv = split_matmuls(self.qkv, [nh * hd, nkv * hd, nkv * hd], x) if self.split else self.qkv(x)
        qk, v = qkv.unflatten(-1, (nh + 2 * nkv, hd)).split([nh + nkv, nkv], dim=2)
        if self.q_norm is not None:
            q, k = qk.split([nh, nkv], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        if self.use_rope:
            cos, sin = rope  # (T, hd/2) half tables
            qk = Rotary.apply(qk, cos[:, None].to(qk.dtype), sin[:, None].to(qk.dtype))
        q, k = qk.split([nh, nkv], dim=2)
        # (B, heads, T, hd) views; SDPA and the matmuls take the strides as they are
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        causal = True
        if cache is not None:
            causal = cache.length == 0  # prefill is causal; one new token sees every cached position
            k, v = cache.update(layer, 2, k=k, v=v)
        y = self.core(q, k, v, causal)  # (B, nh, T, hd)
        return self.out(rearrange(y, "b h t d -> b t (h d)"))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v through SDPA (flash / memory-efficient kernels where available), or
        local_attention for windows and sinks (which places the queries by the keys' count, cached or not).
        Replaceable from outside: selective checkpointing wraps it, and a compiled CPU step swaps in
        explicit_attention where plain_causal (trainwise.runtime.parallelize)."""
        dropout = self.dropout if self.training else 0.0
        if not self.plain_causal:
            return local_attention(q, k, v, self.window, self.sinks, dropout)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout,
                                              enable_gqa=self.n_kv_heads != self.n_heads)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(hd)) v as two batched matmuls and a masked fp32 softmax.

    The attention of a compiled CPU step (trainwise.runtime.parallelize.apply_compile): there inductor
    fuses the scale, mask and softmax into one kernel around two bf16 matmuls, which beat PyTorch's CPU
    flash kernel (benchmarks/RESULTS.md). It computes the full T x T scores (twice the causal FLOPs) and
    saves the T x T probabilities, so eager runs and GPUs keep SDPA's flash kernels.
    q (B, nh, T, hd); k, v (B, nkv, T, hd)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    T = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, nh, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.float().masked_fill(future, float("-inf")).softmax(dim=-1)
    return probs.to(v.dtype) @ v


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, sinks: torch.Tensor | None,
                    dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention in which each query sees the last `window` positions, itself included (a sliding
    window: Longformer, Beltagy et al. 2020; gpt-oss's and Mistral's layers), with attention sinks as gpt-oss
    has them: a learned logit per head that joins each softmax's denominator and is dropped after it, so that
    a head's weights on the positions may sum to less than 1 (the role sink tokens play in Xiao et al. 2023,
    "Efficient Streaming Language Models with Attention Sinks").

    Explicit: the masked T x S scores and an fp32 softmax between two batched matmuls, as explicit_attention
    (no fused kernel takes a sink logit). q (B, nh, T, hd): the last T of the S positions of k, v (B, nkv, S,
    hd), as with a KV cache; sinks (nh,) or None."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    B, nh, T, _ = q.shape
    S = k.shape[2]
    scores = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).float()  # (B, nh, T, S)
    back = torch.arange(S - T, S, device=q.device)[:, None] - torch.arange(S, device=q.device)  # (T, S) distance
    scores = scores.masked_fill((back < 0) | (back >= window), float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float()[:, None, None].expand(B, nh, T, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # (B, nh, T, S)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs.to(v.dtype) @ v


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention as Megatron-LM ran it before fused attention kernels (its 2021-22 published runs):
    the T x T scores from one batched matmul, the causal mask and softmax in the scores' own dtype (Megatron
    fuses the two into FusedScaleMaskSoftmax, one read and one write; here two kernels), dropout on the
    probabilities, a second batched matmul. The planner records it for `plan
    --attention-impl unfused` (trainwise.runtime.parallelize.use_unfused_attention); trainwise trains with
    SDPA. q (B, nh, T, hd); k, v (B, nkv, T, hd)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    T = q.shape[2]
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)  # (B, nh, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    if dropout_p > 0:  # CUDA's fused dropout kernel (F.dropout's CPU path splits it in three)
        probs = torch.native_dropout(probs, dropout_p, True)[0]
    return probs @ v


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, section 2.1; DeepSeek-V3): keys and
    values come from one compressed latent per token, so the KV cache holds kv_lora_rank + rope numbers
    per token and layer instead of 2 x heads x head dim.

        q = up_q(norm(down_q x))  (or one H -> nh (nope + rope) matmul when q_lora_rank = 0)
        [c, k_rope] = down_kv x;  c = norm(c)           the latent c: kv_lora_rank; k_rope: one shared head
        [k_nope, v] = up_kv c                            per head: nope + v_head_dim
        q_rope, k_rope turned by RoPE (decoupled from the compressed part); scores over nope + rope dims

    Shapes: B batch, T tokens, H d_model, nh heads, r = qk_rope_head_dim, n = qk_nope_head_dim,
    dv = v_head_dim, C = kv_lora_rank."""

    plain_causal = True  # causal softmax over every past position: explicit_attention may replace its core

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.nope, self.rope_dim, self.dv = (cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                          cfg.v_head_dim)
        self.kv_rank, qk = cfg.kv_lora_rank, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_down = nn.Linear(cfg.d_model, cfg.q_lora_rank, bias=cfg.bias)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_up = nn.Linear(cfg.q_lora_rank, cfg.n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * qk, bias=False)
        self.kv_down = nn.Linear(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.bias)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_up = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.out = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, rope: tuple, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        q = self.q_up(self.latent_norm(self.q_norm, self.q_down(x))) if hasattr(self, "q_up") else self.q_proj(x)
        q_nope, q_rope = q.unflatten(-1, (self.n_heads, self.nope + self.rope_dim)).split(
            [self.nope, self.rope_dim], dim=-1)  # (B, T, nh, n), (B, T, nh, r)
        latent, k_rope = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (B, T, C), (B, T, r)
        latent = self.latent_norm(self.kv_norm, latent)
        cos, sin = rope  # (T, r/2) half tables
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q_rope = Rotary.apply(q_rope, cos, sin)
        k_rope = Rotary.apply(k_rope.unsqueeze(2), cos, sin)  # (B, T, 1, r): one key head shared by all
        causal = True
        if cache is not None:  # the cache holds the latent and the rotated key: C + r numbers per token
            causal = cache.length == 0
            latent, k_rope = cache.update(layer, 1, latent=latent, k_rope=k_rope)
        k_nope, v = self.kv_up(latent).unflatten(-1, (self.n_heads, self.nope + self.dv)).split(
            [self.nope, self.dv], dim=-1)  # (B, S, nh, n), (B, S, nh, dv)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # (B, nh, T, n + r)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.n_heads, -1)], dim=-1).transpose(1, 2)
        # The flash kernels (PyTorch's CPU SDPA, FlashAttention-2) take one head dim for q, k and v; with
        # dv < n + r SDPA would fall back to its math kernel, which saves the T x T probabilities. So v is
        # padded with zeros to n + r and the extra output columns dropped (as vLLM runs MLA's prefill on
        # FlashAttention-2): the padding's FLOPs are hardware work, not model FLOPs
        # (trainwise.cost.flops.mla_padding_flops).
        if self.dv < self.nope + self.rope_dim:
            v = F.pad(v, (0, self.nope + self.rope_dim - self.dv))  # (B, S, nh, n + r)
        y = self.core(q, k, v.transpose(1, 2), causal)[..., :self.dv]  # (B, nh, T, dv)
        return self.out(rearrange(y, "b h t d -> b t (h d)"))

    @staticmethod
    def latent_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """A latent RMSNorm in its weight's dtype: under autocast the down projection's output is bf16/fp16,
        and RMSNorm computes in fp32 anyway (as DeepSeek's and transformers' DeepseekV3RMSNorm do), so
        the cast is made here rather than by PyTorch's slower unfused fallback for mismatched dtypes."""
        return norm(x.to(norm.weight.dtype))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """softmax(q k^T / sqrt(n + r)) v through SDPA; replaceable from outside, as Attention.core."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              dropout_p=self.dropout if self.training else 0.0)
