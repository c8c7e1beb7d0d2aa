"""Hugging Face `config.json` <-> ModelConfig: the one translator, in both directions.

Reading (`from_hf_dict`, `load_hf_config`) serves `trainwise plan --model config.json`, the published
presets, and `trainwise train --init-from HF_DIR` (build=True, through trainwise.export.hf, which converts
the weights), for the `model_type`s in FAMILIES. A field is read under every name transformers accepts for
it (the Hub's names, which transformers 4.x writes; 5.x's; each class's `attribute_map`), and an absent
optional field takes the default of the family's transformers config class, so that a count made here
equals `AutoModelForCausalLM.from_config(cfg).num_parameters()`. The sizes that say which model this is
(vocab, width, depth, heads, MLP and expert widths, expert counts) are required: transformers would fill
them with Llama-2-7B's, which is never what a user meant.

build=True reads the file for a model trainwise builds and loads the checkpoint's weights into. It also
refuses what changes the computation but not the count (RoPE scaling and sliding windows, except gpt_oss's,
which trainwise builds; an exact-GELU gated MLP; GPT-2's attention-scaling variants), and reads attention_bias
without MLP biases as q/k/v biases: the o_proj bias that comes with them is loaded only if it is zero
(trainwise.export.hf checks it).

Writing (`choose_family`, `to_hf_dict`) serves `trainwise export --format hf`: the family that represents a
ModelConfig exactly (llama; qwen3: qk_norm; gpt2: LayerNorm, learned positions, biases, zero if absent; mixtral:
MoE; deepseek_v3: latent attention; gpt_oss: sinks, windows, YaRN) or every reason none does, then its config.json.
deepseek_v3's and gpt_oss's own fields, both ways, are trainwise.hf_families's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainwise import hf_families
from trainwise.config import ModelConfig
from trainwise.errors import TrainwiseError

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt2", "deepseek_v3", "gpt_oss")
# the families export writes, and their transformers classes
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel",
                 "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "gpt_oss": "GptOssForCausalLM"}

# HF activation -> trainwise activation: hidden_act of the gated MLPs, activation_function of GPT-2's plain
# one. trainwise's geglu is the tanh GELU: a gated MLP with the exact "gelu" has the same parameters and
# FLOPs, so the planner counts it, but it is not the model trainwise builds (build=True refuses it).
GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu",
                     "gelu": "geglu"}
PLAIN_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                     "silu": "silu", "swish": "silu"}
# trainwise activation -> the HF name export writes: its first name above
GATED_NAMES = {ours: hf for hf, ours in reversed(GATED_ACTIVATIONS.items())} | {"clamped_swiglu": "silu"}  # gpt_oss's
PLAIN_NAMES = {ours: hf for hf, ours in reversed(PLAIN_ACTIVATIONS.items())}


# Other names transformers accepts for a field -> the name the Hub's config.json uses (read below).
# From each class's `attribute_map` in transformers 5.24 (in 4.57 only GPT-2 has one), which is also
# how 5.x renames on save: a Qwen3-MoE config saved by transformers 5 has num_local_experts.
ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
             "max_position_embeddings": "n_positions"},
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    "gpt_oss": {"num_experts": "num_local_experts"},
}

# Class defaults of the optional fields read below: transformers 5.24 configuration_<family>.py (the
# same in 4.57). None means "derived": n_kv_heads = n_heads, head_dim = hidden_size / n_heads.
_GATED = dict(tie_word_embeddings=False, hidden_act="silu", num_key_value_heads=None, head_dim=None,
              attention_bias=False, rms_norm_eps=1e-6, rope_theta=10000.0)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_GATED, max_position_embeddings=2048, mlp_bias=False),
    "mistral": dict(_GATED, max_position_embeddings=131072, num_key_value_heads=8, sliding_window=4096),
    "mixtral": dict(_GATED, max_position_embeddings=131072, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6),
    "qwen2": dict(_GATED, max_position_embeddings=32768, num_key_value_heads=32),
    "qwen3": dict(_GATED, max_position_embeddings=32768, num_key_value_heads=32, head_dim=128),
    "qwen3_moe": dict(_GATED, max_position_embeddings=32768, num_key_value_heads=4, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=False),
    "deepseek_v3": dict(_GATED, max_position_embeddings=4096, n_shared_experts=1, first_k_dense_replace=3,
                        q_lora_rank=1536, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                        rope_interleave=True),
    "gpt2": dict(n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                 add_cross_attention=False),
    "gpt_oss": dict(_GATED, **hf_families.GPT_OSS_DEFAULTS),
}


# ---------------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def load_hf_config(path: str | Path) -> ModelConfig:
    """A config.json file -> ModelConfig named after it (config_name); its errors name the file."""
    path = Path(path)
    return from_hf_dict(read_hf_json(path), name=config_name(path), source=path)


def read_hf_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TrainwiseError(f"config file '{path}' does not exist.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TrainwiseError(f"'{path}' is not valid JSON ({err}); pass a Hugging Face config.json.") from None
    if not isinstance(data, dict):
        raise TrainwiseError(f"'{path}' must hold a JSON object (a Hugging Face config.json).")
    return data


def config_name(path: Path) -> str:
    """`models/qwen3.json` is "qwen3"; a file named config.json is named after its folder (a Hub checkout)."""
    if path.name != "config.json":
        return path.stem
    return path.resolve().parent.name or path.stem


def canonical_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The config dict under the Hub's field names, with the family's class defaults filled in."""
    family = d.get("model_type")
    if family not in FAMILIES:
        said = "has no 'model_type' field" if family is None else f"has model_type '{family}', which is not supported"
        raise TrainwiseError(f"the config.json {said}; trainwise reads the families {', '.join(FAMILIES)}.")
    out = dict(d)
    for alias, name in ALIASES.get(family, {}).items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if out.get(name, value) != value:
            raise TrainwiseError(
                f"the {family} config.json gives '{name}' = {out[name]} and '{alias}' = {value}, two names "
                f"transformers reads as one field; keep one of them.")
        out[name] = value
    # transformers 5 writes rope_theta inside rope_parameters (4.x: at the top level)
    rope = out.get("rope_parameters")
    if "rope_theta" not in out and isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    return {**DEFAULTS[family], **out}


