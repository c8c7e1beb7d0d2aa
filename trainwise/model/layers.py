"""The layers a block is made of: norms, rotary position embedding, activations, the MLP.

Shapes in comments: B batch, T tokens, H d_model, hd head dimension, F MLP width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainwise.config import ModelConfig


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, hd), in the rotate-half layout Llama uses (RoFormer, eq. 34)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference form (fp32 arithmetic): x (B, heads, T, hd); cos, sin (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each pair (x1, x2) = (x[..., i], x[..., i + hd/2]) turned by its angle: (x1 cos - x2 sin,
    x2 cos + x1 sin). cos, sin are the half tables (hd/2 columns), broadcastable to x's halves.
    Written into one output with four in-place ops: no concatenation, no negated copy."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin)
    return out


class Rotary(torch.autograd.Function):
    """RoPE as one autograd node: a rotation's gradient is the rotation by minus the angle, so backward
    is the same four ops with -sin and saves nothing but the tables. Equals apply_rope (up to rounding
    in x's dtype) on x (B, T, heads, hd) with cos, sin (T, 1, hd/2)."""

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


class MLP(nn.Module):
    """Two matrices (H->F->H), or three for gated activations: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or cfg.ffn_hidden
        self.gated = cfg.gated
        self.act = ACTIVATION_FNS[cfg.activation]
        # For gated MLPs gate and up are one (H) -> (2F) matmul; same parameters as two.
        self.fc = nn.Linear(cfg.d_model, 2 * hidden if self.gated else hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.proj(self.act(gate) * up)
        return self.proj(self.act(h))
