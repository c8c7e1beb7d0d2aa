"""Fused projections split into their parts, and joined again, for the runs that divide a model.

The model fuses matrices that read the same input: attention's q, k and v are one Linear (rows
[q | k | v]), a gated MLP's gate and up one Linear (rows [gate | up]), a MoE layer's experts' gate and
up one (E, H, 2F) weight. Tensor parallelism gives each rank a contiguous block of every matrix's
output features, which for a fused matrix would hand rank 0 all of q and rank 1 all of v. So before a
model is divided, each fused matrix becomes its parts (a SplitLinear of Linears q, k, v; a SplitExperts
of ExpertLinears gate, up), which tensor parallelism shards one by one; the part outputs are
concatenated again, so each rank computes [q_r | k_r | v_r], the layout the model's forward expects of
its own heads. The values are the same as the fused matmul's (column blocks of one product).

Every model-parallel layout uses the split form, so their (DCP) checkpoints share one set of keys
("blocks.0.attn.qkv.q.weight", ...) and load into one another; `join_fused` makes a split model plain
again for one process (sampling, export).
"""

from __future__ import annotations

import torch
from torch import nn

from trainwise.model.attention import Attention
from trainwise.model.layers import MLP
from trainwise.model.moe import ExpertLinear, MoE


class SplitLinear(nn.ModuleDict):
    """A Linear held as its output blocks (Linears in order); forward concatenates their outputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.values()], dim=-1)


class SplitExperts(nn.Module):
    """An ExpertLinear whose output features are two ExpertLinears, gate and up. MoE reads `weight` and
    `bias` (E, H, 2F) and (E, 2F), and calls forward_expert: both are the parts concatenated."""

    def __init__(self, gate: ExpertLinear, up: ExpertLinear):
        super().__init__()
        self.gate, self.up = gate, up

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.gate.weight, self.up.weight], dim=-1)

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.gate.bias is None else torch.cat([self.gate.bias, self.up.bias], dim=-1)

    def forward_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.gate.forward_expert(e, x), self.up.forward_expert(e, x)], dim=-1)

    def forward_grouped(self, x: torch.Tensor, offsets: torch.Tensor, expert_of: torch.Tensor) -> torch.Tensor:
        """One grouped matmul per part, outputs concatenated: `weight` would concatenate the parts' weights
        at every forward, a copy the grouped matmul saves for backward in each micro-batch in flight."""
        return torch.cat([self.gate.forward_grouped(x, offsets, expert_of),
                          self.up.forward_grouped(x, offsets, expert_of)], dim=-1)


def _split_linear(linear: nn.Linear, parts: dict[str, int]) -> SplitLinear:
    out = SplitLinear()
    weights = linear.weight.detach().split(list(parts.values()))
    biases = linear.bias.detach().split(list(parts.values())) if linear.bias is not None else [None] * len(parts)
    for (name, width), w, b in zip(parts.items(), weights, biases):
        part = nn.Linear(linear.in_features, width, bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            part.weight.copy_(w)
            if b is not None:
                part.bias.copy_(b)
        out[name] = part
    return out


def _split_experts(fc: ExpertLinear) -> SplitExperts:
    E, d_in, two_f = fc.weight.shape
    halves = []
    for w, b in zip(fc.weight.detach().chunk(2, dim=-1),
                    fc.bias.detach().chunk(2, dim=-1) if fc.bias is not None else (None, None)):
        part = ExpertLinear(E, d_in, two_f // 2, bias=b is not None).to(w.device, w.dtype)
        with torch.no_grad():
            part.weight.copy_(w)
            if b is not None:
                part.bias.copy_(b)
        halves.append(part)
    return SplitExperts(*halves)


def split_fused(model: nn.Module) -> nn.Module:
    """Replace, in place, every fused projection of `model`'s blocks by its parts (same values)."""
    for module in list(model.modules()):
        if isinstance(module, Attention) and not isinstance(module.qkv, SplitLinear):
            q, kv = module.n_heads * module.head_dim, module.n_kv_heads * module.head_dim
            module.qkv = _split_linear(module.qkv, {"q": q, "k": kv, "v": kv})
        elif isinstance(module, MLP) and module.gated and not isinstance(module.fc, SplitLinear):
            width = module.proj.in_features
            module.fc = _split_linear(module.fc, {"gate": width, "up": width})
        elif isinstance(module, MoE) and module.gated and not isinstance(module.experts_fc, SplitExperts):
            module.experts_fc = _split_experts(module.experts_fc)
    return model


def join_fused(model: nn.Module) -> nn.Module:
    """The inverse of split_fused, in place: each split projection becomes one module again."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, SplitLinear):
                parts = list(child.values())
                fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts),
                                  bias=parts[0].bias is not None, device=parts[0].weight.device,
                                  dtype=parts[0].weight.dtype)
                with torch.no_grad():
                    fused.weight.copy_(torch.cat([p.weight for p in parts]))
                    if fused.bias is not None:
                        fused.bias.copy_(torch.cat([p.bias for p in parts]))
                setattr(module, name, fused)
            elif isinstance(child, SplitExperts):
                E, d_in, f = child.gate.weight.shape
                fused = ExpertLinear(E, d_in, 2 * f, bias=child.gate.bias is not None).to(child.gate.weight.device)
                with torch.no_grad():
                    fused.weight.copy_(child.weight)
                    if fused.bias is not None:
                        fused.bias.copy_(child.bias)
                setattr(module, name, fused)
    return model