def _need(d: dict, key: str, family: str) -> Any:
    if key not in d or d[key] is None:
        also = [alias for alias, name in ALIASES.get(family, {}).items() if name == key]
        raise TrainwiseError(
            f"the {family} config.json has no '{key}' field{''.join(f' (or {a!r})' for a in also)}, which "
            "sizes the model; add it (see the model's published config.json).")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainwiseError(
            f"the {family} config.json gives '{key}' = {json.dumps(value)}, which sizes the model and must be a "
            "whole number of at least 1; correct it (see the model's published config.json).")
    return value


def from_hf_dict(d: dict[str, Any], name: str = "hf-model", build: bool = False,
                 source: str | Path | None = None) -> ModelConfig:
    """Translate a config.json dict into ModelConfig, raising TrainwiseError on missing/unsupported fields
    (prefixed with `source`, the file, when given). build=True: for a model trainwise builds and loads the
    checkpoint into (see the module's docstring)."""
    try:
        d = canonical_fields(d)
        if build:
            _check_buildable(d)
        return _gpt2(d, name) if d["model_type"] == "gpt2" else _gated(d, name, build)
    except TrainwiseError as err:
        if source is None:
            raise
        raise TrainwiseError(f"{source}: {err}") from None


def _gated(d: dict[str, Any], name: str, build: bool) -> ModelConfig:
    """The families with RMSNorm, RoPE and gated MLPs."""
    family = d["model_type"]
    H = _need(d, "hidden_size", family)
    n_heads = _need(d, "num_attention_heads", family)
    mla = family == "deepseek_v3"
    act = d["hidden_act"]
    if act not in GATED_ACTIVATIONS:
        raise TrainwiseError(f"hidden_act '{act}' is not supported for {family}; expected one of "
                             f"{', '.join(GATED_ACTIVATIONS)}.")
    kw: dict[str, Any] = dict(
        name=name, vocab_size=_need(d, "vocab_size", family), d_model=H,
        n_layers=_need(d, "num_hidden_layers", family), n_heads=n_heads,
        # MLA makes keys and values from its latent (kv_lora_rank); num_key_value_heads builds nothing
        n_kv_heads=n_heads if mla else d["num_key_value_heads"] or n_heads,
        ffn_hidden=_need(d, "intermediate_size", family), activation=GATED_ACTIVATIONS[act], norm="rmsnorm",
        position="rope", norm_eps=d["rms_norm_eps"],
        rope_theta=float(d["rope_theta"] or DEFAULTS[family]["rope_theta"]),
        tie_embeddings=bool(d["tie_word_embeddings"]), max_seq_len=d["max_position_embeddings"],
        qk_norm=family in ("qwen3", "qwen3_moe"), **_biases(d, family, build),
    )
    if d["head_dim"] and not mla:
        kw["head_dim"] = d["head_dim"]
    elif H % n_heads and not mla:
        raise TrainwiseError(f"num_attention_heads = {n_heads} does not divide hidden_size = {H} and no head_dim "
                             "is given; add head_dim to the config.json.")
    if family == "mixtral":
        kw.update(n_experts=_need(d, "num_local_experts", family), top_k=_need(d, "num_experts_per_tok", family),
                  expert_ffn_hidden=kw["ffn_hidden"])
    if family == "qwen3_moe":
        step, dense = d["decoder_sparse_step"], set(d["mlp_only_layers"] or [])
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(kw["n_layers"])]
        kw.update(_moe_layout(sparse, family, dict(
            n_experts=_need(d, "num_experts", family), top_k=_need(d, "num_experts_per_tok", family),
            expert_ffn_hidden=_need(d, "moe_intermediate_size", family), renormalize_top_k=bool(d["norm_topk_prob"]))))
    if mla:
        kw.update(hf_families.deepseek_fields(d, kw["n_layers"], lambda key: _need(d, key, family)))
    if family == "gpt_oss":
        kw.update(hf_families.gpt_oss_fields(d, kw["n_layers"], build), expert_ffn_hidden=kw["ffn_hidden"],
                  n_experts=_need(d, "num_local_experts", family), top_k=_need(d, "num_experts_per_tok", family))
    return ModelConfig(**kw)


