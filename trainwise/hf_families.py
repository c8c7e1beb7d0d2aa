"""The two families whose config.json describes more than the Llama-like core, both ways: deepseek_v3 and
gpt_oss. trainwise.hf_config reads the fields every gated family shares and asks this module for the rest
(reading: `*_fields`; export: `*_problems`, `*_config`). Their weights' layouts are trainwise.export's.

deepseek_v3 (DeepseekV3ForCausalLM): multi-head latent attention; dense layers first, then MoE layers with
shared experts, sigmoid routing with a choice bias (e_score_correction_bias), group-limited routing and a
routed scaling factor.

gpt_oss (GptOssForCausalLM, transformers >= 4.55; OpenAI's gpt-oss-120b and gpt-oss-20b):
- every layer MoE, routed by a softmax over the top-k logits of a router with a bias; experts with biases
  and a clamped SwiGLU (swiglu_alpha, swiglu_limit), gate and up interleaved in one weight;
- attention with biases on q, k, v and o, a learned sink logit per head, and sliding-window layers
  (`layer_types`, `sliding_window`): trainwise's full_attention_every pattern;
- YaRN RoPE (`rope_parameters`, transformers 4.x's `rope_scaling`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainwise.config import ModelConfig
from trainwise.errors import TrainwiseError

# ---------------------------------------------------------------------------------------------------
# deepseek_v3


def deepseek_fields(d: dict[str, Any], n_layers: int, need: Callable[[str], Any]) -> dict[str, Any]:
    """The ModelConfig fields of a deepseek_v3 config.json (the Hub's names, class defaults filled in) that
    the gated families do not share; need(key) reads a required field."""
    out = dict(attention="mla", q_lora_rank=d["q_lora_rank"] or 0, kv_lora_rank=need("kv_lora_rank"),
               qk_nope_head_dim=need("qk_nope_head_dim"), qk_rope_head_dim=need("qk_rope_head_dim"),
               v_head_dim=need("v_head_dim"), head_dim=d.get("qk_rope_head_dim"))
    dense = max(d["first_k_dense_replace"], 0)
    if dense >= n_layers:  # no MoE layer
        return out
    return dict(out, n_experts=need("n_routed_experts"), top_k=need("num_experts_per_tok"),
                expert_ffn_hidden=need("moe_intermediate_size"), first_dense_layers=dense, moe_every=1,
                n_shared_experts=d["n_shared_experts"] or 0, router_gating="sigmoid",
                # e_score_correction_bias: the choice bias (a buffer in both, set by a rule, not by gradients).
                # The multi-token prediction module (num_nextn_predict_layers): not built by transformers, nor here.
                router_bias=True, renormalize_top_k=bool(d["norm_topk_prob"]),
                routed_scaling_factor=float(d["routed_scaling_factor"]), router_groups=d["n_group"],
                router_group_top_k=d["topk_group"])


def deepseek_problems(cfg: ModelConfig) -> list[str]:
    """What keeps DeepseekV3ForCausalLM from representing cfg (latent attention) exactly."""
    problems = []
    if cfg.norm != "rmsnorm" or cfg.activation != "swiglu":
        problems.append("DeepSeek-V3 uses RMSNorm and swiglu MLPs")
    if cfg.bias or cfg.qkv_bias or cfg.qk_norm:
        problems.append("DeepSeek-V3 has no biases and no qk_norm")
    if cfg.is_moe:
        if cfg.moe_every != 1:
            problems.append("DeepSeek-V3 makes every layer after first_dense_layers MoE (moe_every = 1)")
        if cfg.n_shared_experts < 1:
            problems.append("DeepSeek-V3 has shared experts (model.n_shared_experts >= 1)")
        if cfg.router_gating != "sigmoid" or not cfg.dropless:
            problems.append("DeepSeek-V3 routes with sigmoid gating, dropless")
    return problems


def deepseek_config(cfg: ModelConfig) -> dict[str, Any]:
    """A deepseek_v3 config.json's fields beyond (or instead of) those hf_config.to_hf_dict writes for every
    gated family: every head has its own keys and values; head_dim is the rotated part's width."""
    moe = cfg.is_moe
    return {"num_key_value_heads": cfg.n_heads, "head_dim": cfg.qk_rope_head_dim, "rope_interleave": False,
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            # a dense model: every layer before first_k_dense_replace, no MoE layer built
            "first_k_dense_replace": cfg.first_dense_layers if moe else cfg.n_layers,
            "n_routed_experts": cfg.n_experts if moe else 1, "num_experts_per_tok": cfg.top_k if moe else 1,
            "moe_intermediate_size": cfg.expert_ffn_hidden if moe else cfg.ffn_hidden,
            "n_shared_experts": cfg.n_shared_experts if moe else 1, "norm_topk_prob": cfg.renormalize_top_k,
            "routed_scaling_factor": cfg.routed_scaling_factor, "n_group": cfg.router_groups,
            "topk_group": cfg.router_group_top_k, "num_nextn_predict_layers": 0}


# ---------------------------------------------------------------------------------------------------
# gpt_oss

SLIDING, FULL = "sliding_attention", "full_attention"

# Class defaults of the optional fields: transformers 5.24 configuration_gpt_oss.py. layer_types None means
# "derived": windowed layers 0, 2, 4, ..., full layers 1, 3, 5, ...
GPT_OSS_DEFAULTS: dict[str, Any] = dict(
    tie_word_embeddings=False, hidden_act="silu", num_key_value_heads=8, head_dim=64, attention_bias=True,
    rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072, sliding_window=128, layer_types=None,
    swiglu_alpha=1.702, swiglu_limit=7.0)
# The class's RoPE when a config.json has neither rope_parameters nor rope_scaling
GPT_OSS_YARN = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)


