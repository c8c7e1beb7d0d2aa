"""The layers a block is made of: norms, rotary position embedding (with YaRN's stretch), activations,
the MLP.

Shapes in comments: B batch, T tokens, H d_model, hd head dimension, F MLP width.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainwise.config import ModelConfig


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, inv_freq: torch.Tensor | None = None,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, hd), in the rotate-half layout Llama uses (RoFormer, eq. 34).
    inv_freq (hd/2,): each pair's angle per position, theta^(-2i/hd) unless given (yarn_frequencies);
    `scale` multiplies both tables, so q and k come out of the rotation `scale` times longer."""
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def yarn_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models", sections
    3.2-3.4): RoPE trained on L = rope_original_max_seq_len positions, made to reach rope_factor x L.

    Pair i turns L theta^(-2i/hd) / 2pi times over L positions. Pairs that turn more than beta_fast times
    keep their frequency (training saw every angle they take many times over), pairs that turn fewer than
    beta_slow times are slowed rope_factor times (interpolated, as position interpolation does), and the
    pairs between blend the two along a linear ramp over the pair index (its ends rounded outwards with
    yarn_truncate). The attention factor 0.1 ln(rope_factor) + 1 multiplies both tables, so the logits
    q.k grow by its square: the paper's "temperature" (section 3.4), which offsets the flatter softmax of
    stretched positions. Returns (inv_freq (hd/2,), the attention factor); transformers' `yarn` rope_type
    without attention_factor or mscale computes the same."""
    hd, theta, factor = cfg.head_dim, cfg.rope_theta, cfg.rope_factor
    pos_freqs = theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # (hd/2,) positions per radian

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times over L
        return hd * math.log(cfg.rope_original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(cfg.yarn_beta_fast), pair_turning(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 0 to low, 1 from high
    keep = 1 - ramp  # the share of its own frequency each pair keeps
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference form (fp32 arithmetic): x (B, heads, T, hd); cos, sin (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (x1, x2) = (x[..., i], x[..., i + hd/2]) turned by its angle: (x1 cos - x2 sin,
    x2 cos + x1 sin). cos, sin are the half tables (hd/2 columns), broadcastable to x's halves.
    Written into one output with four in-place ops: no concatenation, no negated copy; while torch.compile
    traces it, out of place (its tracer stops at an `out=` view, which splits a compiled block in two)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if torch.compiler.is_compiling():
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    out = torch.empty_like(x)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin)
    return out


class Rotary(torch.autograd.Function):
    """RoPE as one autograd node: a rotation's gradient is the rotation by minus the angle (scaled alike when
    the tables are, as YaRN's), so backward is the same four ops with -sin and saves nothing but the tables.
    Equals apply_rope (up to rounding in x's dtype) on x (B, T, heads, hd) with cos, sin (T, 1, hd/2)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, -sin), None, None


ACTIVATION_FNS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swiglu": F.silu,  # gate activation of the gated variants (Shazeer 2020, "GLU Variants")
    "geglu": lambda x: F.gelu(x, approximate="tanh"),
}


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit).
    g sigmoid(1.702 g) is GELU's sigmoid approximation (Hendrycks and Gimpel 2016); the clamps bound the
    product; with the + 1, up scales the activated gate around 1 (up = 0 passes it through unchanged)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _gate_act(gate: torch.Tensor, approximate: str | None) -> torch.Tensor:
    return F.silu(gate) if approximate is None else F.gelu(gate, approximate=approximate)


class GatedUnit(torch.autograd.Function):
    """act(gate) * up (SiLU, or GELU's `approximate` form) as one autograd node that saves only gate and up,
    views of the fused gate|up projection's output, and computes act(gate) again in backward: the two nodes
    autograd records for it keep act(gate) as well, F more per token. Backward runs their kernels on the same
    operands (silu_backward / gelu_backward of grad x up, and grad x act(gate)): the same gradients, bit for bit."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, approximate: str | None) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.approximate = approximate
        return _gate_act(gate, approximate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        # d_gate before d_up: the product grad x up is freed before act(gate) is computed again
        gate, up, approximate = *ctx.saved_tensors, ctx.approximate
        d_gate = (torch.ops.aten.silu_backward(grad * up, gate) if approximate is None
                  else torch.ops.aten.gelu_backward(grad * up, gate, approximate=approximate))
        return d_gate, _gate_act(gate, approximate).mul_(grad), None


def gated_activation(cfg: ModelConfig, one_node: bool = True) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(gate, up) -> the input of a gated MLP's down projection: act(gate) * up (Shazeer 2020, "GLU
    Variants"), as one GatedUnit node or (one_node=False) autograd's two, or clamped_swiglu with the config's
    alpha and limit."""
    if cfg.activation == "clamped_swiglu":
        return functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    approximate = {"swiglu": None, "geglu": "tanh"}[cfg.activation]  # ACTIVATION_FNS' gate activations
    if one_node:
        return lambda gate, up: GatedUnit.apply(gate, up, approximate)
    return lambda gate, up: _gate_act(gate, approximate) * up


def split_matmuls(linear: nn.Module, parts: list[int], x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` as one matmul per block of its output features (`parts`), concatenated: the same values
    as the fused projection, run as the unfused projections' matmuls (op-level selective checkpointing
    keeps every other matmul's output, counted one by one). A module already split (runtime.fused
    .SplitLinear) runs its parts anyway."""
    if not isinstance(linear, nn.Linear):
        return linear(x)
    biases = linear.bias.split(parts) if linear.bias is not None else [None] * len(parts)
    return torch.cat([F.linear(x, w, b) for w, b in zip(linear.weight.split(parts), biases)], dim=-1)


class MLP(nn.Module):
    """Two matrices (H->F->H), or three for gated activations: down(act(gate(x)) * up(x))."""

    split = False  # gate and up as two matmuls (split_matmuls): op-level checkpointing sets it

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or cfg.ffn_hidden
        self.gated = cfg.gated
        self.act = gated_activation(cfg) if self.gated else ACTIVATION_FNS[cfg.activation]
        # op-level checkpointing recomputes act(gate) * up anyway, and would keep what a GatedUnit saves
        self.act_recomputed = gated_activation(cfg, one_node=False) if self.gated else self.act
        # For gated MLPs gate and up are one (H) -> (2F) matmul; same parameters as two.
        self.fc = nn.Linear(cfg.d_model, 2 * hidden if self.gated else hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = split_matmuls(self.fc, [self.proj.in_features] * 2, x) if self.split and self.gated else self.fc(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.proj((self.act_recomputed if self.split else self.act)(gate, up))
        return self.proj(self.act(h))
