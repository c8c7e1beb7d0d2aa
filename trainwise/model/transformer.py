"""A decoder-only Transformer, built from one `ModelConfig`.

Shapes in comments: B batch, T tokens, H d_model, V vocab, L layers, nh query heads, nkv key/value
heads, hd head dimension, F MLP width. The model is plain PyTorch: activation checkpointing,
mixed precision, compilation and sharding are applied from outside (trainwise.runtime).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainwise.config import ModelConfig
from trainwise.errors import TrainwiseError
from trainwise.model.attention import Attention, KVCache, LatentAttention
from trainwise.model.layers import MLP, make_norm, rope_tables, yarn_frequencies
from trainwise.model.loss import chunked_cross_entropy
from trainwise.model.moe import MoE


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.norm1 = make_norm(cfg, cfg.d_model)
        self.attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg, layer)
        self.norm2 = make_norm(cfg, cfg.d_model)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple | None = None, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), rope, cache, self.layer))
        return x + self.drop(self.mlp(self.norm2(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.position == "rope":
            inv_freq, scale = yarn_frequencies(cfg) if cfg.rope_scaling == "yarn" else (None, 1.0)
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, inv_freq, scale)
            half = cfg.head_dim // 2  # the tables repeat after hd/2 columns; rotate() takes one half
            self.register_buffer("rope_cos", cos[:, :half].contiguous(), persistent=False)
            self.register_buffer("rope_sin", sin[:, :half].contiguous(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, zero biases, unit norms; residual output projections scaled by
        1/sqrt(2L) so the residual stream's variance does not grow with depth (GPT-2 paper, sec. 2.3)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" in name:
                nn.init.ones_(p)
            elif name.endswith(("out.weight", "proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> (B, T, H) final-normed hidden states."""
        T = idx.shape[1]
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(idx)  # (B, T, H)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(start, start + T, device=idx.device))
        x = self.drop(x)
        rope = None
        if self.cfg.position == "rope":
            rope = (self.rope_cos[start:start + T], self.rope_sin[start:start + T])
        for block in self.blocks:
            x = block(x, rope, cache)
        if cache is not None:
            cache.length += T
        return self.norm(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) when targets is None, else the mean next-token cross-entropy (scalar),
        plus the MoE auxiliary losses when the model has MoE layers."""
        x = self.hidden_states(idx)
        if targets is not None and self.cfg.loss_chunk_tokens:
            # the same loss without the whole (B*T, V) fp32 logits (trainwise.model.loss)
            loss = chunked_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                         self.cfg.loss_chunk_tokens)
            return loss + self.aux_loss()
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss + self.aux_loss()

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the MoE layers' load-balancing and router z-losses of the last forward (0 if dense)."""
        total = 0.0
        for block in self.blocks:
            if hasattr(block.mlp, "last_aux_loss"):
                total = total + block.mlp.last_aux_loss
        return total

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None,
                 stop_token: int | None = None) -> torch.Tensor:
        """Sample max_new_tokens continuations of idx (B, T) with a KV cache: each new token runs the
        model on one position. When the window is full, the cache is rebuilt from the last half."""
        was_training = self.training
        self.eval()
        dtype = next(self.parameters()).dtype
        window = self.cfg.max_seq_len
        cache = KVCache(self.cfg, idx.shape[0], idx.device, dtype)
        logits = self.lm_head(self.hidden_states(idx[:, -window:], cache))[:, -1]
        for _ in range(max_new_tokens):
            next_id = sample_next(logits.float(), temperature, top_k, top_p, generator)  # (B, 1)
            idx = torch.cat([idx, next_id], dim=1)
            if stop_token is not None and bool((next_id == stop_token).all()):
                break
            if cache.length >= window:
                cache = KVCache(self.cfg, idx.shape[0], idx.device, dtype)
                logits = self.lm_head(self.hidden_states(idx[:, -(window // 2):], cache))[:, -1]
            else:
                logits = self.lm_head(self.hidden_states(next_id, cache))[:, -1]
        self.train(was_training)
        return idx


class NonFiniteLogits(TrainwiseError):
    """Sampling from a model whose outputs are nan or inf."""


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> token ids (B, 1). temperature 0 = greedy; top-k then nucleus (top-p) filtering."""
    if not torch.isfinite(logits).all():
        raise NonFiniteLogits("the model's next-token logits are not finite: its weights diverged (a learning rate "
                              "or weight decay too large), so there is no distribution to sample from")
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) > top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
