"""Hugging Face `config.json` -> ModelConfig, and the published presets built from embedded config dicts.

Supported `model_type`s: llama (Llama 1/2/3), mistral, mixtral, qwen2 (Qwen2/2.5), qwen3, qwen3_moe,
gpt2, deepseek_v3. A config.json is read under every name transformers accepts for a field (the Hub's
names, which transformers 4.x writes; the ones transformers 5 writes; each class's `attribute_map`),
and an absent optional field takes the default of that family's transformers config class, so that a
count made here equals `AutoModelForCausalLM.from_config(cfg).num_parameters()`. The sizes that say
which model this is (vocab, width, depth, heads, MLP and expert widths, expert counts) are required:
transformers would fill them with Llama-2-7B's, which is never what a user meant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainwise.config import ModelConfig
from trainwise.errors import TrainwiseError

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt2", "deepseek_v3")

HF_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}  # gated MLP families
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                    "silu": "silu", "swish": "silu"}

# Other names transformers accepts for a field -> the name the Hub's config.json uses (read below).
# From each class's `attribute_map` in transformers 5.24 (in 4.57 only GPT-2 has one), which is also
# how 5.x renames on save: a Qwen3-MoE config saved by transformers 5 has num_local_experts.
ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
             "max_position_embeddings": "n_positions"},
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
}

# Class defaults of the optional fields read below: transformers 5.24 configuration_<family>.py (the
# same in 4.57). None means "derived": n_kv_heads = n_heads, head_dim = hidden_size / n_heads.
_GATED = dict(tie_word_embeddings=False, hidden_act="silu", num_key_value_heads=None, head_dim=None,
              attention_bias=False, rms_norm_eps=1e-6, rope_theta=10000.0)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_GATED, max_position_embeddings=2048, mlp_bias=False),
    "mistral": dict(_GATED, max_position_embeddings=131072, num_key_value_heads=8),
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
}


def load_hf_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TrainwiseError(f"config file '{path}' does not exist.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TrainwiseError(f"'{path}' is not valid JSON ({err}); pass a Hugging Face config.json.") from None
    if not isinstance(data, dict):
        raise TrainwiseError(f"'{path}' must hold a JSON object (a Hugging Face config.json).")
    return from_hf_dict(data, name=config_name(path))


def config_name(path: Path) -> str:
    """`models/qwen3.json` is "qwen3"; a file named config.json is named after its folder (a Hub checkout)."""
    if path.name != "config.json":
        return path.stem
    return path.resolve().parent.name or path.stem


def canonical_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The config dict under the Hub's field names, with the family's class defaults filled in."""
    family = d.get("model_type")
    if family is None:
        raise TrainwiseError("the config.json has no 'model_type' field; supported: " + ", ".join(FAMILIES) + ".")
    if family not in FAMILIES:
        raise TrainwiseError(f"model_type '{family}' is not supported by the planner; supported: {', '.join(FAMILIES)}.")
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
            f"the {family} config.json has no '{key}' field{''.join(f' (or {a!r})' for a in also)}, which the "
            "parameter count needs; add it (see the model's published config.json)."
        )
    return d[key]


def from_hf_dict(d: dict[str, Any], name: str = "hf-model") -> ModelConfig:
    """Translate a config.json dict into ModelConfig, raising TrainwiseError on missing/unsupported fields."""
    d = canonical_fields(d)
    family = d["model_type"]
    if family == "gpt2":
        return _gpt2(d, name)
    H = _need(d, "hidden_size", family)
    n_heads = _need(d, "num_attention_heads", family)
    mla = family == "deepseek_v3"
    kw: dict[str, Any] = dict(
        name=name, vocab_size=_need(d, "vocab_size", family), d_model=H,
        n_layers=_need(d, "num_hidden_layers", family), n_heads=n_heads,
        # MLA makes keys and values from its latent (kv_lora_rank); num_key_value_heads builds nothing
        n_kv_heads=n_heads if mla else d["num_key_value_heads"] or n_heads,
        ffn_hidden=_need(d, "intermediate_size", family), norm="rmsnorm", position="rope",
        norm_eps=d["rms_norm_eps"], rope_theta=float(d["rope_theta"] or DEFAULTS[family]["rope_theta"]),
        tie_embeddings=bool(d["tie_word_embeddings"]), max_seq_len=d["max_position_embeddings"],
    )
    act = d["hidden_act"]
    if act not in HF_ACTIVATIONS:
        raise TrainwiseError(f"hidden_act '{act}' is not supported for {family}; expected one of {', '.join(HF_ACTIVATIONS)}.")
    kw["activation"] = HF_ACTIVATIONS[act]
    if d["head_dim"] and not mla:
        kw["head_dim"] = d["head_dim"]
    elif H % n_heads and not mla:
        raise TrainwiseError(f"num_attention_heads = {n_heads} does not divide hidden_size = {H} and no head_dim is given.")
    if family in ("llama",):
        attn_bias, mlp_bias = bool(d["attention_bias"]), bool(d["mlp_bias"])
        if attn_bias != mlp_bias:
            raise TrainwiseError("attention_bias != mlp_bias is not representable in ModelConfig (bias applies to all linears).")
        kw["bias"] = attn_bias
    if family == "qwen2":
        kw["qkv_bias"] = True
    if family in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = True
        if d["attention_bias"]:  # Qwen3 puts attention_bias on q, k, v and o alike
            raise TrainwiseError("attention_bias = true on Qwen3 (bias on o_proj too) is not supported.")
    if family == "mixtral":
        kw.update(n_experts=_need(d, "num_local_experts", family), top_k=_need(d, "num_experts_per_tok", family),
                  expert_ffn_hidden=kw["ffn_hidden"])
    if family == "qwen3_moe":
        step, dense = d["decoder_sparse_step"], set(d["mlp_only_layers"] or [])
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(kw["n_layers"])]
        kw.update(n_experts=_need(d, "num_experts", family), top_k=_need(d, "num_experts_per_tok", family),
                  expert_ffn_hidden=_need(d, "moe_intermediate_size", family),
                  renormalize_top_k=bool(d["norm_topk_prob"]), **_moe_layout(sparse, family))
    if family == "deepseek_v3":
        if d["attention_bias"]:
            raise TrainwiseError("deepseek_v3 attention_bias = true is not supported by the planner.")
        sparse = [i >= d["first_k_dense_replace"] for i in range(kw["n_layers"])]
        kw.update(attention="mla", q_lora_rank=d["q_lora_rank"] or 0,
                  kv_lora_rank=_need(d, "kv_lora_rank", family), qk_nope_head_dim=_need(d, "qk_nope_head_dim", family),
                  qk_rope_head_dim=_need(d, "qk_rope_head_dim", family), v_head_dim=_need(d, "v_head_dim", family),
                  head_dim=d.get("qk_rope_head_dim"),
                  n_experts=_need(d, "n_routed_experts", family), top_k=_need(d, "num_experts_per_tok", family),
                  expert_ffn_hidden=_need(d, "moe_intermediate_size", family),
                  n_shared_experts=d["n_shared_experts"] or 0, router_gating="sigmoid",
                  # e_score_correction_bias: the choice bias (a buffer in both, set by a rule, not by
                  # gradients). The multi-token-prediction module (num_nextn_predict_layers) is not built
                  # by transformers, so not counted here either.
                  router_bias=True, renormalize_top_k=bool(d["norm_topk_prob"]),
                  routed_scaling_factor=float(d["routed_scaling_factor"]), router_groups=d["n_group"],
                  router_group_top_k=d["topk_group"], **_moe_layout(sparse, family))
    return ModelConfig(**kw)


