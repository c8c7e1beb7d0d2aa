"""trainwise <-> Hugging Face `transformers` checkpoints.

Export writes a model directory that `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load offline: config.json, model.safetensors (in the key layout
of the family's published checkpoints on the Hub), generation_config.json, tokenizer.json and
tokenizer_config.json. `load_hf_dir` is the inverse, used by `trainwise train --init-from HF_DIR`.

Families, and what each can represent exactly (anything else is refused with the reason):

    llama    RMSNorm, RoPE, gated MLP (swiglu -> silu, geglu -> gelu_pytorch_tanh), GQA, tied or not;
             `bias` -> attention_bias + mlp_bias; `qkv_bias` alone -> attention_bias with a zero o_proj bias
    qwen3    the llama layout plus RMSNorm on each head's q and k (`qk_norm`); no MLP biases
    gpt2     LayerNorm, learned positions, plain MLP (relu, gelu, gelu_tanh -> gelu_new, silu), MHA;
             GPT-2 always has biases, so a bias-free trainwise model exports them as zeros (exact)
    mixtral  the llama layout with every layer a softmax top-k MoE (renormalised, dropless, no shared
             experts, no biases, no router bias)
    deepseek_v3  multi-head latent attention, dense layers then sigmoid-routed MoE layers with shared
             experts (trainwise.export.deepseek, which holds its layout)

Weight layouts (trainwise -> HF): the fused `attn.qkv` (out = [q nh*hd | k nkv*hd | v nkv*hd]) is split
into q_proj/k_proj/v_proj; the fused gated `mlp.fc` (out = [gate F | up F]) into gate_proj/up_proj;
GPT-2's Conv1D stores (in, out), the transpose of nn.Linear; MoE experts are stacked (E, in, out) in
trainwise and one (out, in) Linear per expert (w1 gate, w3 up, w2 down) in Mixtral's Hub files.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainwise.config import ModelConfig
from trainwise.errors import TrainwiseError
from trainwise.export import deepseek
from trainwise.inference import load_run
from trainwise.tokenizer import EOT, Tokenizer

FAMILIES = ("llama", "qwen3", "gpt2", "mixtral", "deepseek_v3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel",
                 "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
GATED_ACTS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}  # trainwise activation -> HF hidden_act
GATED_ACTS_IN = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
PLAIN_ACTS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}  # GPT-2 activation_function
PLAIN_ACTS_IN = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                 "silu": "silu", "swish": "silu"}


# ---------------------------------------------------------------------------------------------------
# which family


def choose_family(cfg: ModelConfig) -> str:
    """The HF family that represents `cfg` exactly, or TrainwiseError naming every reason it can't."""
    if cfg.attention == "mla":
        return _check("deepseek_v3", deepseek.problems(cfg))
    if cfg.is_moe:
        return _check("mixtral", _mixtral_problems(cfg))
    if cfg.position == "learned" or cfg.norm == "layernorm":
        return _check("gpt2", _gpt2_problems(cfg))
    return _check("qwen3" if cfg.qk_norm else "llama", _llama_problems(cfg))


def _check(family: str, problems: list[str]) -> str:
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
    if cfg.activation not in PLAIN_ACTS:
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


# ---------------------------------------------------------------------------------------------------
# config.json


def hf_config(cfg: ModelConfig, family: str, eos_id: int, bos_id: int | None = None) -> dict:
    """config.json of `family` for `cfg`; bos_id defaults to eos_id (trainwise's tokenizers have one
    special token, which both begins and ends a document)."""
    bos_id = eos_id if bos_id is None else bos_id
    common = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size,
              "bos_token_id": bos_id, "eos_token_id": eos_id, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": "float32", "initializer_range": cfg.init_std}
    if family == "deepseek_v3":
        return deepseek.hf_config(cfg, common)
    if family == "gpt2":
        return {**common, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
                "n_inner": cfg.ffn_hidden, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
                "activation_function": PLAIN_ACTS[cfg.activation], "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}
    out = {**common, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "intermediate_size": cfg.ffn_hidden, "hidden_act": GATED_ACTS[cfg.activation],
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
           "attention_dropout": cfg.dropout, "attention_bias": cfg.bias or cfg.qkv_bias}
    if family == "llama":
        out["mlp_bias"] = cfg.bias
    if family in ("qwen3", "mixtral"):
        out.update(use_sliding_window=False, sliding_window=None)
    if family == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0,
                   output_router_logits=False, router_aux_loss_coef=cfg.aux_loss_coef)
    return out


