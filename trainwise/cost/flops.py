"""Training FLOPs: the 6ND rule and an exact per-layer matmul count of the model trainwise builds.

Convention (docs/ARCHITECTURE.md, "Counting FLOPs, MFU and HFU"): a multiply-add is 2 FLOPs, matmul
(M,K)x(K,N) = 2MNK; only matmuls are counted (norms, softmax, activations, bias adds and the residual are
O(H) per token and left out, as in Kaplan et al. 2020 table 1 and PaLM appendix B). Backward = 2x forward.
Attention score/value matmuls are not halved for causal masking unless asked (PaLM convention).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.config import ModelConfig
from trainwise.cost.params import mha_params, mla_params, mlp_params

RECOMPUTE = ("none", "selective", "op", "full")


def six_nd(n_params: float, tokens: float) -> float:
    """C = 6 N D (Kaplan et al. 2020, section 2.1): 2ND forward + 4ND backward."""
    return 6.0 * n_params * tokens


def matmul_flops(m: int, k: int, n: int) -> int:
    """(M,K) x (K,N) = 2 M K N FLOPs."""
    return 2 * m * k * n




def attention_core_flops(cfg: ModelConfig, seq_len: int, causal_halving: bool = False) -> float:
    """Per token, forward: scores Q K^T = 2 T nh d_qk, values A V = 2 T nh d_v (Megatron-LM paper,
    Narayanan et al. 2021 appendix; PaLM appendix B). Halved under causal_halving."""
    if cfg.attention == "mla":
        d_qk, d_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        d_qk = d_v = cfg.head_dim
    f = 2.0 * seq_len * cfg.n_heads * (d_qk + d_v)
    return f / 2 if causal_halving else f


def attention_proj_flops(cfg: ModelConfig) -> float:
    """Per token, forward: 2 x (weights of the q/k/v/o projections); for MLA all its down/up projections."""
    if cfg.attention == "mla":
        n = mla_params(cfg) - cfg.kv_lora_rank - (cfg.q_lora_rank or 0)  # minus the two RMSNorm weights
    else:
        n = mha_params(cfg) - (2 * cfg.head_dim if cfg.qk_norm else 0)
    H, bias_terms = cfg.d_model, 0
    if cfg.attention == "mha":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        bias_terms = (q + 2 * kv if (cfg.bias or cfg.qkv_bias) else 0) + (H if cfg.bias else 0)
    elif cfg.bias:
        bias_terms = cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim + H
    return 2.0 * (n - bias_terms)


def mlp_flops(cfg: ModelConfig, hidden: int) -> float:
    """Per token, forward: 2 x (3HF) gated, 2 x (2HF) plain."""
    return 2.0 * mlp_params(cfg.d_model, hidden, cfg.gated, bias=False)


def moe_flops(cfg: ModelConfig) -> float:
    """Per token, forward: router 2HE + (top_k + n_shared) experts of width expert_ffn_hidden
    (Switch Transformer, Fedus et al. 2022: FLOPs follow active, not total, parameters)."""
    return (2.0 * cfg.d_model * cfg.n_experts
            + (cfg.top_k + cfg.n_shared_experts) * mlp_flops(cfg, cfg.expert_ffn_hidden))


def lm_head_flops(cfg: ModelConfig) -> float:
    """Per token, forward: 2HV (also when tied to the embedding, which costs 0 FLOPs itself)."""
    return 2.0 * cfg.d_model * cfg.vocab_size


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token, by part (sums over layers)."""

    embedding: float
    attention_proj: float
    attention_core: float
    mlp: float
    router_and_experts: float
    lm_head: float

    @property
    def total(self) -> float:
        return (self.embedding + self.attention_proj + self.attention_core + self.mlp + self.router_and_experts
                + self.lm_head)

    @property
    def blocks(self) -> float:
        return self.attention_proj + self.attention_core + self.mlp + self.router_and_experts


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal_halving: bool = False) -> ForwardFlops:
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    n_dense = cfg.n_layers - n_moe
    return ForwardFlops(
        embedding=0.0,  # a table lookup
        attention_proj=cfg.n_layers * attention_proj_flops(cfg),
        attention_core=cfg.n_layers * attention_core_flops(cfg, seq_len, causal_halving),
        mlp=n_dense * mlp_flops(cfg, cfg.ffn_hidden),
        router_and_experts=n_moe * moe_flops(cfg) if n_moe else 0.0,
        lm_head=lm_head_flops(cfg),
    )


def loss_recompute_flops_per_token(cfg: ModelConfig) -> float:
    """Per token: 2HV with model.loss_chunk_tokens > 0, else 0. The chunked cross-entropy
    (trainwise.model.loss) recomputes each chunk's logits in backward, a second LM-head matmul; like
    activation checkpointing this is hardware work, not model FLOPs (MFU keeps 6HV for the head)."""
    return lm_head_flops(cfg) if cfg.loss_chunk_tokens else 0.0