def _biases(d: dict[str, Any], family: str, build: bool) -> dict[str, bool]:
    """ModelConfig's bias (on every linear) and qkv_bias (on q, k and v only) from the config.json's."""
    if family == "qwen2":
        return dict(qkv_bias=True)  # Qwen2: biases on q, k and v; none on o_proj or the MLP
    attention = family in ("llama", "qwen3", "qwen3_moe", "deepseek_v3") and bool(d["attention_bias"])
    mlp = family == "llama" and bool(d["mlp_bias"])
    if family == "deepseek_v3" and attention:
        raise TrainwiseError("deepseek_v3 attention_bias = true is not supported: trainwise's latent attention has "
                             "no biases; set it to false.")
    if mlp and not attention:
        raise TrainwiseError("llama mlp_bias = true without attention_bias is not representable (trainwise's biases "
                             "are on every linear, or on q/k/v only); set the two alike.")
    if attention and not mlp and not build:
        raise TrainwiseError(
            f"{family} attention_bias = true{' without mlp_bias' if family == 'llama' else ''} puts biases on q, k, v "
            "and o_proj, which the planner cannot count: ModelConfig has biases on q/k/v only (qkv_bias) or on every "
            "linear (bias). Plan it with attention_bias = false; `trainwise train --init-from` loads such a "
            "checkpoint when its o_proj bias is zero.")
    return dict(bias=attention and mlp, qkv_bias=attention and not mlp)


