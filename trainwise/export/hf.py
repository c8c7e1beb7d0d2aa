"""trainwise <-> Hugging Face `transformers` checkpoints.

Export writes a model directory that `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load offline: config.json, model.safetensors (in the key layout
of the family's published checkpoints on the Hub), generation_config.json, tokenizer.json and
tokenizer_config.json. `load_hf_dir` is the inverse, used by `trainwise train --init-from HF_DIR`.

The config.json, both ways, is trainwise.hf_config's (`to_hf_dict`, and `from_hf_dict` with build=True):
the families export writes (choose_family) and those --init-from reads are listed there. This module
converts the weights: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe and gpt2 here, deepseek_v3 in
trainwise.export.deepseek, gpt_oss in trainwise.export.gpt_oss.

Weight layouts (trainwise -> HF): the fused `attn.qkv` (out = [q nh*hd | k nkv*hd | v nkv*hd]) is split
into q_proj/k_proj/v_proj; the fused gated `mlp.fc` (out = [gate F | up F]) into gate_proj/up_proj;
GPT-2's Conv1D stores (in, out), the transpose of nn.Linear; MoE experts are stacked (E, in, out) in
trainwise and one (out, in) Linear per expert in the Hub's files (Mixtral: w1 gate, w3 up, w2 down;
Qwen3-MoE: gate_proj, up_proj, down_proj).
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
from trainwise.export import deepseek, gpt_oss
from trainwise.export.names import shared_from_hf, shared_to_hf
from trainwise.hf_config import ARCHITECTURES, choose_family, from_hf_dict, read_hf_json, to_hf_dict
from trainwise.inference import load_run
from trainwise.tokenizer import EOT, Tokenizer


# ---------------------------------------------------------------------------------------------------
# weights


def to_hf_state(cfg: ModelConfig, family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """trainwise state dict (tied lm_head may be absent) -> HF Hub-layout tensors."""
    if family == "deepseek_v3":
        out = deepseek.to_hf(cfg, state)
    elif family == "gpt_oss":
        out = gpt_oss.to_hf(cfg, state)
    else:
        out = _gpt2_to_hf(cfg, state) if family == "gpt2" else _llama_to_hf(cfg, family, state)
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def _split_qkv(cfg: ModelConfig, t: torch.Tensor) -> list[torch.Tensor]:
    sizes = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
    return list(t.split(sizes, dim=0))


def _llama_to_hf(cfg: ModelConfig, family: str, s: dict) -> dict:
    out = shared_to_hf(cfg, s)
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
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
        out = deepseek.from_hf(cfg, t, _take, _experts_from_hf, rope_interleave)
    elif family == "gpt_oss":
        out = gpt_oss.from_hf(cfg, t, _take)
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
    out = shared_from_hf(cfg, t, _take)
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out[b + "attn.qkv.weight"] = torch.cat([_take(t, h + f"self_attn.{n}_proj.weight") for n in "qkv"])
        out[b + "attn.out.weight"] = _take(t, h + "self_attn.o_proj.weight")
        if cfg.bias or cfg.qkv_bias:
            out[b + "attn.qkv.bias"] = torch.cat([_take(t, h + f"self_attn.{n}_proj.bias") for n in "qkv"])
            if cfg.bias:
                out[b + "attn.out.bias"] = _take(t, h + "self_attn.o_proj.bias")
            elif t.get(h + "self_attn.o_proj.bias", torch.zeros(1)).abs().max() > 0:  # Qwen2 has none
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
    """An MoE layer's router and experts (h: its HF prefix, b: trainwise's), either one Linear per expert
    (Hub files: Mixtral's w1 gate, w3 up, w2 down; gate_proj, up_proj, down_proj elsewhere) or stacked
    (transformers 5: gate_up_proj (E, 2F, H), down_proj (E, H, F))."""
    out = {b + "router.weight": _take(t, h + "gate.weight")}
    if h + "experts.gate_up_proj" in t:
        out[b + "experts_fc.weight"] = t[h + "experts.gate_up_proj"].transpose(1, 2)  # (E, H, 2F)
        out[b + "experts_proj.weight"] = _take(t, h + "experts.down_proj").transpose(1, 2)  # (E, F, H)
        return out
    gate, up, down = ("w1", "w3", "w2") if h + "experts.0.w1.weight" in t else ("gate_proj", "up_proj", "down_proj")
    e = h + "experts.{}.{}.weight"
    out[b + "experts_fc.weight"] = torch.stack([torch.cat([_take(t, e.format(i, gate)), _take(t, e.format(i, up))]).T
                                                for i in range(cfg.n_experts)])
    out[b + "experts_proj.weight"] = torch.stack([_take(t, e.format(i, down)).T for i in range(cfg.n_experts)])
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
    config = to_hf_dict(cfg, family, tokenizer.eot_id, bos_id)
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
    cfg, d = _read_config(path)
    return cfg, d["model_type"]


def _read_config(path: Path) -> tuple[ModelConfig, dict]:
    """The ModelConfig trainwise builds for the directory's config.json, and the file's dict."""
    if not (path / "config.json").is_file():
        raise TrainwiseError(f"'{path}' is not a Hugging Face model directory (no config.json).")
    d = read_hf_json(path / "config.json")
    return from_hf_dict(d, name=path.name, build=True, source=path / "config.json"), d


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """A local Hugging Face checkpoint of a supported family -> (ModelConfig, trainwise state dict, Tokenizer).
    Reads config.json, model.safetensors (or its index of shards) and tokenizer.json; no `transformers` needed."""
    path = Path(path)
    cfg, d = _read_config(path)
    tensors = _read_safetensors(path)
    state = from_hf_state(cfg, d["model_type"], tensors, rope_interleave=bool(d.get("rope_interleave", True)))
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
