"""The weights of the deepseek_v3 family (DeepseekV3ForCausalLM, transformers >= 4.57; checked with 5.24):
multi-head latent attention, dense layers first, then sigmoid-routed MoE layers with shared experts, a
choice bias (e_score_correction_bias), group-limited routing and a routed scaling factor. Its config.json,
both ways, is trainwise.hf_config's.

Weight layouts (trainwise -> HF): attn.q_down/q_norm/q_up -> self_attn.q_a_proj/q_a_layernorm/q_b_proj
(or attn.q_proj -> self_attn.q_proj), attn.kv_down/kv_norm/kv_up -> kv_a_proj_with_mqa/kv_a_layernorm/
kv_b_proj, attn.out -> o_proj; the fused gated MLPs (out = [gate | up]) split into gate_proj/up_proj; the
stacked experts (E, in, out) into one (out, in) Linear per expert (the Hub files' layout); mlp.expert_bias
-> mlp.gate.e_score_correction_bias. trainwise turns the rotary half of q and k in the rotate-half layout;
a checkpoint with rope_interleave (transformers' default, and the Hub's DeepSeek-V3 files) keeps those rows
in interleaved pairs, so they are permuted on import, and export writes rope_interleave = false.
Multi-token prediction (num_nextn_predict_layers, transformers 5's num_mtp_layers) is not built, as
transformers' DeepseekV3ForCausalLM does not build it: its tensors, if a checkpoint has them, stay out.
"""

from __future__ import annotations

import torch

from trainwise.config import ModelConfig
from trainwise.export.names import shared_from_hf, shared_to_hf


def _rope_order(width: int) -> torch.Tensor:
    """Rows of an interleaved rotary part ((x0, x1), (x2, x3), ...) in the rotate-half order
    (x0, x2, ..., x1, x3, ...): HF's apply_rotary_pos_emb_interleave reorders them so."""
    return torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])


def _permute_rope(w: torch.Tensor, heads: int, nope: int, rope: int, inverse: bool = False) -> torch.Tensor:
    """The rotary rows of a (heads x (nope + rope), in) projection, reordered (see _rope_order)."""
    order = _rope_order(rope)
    if inverse:
        order = torch.argsort(order)
    w = w.unflatten(0, (heads, nope + rope))
    return torch.cat([w[:, :nope], w[:, nope:][:, order]], dim=1).flatten(0, 1)


def _split_fc(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = t.chunk(2, dim=0)
    return gate, up


def to_hf(cfg: ModelConfig, s: dict) -> dict:
    """trainwise state dict -> DeepseekV3ForCausalLM tensors (Hub layout)."""
    out = shared_to_hf(cfg, s)
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for tw, hf in _ATTENTION.items():
            if b + tw in s:
                out[h + hf] = s[b + tw]
        if cfg.is_moe_layer(i):
            m = h + "mlp."
            out[m + "gate.weight"] = s[b + "mlp.router.weight"]
            out[m + "gate.e_score_correction_bias"] = s.get(b + "mlp.expert_bias", torch.zeros(cfg.n_experts))
            fc, proj = s[b + "mlp.experts_fc.weight"], s[b + "mlp.experts_proj.weight"]  # (E, H, 2F), (E, F, H)
            F = cfg.expert_ffn_hidden
            for e in range(cfg.n_experts):
                out[m + f"experts.{e}.gate_proj.weight"] = fc[e, :, :F].T
                out[m + f"experts.{e}.up_proj.weight"] = fc[e, :, F:].T
                out[m + f"experts.{e}.down_proj.weight"] = proj[e].T
            mlp, hf_mlp = b + "mlp.shared.", m + "shared_experts."
        else:
            mlp, hf_mlp = b + "mlp.", h + "mlp."
        out[hf_mlp + "gate_proj.weight"], out[hf_mlp + "up_proj.weight"] = _split_fc(s[mlp + "fc.weight"])
        out[hf_mlp + "down_proj.weight"] = s[mlp + "proj.weight"]
    return out


# trainwise attention parameter -> HF's (the same tensors; the rotary rows are in rotate-half order on both
# sides once rope_interleave = false)
_ATTENTION = {"attn.q_down.weight": "self_attn.q_a_proj.weight", "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
              "attn.q_up.weight": "self_attn.q_b_proj.weight", "attn.q_proj.weight": "self_attn.q_proj.weight",
              "attn.kv_down.weight": "self_attn.kv_a_proj_with_mqa.weight",
              "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
              "attn.kv_up.weight": "self_attn.kv_b_proj.weight",
              "attn.out.weight": "self_attn.o_proj.weight"}


def from_hf(cfg: ModelConfig, t: dict, take, experts, interleaved: bool) -> dict:
    """DeepseekV3ForCausalLM tensors (Hub layout, or transformers 5's stacked experts) -> trainwise state dict.
    take(t, key) reads a tensor or says which is missing; experts(cfg, t, hf_prefix, prefix) reads an MoE
    layer's router and experts (trainwise.export.hf's, shared with Mixtral and Qwen3-MoE)."""
    out = shared_from_hf(cfg, t, take)
    heads, nope, rope = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for tw, hf in _ATTENTION.items():
            if tw.startswith("attn.q_") and (tw == "attn.q_proj.weight") == bool(cfg.q_lora_rank):
                continue
            out[b + tw] = take(t, h + hf)
        if interleaved:
            q = b + ("attn.q_up.weight" if cfg.q_lora_rank else "attn.q_proj.weight")
            out[q] = _permute_rope(out[q], heads, nope, rope)
            kv = out[b + "attn.kv_down.weight"]
            C = cfg.kv_lora_rank  # kv_down's rows: the latent's C, then the shared rotary key's
            out[b + "attn.kv_down.weight"] = torch.cat([kv[:C], kv[C:][_rope_order(rope)]])
        if cfg.is_moe_layer(i):
            m = h + "mlp."
            out.update(experts(cfg, t, m, b + "mlp."))
            out[b + "mlp.expert_bias"] = t.get(m + "gate.e_score_correction_bias", torch.zeros(cfg.n_experts))
            mlp, hf_mlp = b + "mlp.shared.", m + "shared_experts."
        else:
            mlp, hf_mlp = b + "mlp.", h + "mlp."
        out[mlp + "fc.weight"] = torch.cat([take(t, hf_mlp + "gate_proj.weight"), take(t, hf_mlp + "up_proj.weight")])
        out[mlp + "proj.weight"] = take(t, hf_mlp + "down_proj.weight")
    return out