def model_config_from_hf(d: dict, name: str) -> tuple[ModelConfig, str]:
    """config.json dict -> (ModelConfig, family), refusing what trainwise cannot build."""
    family = d.get("model_type")
    if family not in FAMILIES:
        raise TrainwiseError(f"model_type '{family}' cannot be loaded for training; supported: {', '.join(FAMILIES)}.")
    if family == "deepseek_v3":
        return deepseek.model_config(d, name), family

    def need(key: str):
        if d.get(key) is None:
            raise TrainwiseError(f"the {family} config.json has no '{key}'; it is needed to build the model.")
        return d[key]

    if family == "gpt2":
        act = d.get("activation_function", "gelu_new")
        if act not in PLAIN_ACTS_IN:
            raise TrainwiseError(f"gpt2 activation_function '{act}' is not one trainwise builds: {', '.join(PLAIN_ACTS_IN)}.")
        if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn") or d.get("scale_attn_weights") is False:
            raise TrainwiseError("this gpt2 config changes the attention scaling, which trainwise does not build.")
        H = need("n_embd")
        return ModelConfig(name=name, vocab_size=need("vocab_size"), d_model=H, n_layers=need("n_layer"),
                           n_heads=need("n_head"), n_kv_heads=0, ffn_hidden=d.get("n_inner") or 4 * H,
                           activation=PLAIN_ACTS_IN[act], norm="layernorm", norm_eps=d.get("layer_norm_epsilon", 1e-5),
                           position="learned", tie_embeddings=bool(d.get("tie_word_embeddings", True)), bias=True,
                           max_seq_len=need("n_positions")), family
    act = d.get("hidden_act", "silu")
    if act not in GATED_ACTS_IN:
        raise TrainwiseError(f"hidden_act '{act}' is not one trainwise builds for {family}: {', '.join(GATED_ACTS_IN)}.")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise TrainwiseError(f"rope_type '{rope.get('rope_type', rope.get('type'))}' (RoPE scaling) is not built by "
                             "trainwise; only the default RoPE.")
    if d.get("use_sliding_window") or (family == "mixtral" and d.get("sliding_window")):
        raise TrainwiseError("sliding-window attention is not built by trainwise.")
    n_heads = need("num_attention_heads")
    attention_bias, mlp_bias = bool(d.get("attention_bias", False)), bool(d.get("mlp_bias", False))
    if family == "llama" and mlp_bias and not attention_bias:
        raise TrainwiseError("mlp_bias without attention_bias is not representable (trainwise's bias covers every linear).")
    kw = dict(name=name, vocab_size=need("vocab_size"), d_model=need("hidden_size"), n_layers=need("num_hidden_layers"),
              n_heads=n_heads, n_kv_heads=d.get("num_key_value_heads") or n_heads, head_dim=d.get("head_dim") or 0,
              ffn_hidden=need("intermediate_size"), activation=GATED_ACTS_IN[act], norm="rmsnorm",
              norm_eps=d.get("rms_norm_eps", 1e-6), position="rope",
              rope_theta=float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0),
              tie_embeddings=bool(d.get("tie_word_embeddings", False)), max_seq_len=need("max_position_embeddings"),
              bias=attention_bias and mlp_bias, qkv_bias=attention_bias and not mlp_bias, qk_norm=family == "qwen3")
    if family == "qwen3" and attention_bias:
        kw.update(bias=False, qkv_bias=True)  # o_proj bias is loaded only if it is zero (see _llama_from_hf)
    if family == "mixtral":
        kw.update(n_experts=need("num_local_experts"), top_k=need("num_experts_per_tok"), bias=False, qkv_bias=False)
    return ModelConfig(**kw), family


# ---------------------------------------------------------------------------------------------------
# weights