def _moe_layout(sparse: list[bool], family: str) -> dict[str, int]:
    """Which layers are MoE, as ModelConfig says it: dense up to the first MoE layer, then every n-th."""
    layers = [i for i, s in enumerate(sparse) if s]
    if not layers:
        return dict(first_dense_layers=len(sparse), moe_every=1)
    # one MoE layer: any stride that steps past the last layer says "no more"
    every = layers[1] - layers[0] if len(layers) > 1 else len(sparse) - layers[0]
    if layers != list(range(layers[0], len(sparse), every)):
        raise TrainwiseError(
            f"the {family} config.json puts MoE on layers {layers}, which is not 'dense layers first, then MoE "
            "every n-th layer' (the layouts the planner models); change mlp_only_layers / decoder_sparse_step.")
    return dict(first_dense_layers=layers[0], moe_every=every)


def _gpt2(d: dict[str, Any], name: str) -> ModelConfig:
    H = _need(d, "n_embd", "gpt2")
    act = d["activation_function"]
    if act not in GPT2_ACTIVATIONS:
        raise TrainwiseError(f"gpt2 activation_function '{act}' is not supported; expected one of {', '.join(GPT2_ACTIVATIONS)}.")
    if d["add_cross_attention"]:
        raise TrainwiseError("gpt2 add_cross_attention = true adds an encoder-decoder cross-attention to every "
                             "block; the planner models decoder-only language models. Set it to false.")
    return ModelConfig(
        name=name, vocab_size=_need(d, "vocab_size", "gpt2"), d_model=H, n_layers=_need(d, "n_layer", "gpt2"),
        n_heads=_need(d, "n_head", "gpt2"), n_kv_heads=0, ffn_hidden=d["n_inner"] or 4 * H,
        activation=GPT2_ACTIVATIONS[act], norm="layernorm", norm_eps=d["layer_norm_epsilon"],
        position="learned", tie_embeddings=bool(d["tie_word_embeddings"]), bias=True,
        max_seq_len=_need(d, "n_positions", "gpt2"),
    )


def _gpt2_cfg(n_embd: int, n_layer: int, n_head: int) -> dict:
    return dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_ctx=1024, n_embd=n_embd,
                n_layer=n_layer, n_head=n_head, activation_function="gelu_new", layer_norm_epsilon=1e-5)


def _llama(**kw: Any) -> dict:
    base = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False)
    return {**base, **kw}


# Values from each model's published config.json on the Hugging Face Hub (keys that change the
# parameter count or the FLOPs; rope_scaling and token ids left out).
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
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, hidden_act="silu", max_position_embeddings=40960,
                          rms_norm_eps=1e-6, rope_theta=1e6, num_experts=128, num_experts_per_tok=8,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, attention_bias=False,
                          tie_word_embeddings=False),  # Qwen/Qwen3-30B-A3B
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                        first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
                        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
                        attention_bias=False, tie_word_embeddings=False),  # deepseek-ai/DeepSeek-V3
}


def published_presets() -> dict[str, dict[str, Any]]:
    """ModelConfig keyword dicts of the published models, for trainwise.presets.PRESETS."""
    out = {}
    for name, d in PUBLISHED.items():
        cfg = from_hf_dict(d, name=name)
        kw = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "name"}
        out[name] = kw
    return out