def _check_buildable(d: dict[str, Any]) -> None:
    """What build=True refuses besides what from_hf_dict refuses: settings that keep the parameters but
    compute something trainwise's layers do not."""
    family = d["model_type"]
    if family == "gpt2":
        if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn") \
                or d.get("scale_attn_weights") is False:
            raise TrainwiseError(
                "this gpt2 config.json changes the attention scaling, which trainwise does not build; it needs "
                "scale_attn_weights = true, scale_attn_by_inverse_layer_idx = false, reorder_and_upcast_attn = false.")
        return
    if family == "gpt_oss":  # its RoPE and windows are hf_families.gpt_oss_fields's
        return hf_families.gpt_oss_check_buildable(d)
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5's name, 4.x's
        rope = d.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise TrainwiseError(
                f"{key} has rope_type '{kind}' (RoPE scaling), which trainwise does not build: it builds the "
                "default RoPE only. Train from a checkpoint without RoPE scaling (trainwise plan counts this one).")
    # a window as long as the longest sequence (max_position_embeddings, trainwise's max_seq_len) hides nothing
    window = d.get("sliding_window") if d.get("use_sliding_window", family in ("mistral", "mixtral")) else None
    if window and window < d["max_position_embeddings"]:
        raise TrainwiseError(
            f"the {family} config.json has sliding-window attention (sliding_window = {window} < "
            f"max_position_embeddings = {d['max_position_embeddings']}), which trainwise does not build. Set "
            "sliding_window to null (or use_sliding_window to false) to train it with full attention: the same "
            f"model on sequences of up to {window} tokens.")
    if d["hidden_act"] == "gelu":
        raise TrainwiseError(
            "hidden_act 'gelu' (the exact GELU) in a gated MLP is not built by trainwise, whose geglu uses the "
            "tanh approximation (hidden_act 'gelu_pytorch_tanh'); train from a checkpoint with a supported "
            f"hidden_act: {', '.join(a for a in GATED_ACTIVATIONS if a != 'gelu')}.")


def _moe_layout(sparse: list[bool], family: str, moe: dict[str, Any]) -> dict[str, Any]:
    """`moe` and ModelConfig's layout of the MoE layers (dense ones first, then every n-th); {} if none is."""
    layers = [i for i, s in enumerate(sparse) if s]
    if not layers:
        return {}
    # one MoE layer: any stride that steps past the last layer says "no more"
    every = layers[1] - layers[0] if len(layers) > 1 else len(sparse) - layers[0]
    if layers != list(range(layers[0], len(sparse), every)):
        raise TrainwiseError(
            f"the {family} config.json puts MoE on layers {layers}, which is not 'dense layers first, then MoE "
            "every n-th layer' (the layouts trainwise models); change mlp_only_layers / decoder_sparse_step.")
    return dict(moe, first_dense_layers=layers[0], moe_every=every)


def _gpt2(d: dict[str, Any], name: str) -> ModelConfig:
    H = _need(d, "n_embd", "gpt2")
    act = d["activation_function"]
    if act not in PLAIN_ACTIVATIONS:
        raise TrainwiseError(f"gpt2 activation_function '{act}' is not supported; expected one of "
                             f"{', '.join(PLAIN_ACTIVATIONS)}.")
    if d["add_cross_attention"]:
        raise TrainwiseError("gpt2 add_cross_attention = true adds an encoder-decoder cross-attention to every "
                             "block; trainwise models decoder-only language models. Set it to false.")
    return ModelConfig(
        name=name, vocab_size=_need(d, "vocab_size", "gpt2"), d_model=H, n_layers=_need(d, "n_layer", "gpt2"),
        n_heads=_need(d, "n_head", "gpt2"), n_kv_heads=0, ffn_hidden=d["n_inner"] or 4 * H,
        activation=PLAIN_ACTIVATIONS[act], norm="layernorm", norm_eps=d["layer_norm_epsilon"],
        position="learned", tie_embeddings=bool(d["tie_word_embeddings"]), bias=True,
        max_seq_len=_need(d, "n_positions", "gpt2"),
    )


# ---------------------------------------------------------------------------------------------------
# ModelConfig -> config.json