def mla_padding_flops_per_token(fwd: ForwardFlops, cfg: ModelConfig, checkpointing: str = "none") -> float:
    """Per token, training: what trainwise.model.attention.LatentAttention runs beyond MLA's model FLOPs.
    It pads v with zeros from v_head_dim to the query's head dim d_qk = qk_nope + qk_rope (the flash kernels
    take one head dim), so each value matmul is 2 T nh d_qk instead of 2 T nh dv: the attention core
    (scores d_qk + values dv) grows by (d_qk - dv) / (d_qk + dv), in the forward, the backward (2x) and a
    recomputed forward (selective or full checkpointing). Hardware work (HFU), not model FLOPs (MFU); 0
    for MHA or dv = d_qk."""
    if cfg.attention != "mla":
        return 0.0
    qk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    passes = 3 + (checkpointing in ("selective", "full"))
    return passes * fwd.attention_core * (qk - dv) / (qk + dv)


def recompute_flops_per_token(fwd: ForwardFlops, checkpointing: str, cfg: ModelConfig | None = None) -> float:
    """Extra forward work in backward: full = every block's forward again (not the LM head);
    selective = the attention core only (Korthikanti et al. 2022, section 5). With `cfg`, plus the
    chunked loss's LM-head recompute (loss_recompute_flops_per_token) and MLA's padded value matmuls
    (mla_padding_flops_per_token): every FLOP the step runs beyond the model's.

    With `cfg`, full recompute describes what PyTorch's non-reentrant checkpoint really runs: it stops
    recomputing once every tensor backward needs is back (`torch.utils.checkpoint`, early stop, on by
    default), and a dense block's last matmul, the MLP down projection 2FH, produces no saved tensor,
    so it is not re-run. (Measured with trainwise.measure.flopcount; MoE layers end in the weighted
    combine, which needs the experts' outputs, so they recompute in full.)"""
    if cfg is None:  # op-level recompute depends on the projections' widths: it needs `cfg`
        return {"none": 0.0, "selective": fwd.attention_core, "full": fwd.blocks}[checkpointing]
    extra = loss_recompute_flops_per_token(cfg) + mla_padding_flops_per_token(fwd, cfg, checkpointing)
    if checkpointing == "full":
        n_dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.n_layers))
        return fwd.blocks - n_dense * 2.0 * cfg.ffn_hidden * cfg.d_model + extra
    if checkpointing == "op":  # the even matmuls of each block run again (memory.op_saved_bytes): k, the output
        # projection and a gated MLP's up; a plain MLP's second matrix is not (early stop: backward needs no
        # tensor it makes)
        q, kv, H = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_model
        per_layer = 2 * H * (kv + q) + (2 * H * cfg.ffn_hidden if cfg.gated else 0)
        return cfg.n_layers * per_layer + extra
    return {"none": 0.0, "selective": fwd.attention_core}[checkpointing] + extra


def _as_checkpointing(recompute: bool | str) -> str:
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    return recompute


def flops_per_token_train(cfg: ModelConfig, seq_len: int, causal_halving: bool = False,
                          recompute: bool | str = False) -> float:
    """Training FLOPs per token = 3 x forward (backward = 2x forward) + recompute.

    Model FLOPs (for MFU): recompute=False (the default), no recomputation of any kind. Hardware FLOPs
    (HFU): recompute = the run's activation checkpointing, "none", "selective" or "full" (True = "full"),
    which also adds the chunked loss's LM-head recompute when model.loss_chunk_tokens > 0 and MLA's
    padded value matmuls; without them "none" equals False."""
    fwd = forward_flops_per_token(cfg, seq_len, causal_halving)
    if recompute is False or recompute is None:
        return 3.0 * fwd.total
    return 3.0 * fwd.total + recompute_flops_per_token(fwd, _as_checkpointing(recompute), cfg)


def linear_train_flops(m: int, k: int, n: int) -> int:
    """A Linear layer (M,K)x(K,N) in training = forward 2MKN + backward 4MKN (dX = dY W^T and
    dW = X^T dY, two matmuls of the same size) = 6MKN FLOPs; with M = tokens, K N = parameters this is
    the per-layer form of 6ND (Kaplan et al. 2020, section 2.1)."""
    return 3 * matmul_flops(m, k, n)


def einsum_flops(equation: str, *shapes: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Output shape and FLOPs of einsum(equation, *operands of these shapes), evaluated in one pass:
    FLOPs = prod(size of every distinct index) x (operands - 1 multiplies, + 1 add if an index is summed
    away), as opt_einsum.helpers.flop_count counts it. Two operands with a contraction: 2 x prod, e.g.
    "mk,kn->mn" = 2MKN (so (2,3)x(3,4) = 48). Implicit output (no "->") keeps the indices that occur once,
    sorted, as numpy/torch do."""
    eq = equation.replace(" ", "")
    lhs, _, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ValueError(f"'{equation}' has {len(terms)} operands but {len(shapes)} shapes were given")
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        if len(term) != len(shape):
            raise ValueError(f"operand '{term}' has {len(term)} indices but shape {tuple(shape)}")
        for idx, size in zip(term, shape):
            if sizes.setdefault(idx, int(size)) != int(size):
                raise ValueError(f"index '{idx}' has sizes {sizes[idx]} and {size}")
    if "->" not in eq:
        out = "".join(sorted(i for i in sizes if lhs.count(i) == 1))
    total = 1
    for size in sizes.values():
        total *= size
    summed = any(i not in out for i in sizes)
    factor = max(1, len(terms) - 1) + (1 if summed else 0)
    return tuple(sizes[i] for i in out), total * factor
