"""The weights of the gpt_oss family (GptOssForCausalLM, transformers >= 4.55; checked with 5.24): every
layer MoE with biased experts and router, attention with q/k/v/o biases and a sink logit per head. Its
config.json, both ways, is trainwise.hf_families's.

Weight layouts (trainwise -> HF): the fused `attn.qkv` (out = [q | k | v]) splits into q_proj/k_proj/v_proj,
weights and biases; attn.sinks -> self_attn.sinks; mlp.router -> mlp.router (weight and bias). The experts
are stacked (E, in, out) on both sides: experts_fc (E, H, 2F) -> experts.gate_up_proj, experts_proj (E, F, H)
-> experts.down_proj, each with its bias. trainwise's fused gate and up are two halves ([gate F | up F]);
gpt-oss interleaves them column by column (gate 0, up 0, gate 1, up 1, ...), so they are permuted both ways.
The Hub's own files hold the experts in MXFP4 (`*_blocks`, `*_scales`), which their config.json's
quantization_config says: --init-from refuses those (hf_families.gpt_oss_check_buildable); a checkpoint
re-saved by transformers, dequantized, loads.
"""

from __future__ import annotations

import torch

from trainwise.config import ModelConfig
from trainwise.export.names import shared_from_hf, shared_to_hf


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[gate F | up F] on the last dimension -> (gate 0, up 0, gate 1, up 1, ...)."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _halves(t: torch.Tensor) -> torch.Tensor:
    """The inverse of _interleave: (gate 0, up 0, ...) -> [gate F | up F]."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def to_hf(cfg: ModelConfig, s: dict) -> dict:
    """trainwise state dict -> GptOssForCausalLM tensors."""
    out = shared_to_hf(cfg, s)
    sizes = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            for name, part in zip("qkv", s[b + f"attn.qkv.{kind}"].split(sizes)):
                out[h + f"self_attn.{name}_proj.{kind}"] = part
            out[h + f"self_attn.o_proj.{kind}"] = s[b + f"attn.out.{kind}"]
            out[h + f"mlp.router.{kind}"] = s[b + f"mlp.router.{kind}"]
        out[h + "self_attn.sinks"] = s[b + "attn.sinks"]
        e = h + "mlp.experts."
        out[e + "gate_up_proj"] = _interleave(s[b + "mlp.experts_fc.weight"])  # (E, H, 2F)
        out[e + "gate_up_proj_bias"] = _interleave(s[b + "mlp.experts_fc.bias"])  # (E, 2F)
        out[e + "down_proj"] = s[b + "mlp.experts_proj.weight"]  # (E, F, H)
        out[e + "down_proj_bias"] = s[b + "mlp.experts_proj.bias"]  # (E, H)
    return out


def from_hf(cfg: ModelConfig, t: dict, take) -> dict:
    """GptOssForCausalLM tensors -> trainwise state dict. take(t, key) reads a tensor or says which is
    missing (trainwise.export.hf's)."""
    out = shared_from_hf(cfg, t, take)
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            out[b + f"attn.qkv.{kind}"] = torch.cat([take(t, h + f"self_attn.{n}_proj.{kind}") for n in "qkv"])
            out[b + f"attn.out.{kind}"] = take(t, h + f"self_attn.o_proj.{kind}")
            out[b + f"mlp.router.{kind}"] = take(t, h + f"mlp.router.{kind}")
        out[b + "attn.sinks"] = take(t, h + "self_attn.sinks")
        e = h + "mlp.experts."
        out[b + "mlp.experts_fc.weight"] = _halves(take(t, e + "gate_up_proj"))
        out[b + "mlp.experts_fc.bias"] = _halves(take(t, e + "gate_up_proj_bias"))
        out[b + "mlp.experts_proj.weight"] = take(t, e + "down_proj")
        out[b + "mlp.experts_proj.bias"] = take(t, e + "down_proj_bias")
    return out