def choose_family(cfg: ModelConfig) -> str:
    """The HF family that represents `cfg` exactly, or TrainwiseError naming every reason it can't."""
    if cfg.attention == "mla":
        family, problems = "deepseek_v3", hf_families.deepseek_problems(cfg)
    elif hf_families.uses_gpt_oss(cfg):
        family, problems = "gpt_oss", hf_families.gpt_oss_problems(cfg)
    elif cfg.is_moe:
        family, problems = "mixtral", _mixtral_problems(cfg)
    elif cfg.position == "learned" or cfg.norm == "layernorm":
        family, problems = "gpt2", _gpt2_problems(cfg)
    else:
        family, problems = "qwen3" if cfg.qk_norm else "llama", _llama_problems(cfg)
    if problems:
        raise TrainwiseError(
            f"this model cannot be exported as {ARCHITECTURES[family]} (the closest Hugging Face family): "
            + "; ".join(problems) + ". Train with a config that family can represent, or keep the trainwise checkpoint."
        )
    return family


def _llama_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    if cfg.position != "rope":
        problems.append("it uses learned positions; Llama-style models use RoPE")
    if cfg.norm != "rmsnorm":
        problems.append("it uses LayerNorm; Llama-style models use RMSNorm")
    if not cfg.gated:
        problems.append(f"activation '{cfg.activation}' is not gated; Llama-style MLPs are gated (swiglu or geglu)")
    if cfg.qk_norm and cfg.bias:
        problems.append("Qwen3 (qk_norm) has no MLP biases, but model.bias = true puts biases in the MLP")
    return problems


def _gpt2_problems(cfg: ModelConfig) -> list[str]:
    problems = []
    if cfg.position != "learned":
        problems.append("it uses RoPE; GPT-2 uses learned positions")
    if cfg.norm != "layernorm":
        problems.append("it uses RMSNorm; GPT-2 uses LayerNorm")
    if cfg.activation not in PLAIN_NAMES:
        problems.append(f"activation '{cfg.activation}' is gated; GPT-2's MLP has two matrices (relu, gelu, "
                        "gelu_tanh or silu)")
    if cfg.n_kv_heads != cfg.n_heads:
        problems.append(f"n_kv_heads = {cfg.n_kv_heads} != n_heads = {cfg.n_heads} (grouped-query attention); "
                        "GPT-2 has one k/v head per query head")
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        problems.append(f"head_dim x n_heads = {cfg.head_dim * cfg.n_heads} != d_model = {cfg.d_model}")
    if cfg.qk_norm:
        problems.append("qk_norm has no GPT-2 counterpart")
    return problems


def _mixtral_problems(cfg: ModelConfig) -> list[str]:
    problems = _llama_problems(cfg)
    if cfg.activation != "swiglu":
        problems = [p for p in problems if "not gated" not in p]
        problems.append(f"activation '{cfg.activation}': Mixtral experts use swiglu")
    if cfg.qk_norm:
        problems.append("qk_norm has no Mixtral counterpart")
    if cfg.bias or cfg.qkv_bias:
        problems.append("Mixtral has no biases (model.bias / model.qkv_bias must be false)")
    if cfg.first_dense_layers or cfg.moe_every != 1:
        problems.append("every Mixtral layer is MoE (first_dense_layers = 0 and moe_every = 1)")
    if cfg.n_shared_experts:
        problems.append("Mixtral has no shared experts")
    if cfg.router_gating != "softmax" or not cfg.renormalize_top_k:
        problems.append("Mixtral routes with softmax gating and renormalised top-k weights")
    if cfg.router_bias:
        problems.append("Mixtral has no router bias")
    if not cfg.dropless:
        problems.append("Mixtral is dropless (model.dropless = true; no capacity factor)")
    if cfg.expert_ffn_hidden != cfg.ffn_hidden:
        problems.append("Mixtral's expert width is intermediate_size (expert_ffn_hidden must equal ffn_hidden)")
    return problems