def to_hf_state(cfg: ModelConfig, family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """trainwise state dict (tied lm_head may be absent) -> HF Hub-layout tensors."""
    if family == "deepseek_v3":
        out = deepseek.to_hf(cfg, state)
    else:
        out = _gpt2_to_hf(cfg, state) if family == "gpt2" else _llama_to_hf(cfg, family, state)
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def _split_qkv(cfg: ModelConfig, t: torch.Tensor) -> list[torch.Tensor]:
    sizes = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
    return list(t.split(sizes, dim=0))


def _llama_to_hf(cfg: ModelConfig, family: str, s: dict) -> dict:
    out = {"model.embed_tokens.weight": s["embed.weight"], "model.norm.weight": s["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = s["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = s[b + "norm1.weight"]
        out[h + "post_attention_layernorm.weight"] = s[b + "norm2.weight"]
        for name, part in zip("qkv", _split_qkv(cfg, s[b + "attn.qkv.weight"])):
            out[h + f"self_attn.{name}_proj.weight"] = part
        if b + "attn.qkv.bias" in s:
            for name, part in zip("qkv", _split_qkv(cfg, s[b + "attn.qkv.bias"])):
                out[h + f"self_attn.{name}_proj.bias"] = part
            out[h + "self_attn.o_proj.bias"] = s.get(b + "attn.out.bias", torch.zeros(cfg.d_model))
        out[h + "self_attn.o_proj.weight"] = s[b + "attn.out.weight"]
        if cfg.qk_norm:
            out[h + "self_attn.q_norm.weight"] = s[b + "attn.q_norm.weight"]
            out[h + "self_attn.k_norm.weight"] = s[b + "attn.k_norm.weight"]
        if cfg.is_moe_layer(i):
            m = h + "block_sparse_moe."
            out[m + "gate.weight"] = s[b + "mlp.router.weight"]
            fc, proj = s[b + "mlp.experts_fc.weight"], s[b + "mlp.experts_proj.weight"]  # (E, H, 2F), (E, F, H)
            F = cfg.expert_ffn_hidden
            for e in range(cfg.n_experts):
                out[m + f"experts.{e}.w1.weight"] = fc[e, :, :F].T
                out[m + f"experts.{e}.w3.weight"] = fc[e, :, F:].T
                out[m + f"experts.{e}.w2.weight"] = proj[e].T
            continue
        gate, up = s[b + "mlp.fc.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = s[b + "mlp.proj.weight"]
        if cfg.bias:
            gate_b, up_b = s[b + "mlp.fc.bias"].chunk(2, dim=0)
            out[h + "mlp.gate_proj.bias"], out[h + "mlp.up_proj.bias"] = gate_b, up_b
            out[h + "mlp.down_proj.bias"] = s[b + "mlp.proj.bias"]
    return out


def _gpt2_to_hf(cfg: ModelConfig, s: dict) -> dict:
    def bias(key: str, n: int) -> torch.Tensor:  # GPT-2 always has biases; a bias-free model exports zeros
        return s.get(key, torch.zeros(n))

    H = cfg.d_model
    out = {"transformer.wte.weight": s["embed.weight"], "transformer.wpe.weight": s["pos_embed.weight"],
           "transformer.ln_f.weight": s["norm.weight"], "transformer.ln_f.bias": bias("norm.bias", H)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = s["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        pairs = {"ln_1": ("norm1", H), "ln_2": ("norm2", H)}
        for hf_name, (tw, n) in pairs.items():
            out[h + f"{hf_name}.weight"] = s[b + f"{tw}.weight"]
            out[h + f"{hf_name}.bias"] = bias(b + f"{tw}.bias", n)
        conv = {"attn.c_attn": ("attn.qkv", 3 * H), "attn.c_proj": ("attn.out", H),
                "mlp.c_fc": ("mlp.fc", cfg.ffn_hidden), "mlp.c_proj": ("mlp.proj", H)}
        for hf_name, (tw, n) in conv.items():  # Conv1D weight is (in, out): the transpose of nn.Linear's
            out[h + f"{hf_name}.weight"] = s[b + f"{tw}.weight"].T
            out[h + f"{hf_name}.bias"] = bias(b + f"{tw}.bias", n)
    return out


def from_hf_state(cfg: ModelConfig, family: str, t: dict[str, torch.Tensor],
                  rope_interleave: bool = False) -> dict[str, torch.Tensor]:
    """HF tensors (Hub layout, or transformers 5's stacked MoE layout) -> trainwise state dict.
    rope_interleave: a deepseek_v3 config.json's flag (its rotary rows interleaved)."""
    t = {re.sub(r"\.block_sparse_moe\.", ".mlp.", k): v for k, v in t.items()}
    if family == "deepseek_v3":
        out = deepseek.from_hf(cfg, t, _take, rope_interleave)
    else:
        out = _gpt2_from_hf(cfg, t) if family == "gpt2" else _llama_from_hf(cfg, t)
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}


def _take(t: dict, key: str) -> torch.Tensor:
    if key not in t:
        raise TrainwiseError(f"the Hugging Face checkpoint has no tensor '{key}'; it does not match its config.json.")
    return t[key]


def _llama_from_hf(cfg: ModelConfig, t: dict) -> dict:
    out = {"embed.weight": _take(t, "model.embed_tokens.weight"), "norm.weight": _take(t, "model.norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _take(t, "lm_head.weight")
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[b + "norm1.weight"] = _take(t, h + "input_layernorm.weight")
        out[b + "norm2.weight"] = _take(t, h + "post_attention_layernorm.weight")
        out[b + "attn.qkv.weight"] = torch.cat([_take(t, h + f"self_attn.{n}_proj.weight") for n in "qkv"])
        out[b + "attn.out.weight"] = _take(t, h + "self_attn.o_proj.weight")
        if cfg.bias or cfg.qkv_bias:
            out[b + "attn.qkv.bias"] = torch.cat([_take(t, h + f"self_attn.{n}_proj.bias") for n in "qkv"])
            o_bias = _take(t, h + "self_attn.o_proj.bias")
            if cfg.bias:
                out[b + "attn.out.bias"] = o_bias
            elif o_bias.abs().max() > 0:
                raise TrainwiseError(
                    "this checkpoint has a non-zero o_proj bias but no MLP biases; trainwise has biases either on "
                    "every linear (model.bias) or on q/k/v only (model.qkv_bias), so it cannot be loaded exactly.")
        if cfg.qk_norm:
            out[b + "attn.q_norm.weight"] = _take(t, h + "self_attn.q_norm.weight")
            out[b + "attn.k_norm.weight"] = _take(t, h + "self_attn.k_norm.weight")
        if cfg.is_moe_layer(i):
            out.update(_experts_from_hf(cfg, t, h + "mlp.", b + "mlp."))
            continue
        gate, up = _take(t, h + "mlp.gate_proj.weight"), _take(t, h + "mlp.up_proj.weight")
        out[b + "mlp.fc.weight"] = torch.cat([gate, up])
        out[b + "mlp.proj.weight"] = _take(t, h + "mlp.down_proj.weight")
        if cfg.bias:
            out[b + "mlp.fc.bias"] = torch.cat([_take(t, h + "mlp.gate_proj.bias"), _take(t, h + "mlp.up_proj.bias")])
            out[b + "mlp.proj.bias"] = _take(t, h + "mlp.down_proj.bias")
    return out


def _experts_from_hf(cfg: ModelConfig, t: dict, h: str, b: str) -> dict:
    """Mixtral experts, either one Linear per expert (Hub files: w1 gate, w3 up, w2 down) or stacked
    (transformers 5: gate_up_proj (E, 2F, H), down_proj (E, H, F))."""
    out = {b + "router.weight": _take(t, h + "gate.weight")}
    if h + "experts.gate_up_proj" in t:
        out[b + "experts_fc.weight"] = t[h + "experts.gate_up_proj"].transpose(1, 2)  # (E, H, 2F)
        out[b + "experts_proj.weight"] = _take(t, h + "experts.down_proj").transpose(1, 2)  # (E, F, H)
        return out
    e_range = range(cfg.n_experts)
    out[b + "experts_fc.weight"] = torch.stack(
        [torch.cat([_take(t, h + f"experts.{e}.w1.weight"), _take(t, h + f"experts.{e}.w3.weight")]).T for e in e_range])
    out[b + "experts_proj.weight"] = torch.stack([_take(t, h + f"experts.{e}.w2.weight").T for e in e_range])
    return out


def _gpt2_from_hf(cfg: ModelConfig, t: dict) -> dict:
    t = {k.removeprefix("transformer."): v for k, v in t.items()}  # Hub files exist with and without it
    out = {"embed.weight": _take(t, "wte.weight"), "pos_embed.weight": _take(t, "wpe.weight"),
           "norm.weight": _take(t, "ln_f.weight"), "norm.bias": _take(t, "ln_f.bias")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _take(t, "lm_head.weight")
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"h.{i}."
        for hf_name, tw in {"ln_1": "norm1", "ln_2": "norm2"}.items():
            out[b + f"{tw}.weight"] = _take(t, h + f"{hf_name}.weight")
            out[b + f"{tw}.bias"] = _take(t, h + f"{hf_name}.bias")
        conv = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.out", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
        for hf_name, tw in conv.items():
            out[b + f"{tw}.weight"] = _take(t, h + f"{hf_name}.weight").T
            out[b + f"{tw}.bias"] = _take(t, h + f"{hf_name}.bias")
    return out


# ---------------------------------------------------------------------------------------------------
# directories


def export_hf(run_dir: str | Path, out: str | Path) -> dict:
    """Write the latest checkpoint of `run_dir` as a Hugging Face model directory `out`. Returns a summary."""
    run = load_run(run_dir, device="cpu")
    return save_hf(run.model, run.tokenizer, out)


def save_hf(model: torch.nn.Module, tokenizer: Tokenizer, out: str | Path) -> dict:
    """Write a trainwise Transformer and its tokenizer as a Hugging Face model directory (atomically)."""
    out = Path(out)
    cfg = model.cfg
    family = choose_family(cfg)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TrainwiseError(f"'{out}' already exists and is not empty; choose a new --out.")
    tensors = to_hf_state(cfg, family, model.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    bos = tokenizer.special_token("bos_token")
    bos_id = tokenizer.token_id(bos) if bos else None
    config = hf_config(cfg, family, tokenizer.eot_id, bos_id)
    (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": tokenizer.eot_id}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    write_hf_tokenizer(tokenizer, tmp, cfg.max_seq_len)
    if out.is_dir():
        out.rmdir()
    tmp.rename(out)
    return {"out": str(out), "format": "hf", "architecture": ARCHITECTURES[family], "model_type": family,
            "params": sum(v.numel() for v in tensors.values()), "files": sorted(p.name for p in out.iterdir())}


def write_hf_tokenizer(tokenizer: Tokenizer, out: Path, max_len: int) -> None:
    """tokenizer.json as trainwise trained it, plus the tokenizer_config.json that lets AutoTokenizer
    load it as a PreTrainedTokenizerFast with <|endoftext|> as bos/eos. A tokenizer imported with
    --init-from goes back out as it came in: its own tokenizer_config.json and special tokens."""
    if tokenizer.side_files:
        tokenizer.save(out / "tokenizer.json")
        return
    (out / "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, "add_prefix_space": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")


def read_hf_model_config(path: Path) -> tuple[ModelConfig, str]:
    """(ModelConfig, family) from a Hugging Face model directory's config.json, without its weights."""
    return model_config_from_hf(_read_config(path), name=path.name)


def _read_config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise TrainwiseError(f"'{path}' is not a Hugging Face model directory (no config.json).")
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TrainwiseError(f"{path / 'config.json'} is not valid JSON ({err}).") from None


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """A local Hugging Face checkpoint of a supported family -> (ModelConfig, trainwise state dict, Tokenizer).
    Reads config.json, model.safetensors (or its index of shards) and tokenizer.json; no `transformers` needed."""
    path = Path(path)
    d = _read_config(path)
    cfg, family = model_config_from_hf(d, name=path.name)
    tensors = _read_safetensors(path)
    state = from_hf_state(cfg, family, tensors, rope_interleave=bool(d.get("rope_interleave", True)))
    if not (path / "tokenizer.json").is_file():
        raise TrainwiseError(f"'{path}' has no tokenizer.json; --init-from needs the model's fast tokenizer file.")
    tokenizer = Tokenizer.load(path / "tokenizer.json")
    if tokenizer.vocab_size > cfg.vocab_size:
        raise TrainwiseError(f"{path / 'tokenizer.json'} has {tokenizer.vocab_size} tokens but the model only "
                             f"{cfg.vocab_size}: they do not belong together.")
    return cfg, state, tokenizer


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise TrainwiseError(f"'{path}' has no model.safetensors; save the model with safe_serialization=True.")
    tensors = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a state dict from `load_hf_dir` into a Transformer built from its config, every key checked."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and model.cfg.tie_embeddings)]
    if missing or result.unexpected_keys:
        raise TrainwiseError(f"the Hugging Face weights do not fit the model built from its config.json "
                             f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}).")