def gpt_oss_fields(d: dict[str, Any], n_layers: int, build: bool) -> dict[str, Any]:
    """The ModelConfig fields of a gpt_oss config.json (the Hub's names, class defaults filled in) that the
    gated families do not share; the expert count and top-k are read with the sizes (hf_config)."""
    if not d["attention_bias"]:
        raise TrainwiseError(
            "gpt_oss attention_bias = false leaves q, k, v and o without biases while the experts and the router "
            "keep theirs, which ModelConfig cannot describe (model.bias puts biases on every linear); every "
            "published gpt-oss has attention_bias = true.")
    return dict(activation="clamped_swiglu", swiglu_alpha=float(d["swiglu_alpha"]),
                swiglu_limit=float(d["swiglu_limit"]), bias=True, qkv_bias=False, router_logit_bias=True,
                attention_sinks=True, renormalize_top_k=True, **_windows(d, n_layers), **_rope(d, build))


def _windows(d: dict[str, Any], n_layers: int) -> dict[str, int]:
    """sliding_window and full_attention_every from layer_types: every full_attention_every-th layer full,
    the others windowed (no window: every layer full, or sliding_window null)."""
    types = d["layer_types"] or [SLIDING if (i + 1) % 2 else FULL for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {SLIDING, FULL}:
        raise TrainwiseError(f"the gpt_oss config.json's layer_types must name '{SLIDING}' or '{FULL}' for each "
                             f"of its {n_layers} layers; it has {types}.")
    full = [i for i, kind in enumerate(types) if kind == FULL]
    window = d["sliding_window"] or 0
    if not window or len(full) == n_layers:
        return dict(sliding_window=0, full_attention_every=0)
    every = full[0] + 1 if full else 0
    if full != [i for i in range(n_layers) if every and (i + 1) % every == 0]:
        raise TrainwiseError(
            f"the gpt_oss config.json has full attention on layers {full}, which is not 'every n-th layer' (the "
            "pattern trainwise builds: model.full_attention_every); change layer_types.")
    return dict(sliding_window=window, full_attention_every=every)


def _rope(d: dict[str, Any], build: bool) -> dict[str, Any]:
    """ModelConfig's rope_scaling fields from rope_parameters (5.x) or rope_scaling (4.x); {} for plain
    RoPE. build=True refuses what trainwise does not build (other rope types; YaRN's attention_factor or
    mscale, which replace 0.1 ln(factor) + 1); the planner counts those all the same."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or GPT_OSS_YARN
    kind = rope.get("rope_type", rope.get("type", "default"))
    changed = [key for key in ("attention_factor", "mscale", "mscale_all_dim") if rope.get(key)]
    if build and (kind not in ("default", "yarn") or changed):
        raise TrainwiseError(
            f"the gpt_oss config.json's RoPE (rope_type '{kind}'{', ' + ', '.join(changed) if changed else ''}) is "
            "not built by trainwise, which builds plain RoPE and YaRN with its own attention factor.")
    if kind != "yarn":
        return {}
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise TrainwiseError("the gpt_oss config.json's YaRN RoPE has no original_max_position_embeddings (the "
                             "context it was trained on; gpt-oss: 4096); add it.")
    # as transformers reads them: a missing factor is the stretch max_position_embeddings / original
    factor = rope.get("factor") or d["max_position_embeddings"] / original
    return dict(rope_scaling="yarn", rope_factor=float(factor), rope_original_max_seq_len=int(original),
                yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                yarn_truncate=bool(rope.get("truncate", True)))


def gpt_oss_check_buildable(d: dict[str, Any]) -> None:
    """What build=True refuses of a gpt_oss config.json besides what gpt_oss_fields refuses."""
    quantization = d.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise TrainwiseError(
            f"this gpt_oss checkpoint is quantized (quant_method '{method}': the Hub's files hold the experts in "
            "MXFP4); --init-from reads unquantized weights. Load it with transformers, dequantized "
            "(quantization_config=Mxfp4Config(dequantize=True)), and save_pretrained it first.")


def uses_gpt_oss(cfg: ModelConfig) -> bool:
    """Whether cfg has what, of the families export writes, only gpt_oss has."""
    return (cfg.attention_sinks or cfg.sliding_window > 0 or cfg.router_logit_bias or cfg.rope_scaling != "none"
            or cfg.activation == "clamped_swiglu")


def gpt_oss_problems(cfg: ModelConfig) -> list[str]:
    """What keeps GptOssForCausalLM from representing cfg exactly."""
    out = []
    if cfg.attention != "mha" or cfg.norm != "rmsnorm" or cfg.position != "rope" or cfg.qk_norm:
        out.append("gpt-oss has multi-head attention with RoPE and RMSNorm, and no qk_norm")
    if not cfg.is_moe or cfg.first_dense_layers or cfg.moe_every != 1 or cfg.n_shared_experts:
        out.append("every gpt-oss layer is MoE, without shared experts (n_experts > 0, first_dense_layers = 0, "
                   "moe_every = 1, n_shared_experts = 0)")
    if (cfg.router_gating != "softmax" or not cfg.renormalize_top_k or cfg.router_bias or cfg.router_groups != 1
            or cfg.routed_scaling_factor != 1 or not cfg.dropless):
        out.append("gpt-oss routes every token (dropless) by a softmax over its top-k logits (softmax gating, "
                   "renormalize_top_k, no router_bias, router_groups = 1, routed_scaling_factor = 1)")
    if cfg.activation != "clamped_swiglu":
        out.append(f"activation '{cfg.activation}': gpt-oss's experts use clamped_swiglu")
    if not (cfg.bias and cfg.router_logit_bias and cfg.attention_sinks):
        out.append("gpt-oss has biases on every linear and on the router's logits, and attention sinks (model.bias, "
                   "router_logit_bias and attention_sinks true)")
    if cfg.expert_ffn_hidden != cfg.ffn_hidden:
        out.append("gpt-oss's expert width is intermediate_size (expert_ffn_hidden must equal ffn_hidden)")
    return out


def gpt_oss_config(cfg: ModelConfig) -> dict[str, Any]:
    """A gpt_oss config.json's fields beyond those hf_config.to_hf_dict writes for every gated family."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_factor, beta_fast=cfg.yarn_beta_fast,
                    beta_slow=cfg.yarn_beta_slow, truncate=cfg.yarn_truncate,
                    original_max_position_embeddings=cfg.rope_original_max_seq_len)
    return {"intermediate_size": cfg.expert_ffn_hidden, "hidden_act": "silu", "attention_bias": True,
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k,
            # no windowed layer: any window, never used
            "sliding_window": cfg.sliding_window or cfg.max_seq_len,
            "layer_types": [SLIDING if cfg.is_sliding_layer(i) else FULL for i in range(cfg.n_layers)],
            "rope_parameters": rope, "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit,
            "router_aux_loss_coef": cfg.aux_loss_coef, "output_router_logits": False}


def gpt_oss_published(**kw: Any) -> dict[str, Any]:
    """openai/gpt-oss-120b's and -20b's config.json (they differ in depth and expert count); layer_types is
    the class's pattern, as the Hub files list it."""
    return dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_experts_per_tok=4,
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0, sliding_window=128,
                rope_scaling=dict(GPT_OSS_YARN), swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False, **kw)
