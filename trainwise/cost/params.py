"""Parameter counts of the model trainwise builds (and of MLA, counted as HF DeepseekV3 does).

Every count is exact: tests compare them, to the parameter, with `transformers`' `num_parameters()`.
Convention (as `num_parameters(exclude_embeddings=True)`): "embedding" is the token table wte plus a
learned position table wpe; an untied LM head is non-embedding. Tied weights are counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total: int  # every parameter, every expert
    active: int  # what one token uses: routed experts counted top_k times instead of n_experts
    embedding: int  # wte (+ wpe)
    non_embedding: int  # total - embedding


def linear_params(d_in: int, d_out: int, bias: bool) -> int:
    """A Linear layer: d_in*d_out weights + d_out biases."""
    return d_in * d_out + (d_out if bias else 0)


def norm_params(cfg: ModelConfig, width: int | None = None) -> int:
    """LayerNorm: weight (+ bias iff cfg.bias); RMSNorm: weight only."""
    width = cfg.d_model if width is None else width
    return width * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def mha_params(cfg: ModelConfig) -> int:
    """q (H -> nh*hd), k and v (H -> nkv*hd), o (nh*hd -> H); biases on all iff bias, on q/k/v iff
    qkv_bias; qk_norm adds two RMSNorm(hd) weights; attention sinks one logit per query head (gpt-oss)."""
    H, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    qkv_bias = cfg.bias or cfg.qkv_bias
    n = linear_params(H, q, qkv_bias) + 2 * linear_params(H, kv, qkv_bias) + linear_params(q, H, cfg.bias)
    return n + (2 * cfg.head_dim if cfg.qk_norm else 0) + (cfg.n_heads if cfg.attention_sinks else 0)


def mla_params(cfg: ModelConfig) -> int:
    """DeepSeek-V2/V3 multi-head latent attention (DeepSeek-V2 paper, section 2.1; HF DeepseekV3Attention):
    q: H -> q_lora_rank (+RMSNorm) -> nh*(nope+rope), or H -> nh*(nope+rope) when q_lora_rank = 0;
    kv: H -> kv_lora_rank + rope (+RMSNorm(kv_lora_rank)) -> nh*(nope+v); o: nh*v -> H."""
    H, nh = cfg.d_model, cfg.n_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = linear_params(H, cfg.q_lora_rank, cfg.bias) + cfg.q_lora_rank + cfg.q_lora_rank * nh * qk
    else:
        q = H * nh * qk
    kv = (linear_params(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.bias) + cfg.kv_lora_rank
          + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    return q + kv + linear_params(nh * cfg.v_head_dim, H, cfg.bias)


def attention_params(cfg: ModelConfig) -> int:
    return mla_params(cfg) if cfg.attention == "mla" else mha_params(cfg)


def mlp_params(d_model: int, hidden: int, gated: bool, bias: bool) -> int:
    """Gated (SwiGLU/GeGLU): gate and up H -> F, down F -> H; plain: fc H -> F, proj F -> H."""
    up = linear_params(d_model, hidden, bias) * (2 if gated else 1)
    return up + linear_params(hidden, d_model, bias)


def moe_params(cfg: ModelConfig, experts_used: int) -> int:
    """Router (H -> E; a bias of E on its logits with router_logit_bias (gpt-oss); router_bias's E choice
    biases are a buffer, set by a rule, not a parameter)
    + `experts_used` routed experts, each an MLP of width expert_ffn_hidden, + the n_shared_experts
    always-on experts, built as one MLP of width n_shared_experts * expert_ffn_hidden (the same count as
    separate experts without biases)."""
    expert = mlp_params(cfg.d_model, cfg.expert_ffn_hidden, cfg.gated, cfg.bias)
    shared = mlp_params(cfg.d_model, cfg.n_shared_experts * cfg.expert_ffn_hidden, cfg.gated, cfg.bias)
    router = (cfg.d_model + cfg.router_logit_bias) * cfg.n_experts
    return router + experts_used * expert + (shared if cfg.n_shared_experts else 0)


def layer_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """One pre-norm block: norm1 + attention + norm2 + (dense MLP or MoE)."""
    if cfg.is_moe_layer(layer):
        mlp = moe_params(cfg, cfg.top_k if active else cfg.n_experts)
    else:
        mlp = mlp_params(cfg.d_model, cfg.ffn_hidden, cfg.gated, cfg.bias)
    return 2 * norm_params(cfg) + attention_params(cfg) + mlp


def embedding_params(cfg: ModelConfig) -> int:
    """wte (V x H) + wpe (max_seq_len x H) when positions are learned."""
    return cfg.vocab_size * cfg.d_model + (cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0)


def params(cfg: ModelConfig) -> ParamCount:
    """Exact parameter count: embeddings + L blocks + final norm + LM head (unless tied)."""
    embedding = embedding_params(cfg)
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    rest = norm_params(cfg) + head
    total = embedding + rest + sum(layer_params(cfg, i) for i in range(cfg.n_layers))
    active = embedding + rest + sum(layer_params(cfg, i, active=True) for i in range(cfg.n_layers))
    return ParamCount(total=total, active=active, embedding=embedding, non_embedding=total - embedding)