def to_hf_dict(cfg: ModelConfig, family: str, eos_id: int, bos_id: int | None = None) -> dict[str, Any]:
    """config.json of `family` (choose_family's) for `cfg`; bos_id defaults to eos_id (trainwise's
    tokenizers have one special token, which both begins and ends a document)."""
    bos_id = eos_id if bos_id is None else bos_id
    common = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size,
              "bos_token_id": bos_id, "eos_token_id": eos_id, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": "float32", "initializer_range": cfg.init_std}
    if family == "gpt2":
        return {**common, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
                "n_inner": cfg.ffn_hidden, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
                "activation_function": PLAIN_NAMES[cfg.activation],
                "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
                "attn_pdrop": cfg.dropout, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    out = {**common, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "intermediate_size": cfg.ffn_hidden, "hidden_act": GATED_NAMES[cfg.activation],
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
           "attention_dropout": cfg.dropout, "attention_bias": cfg.bias or cfg.qkv_bias}
    if family == "deepseek_v3":
        return {**out, **hf_families.deepseek_config(cfg)}
    if family == "gpt_oss":
        return {**out, **hf_families.gpt_oss_config(cfg)}
    if family == "llama":
        out["mlp_bias"] = cfg.bias
    if family in ("qwen3", "mixtral"):
        out.update(use_sliding_window=False, sliding_window=None)
    if family == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0,
                   output_router_logits=False, router_aux_loss_coef=cfg.aux_loss_coef)
    return out


def _gpt2_cfg(n_embd: int, n_layer: int, n_head: int) -> dict:
    return dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_ctx=1024, n_embd=n_embd,
                n_layer=n_layer, n_head=n_head, activation_function="gelu_new", layer_norm_epsilon=1e-5)


def _llama(**kw: Any) -> dict:
    base = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False)
    return {**base, **kw}


def _qwen3_moe(**kw: Any) -> dict:
    return dict(model_type="qwen3_moe", vocab_size=151936, num_key_value_heads=4, head_dim=128, hidden_act="silu",
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, num_experts=128,
                num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                attention_bias=False, tie_word_embeddings=False, **kw)


# Values from each model's published config.json on the Hugging Face Hub (keys that change the
# parameter count or the FLOPs; rope_scaling, unless trainwise builds it, and token ids left out).
PUBLISHED: dict[str, dict[str, Any]] = {
    "gpt2": _gpt2_cfg(768, 12, 12),  # openai-community/gpt2
    "gpt2-medium": _gpt2_cfg(1024, 24, 16),
    "gpt2-large": _gpt2_cfg(1280, 36, 20),
    "gpt2-xl": _gpt2_cfg(1600, 48, 25),
    "llama-2-7b": _llama(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                         rope_theta=10000.0),  # meta-llama/Llama-2-7b-hf
    "llama-3-8b": _llama(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0),  # meta-llama/Meta-Llama-3-8B
    "llama-3-70b": _llama(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                          rope_theta=500000.0),  # meta-llama/Meta-Llama-3-70B
    "llama-3.1-405b": _llama(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                             num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072,
                             rope_theta=500000.0),  # meta-llama/Llama-3.1-405B
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                       max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                       tie_word_embeddings=False),  # mistralai/Mistral-7B-v0.1
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                         max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False),  # mistralai/Mixtral-8x7B-v0.1
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
                       max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6,
                       tie_word_embeddings=False),  # Qwen/Qwen2.5-7B
    "qwen3-30b-a3b": _qwen3_moe(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                num_hidden_layers=48, num_attention_heads=32),  # Qwen/Qwen3-30B-A3B
    "qwen3-235b-a22b": _qwen3_moe(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                                  num_hidden_layers=94, num_attention_heads=64),  # Qwen/Qwen3-235B-A22B
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                        first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
                        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
                        attention_bias=False, tie_word_embeddings=False),  # deepseek-ai/DeepSeek-V3
    "gpt-oss-120b": hf_families.gpt_oss_published(num_hidden_layers=36, num_local_experts=128),  # openai/gpt-oss-120b
    "gpt-oss-20b": hf_families.gpt_oss_published(num_hidden_layers=24, num_local_experts=32),  # openai/gpt-oss-20b
}


def published_presets() -> dict[str, dict[str, Any]]:
    """ModelConfig keyword dicts of the published models, for trainwise.presets.PRESETS."""
    configs = {name: from_hf_dict(d, name=name) for name, d in PUBLISHED.items()}
    return {name: {f: getattr(c, f) for f in c.__dataclass_fields__ if f != "name"} for name, c in configs.items()}
