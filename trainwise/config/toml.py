"""A run's config as TOML (one section per dataclass) and as `--set section.key=value` overrides; unknown
keys and bad values raise TrainwiseError naming the key and the closest valid one."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from trainwise.config.checks import suggest
from trainwise.config.model import default_ffn_hidden
from trainwise.config.run import SECTIONS, RunConfig
from trainwise.errors import TrainwiseError
from trainwise.files import not_a_file, write_atomic


def section_from_dict(cls: type, values: dict[str, Any], where: str) -> Any:
    """Build dataclass `cls` from `values`, rejecting unknown keys and coercing types."""
    hints = get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise TrainwiseError(f"unknown key '{where}.{key}'{suggest(key, known, where)}.")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    parts = {}
    for section, values in data.items():
        if section not in SECTIONS:
            raise TrainwiseError(f"unknown config section '[{section}]'{suggest(section, SECTIONS)}.")
        if not isinstance(values, dict):
            raise TrainwiseError(f"config section '{section}' must be a table of key = value pairs.")
        cls = get_type_hints(RunConfig)[section]
        parts[section] = section_from_dict(cls, values, section)
    cfg = RunConfig(**parts)
    model_vocab = data.get("model", {}).get("vocab_size")
    tokenizer_vocab = data.get("tokenizer", {}).get("vocab_size")
    # One vocab_size set: the other follows it, and a bad value is reported under the key the user set
    if model_vocab is None and tokenizer_vocab is not None:
        cfg.tokenizer.validate()
        cfg.model.vocab_size = cfg.tokenizer.vocab_size  # the model's vocab follows the tokenizer
    elif tokenizer_vocab is None and model_vocab is not None:
        cfg.tokenizer.vocab_size = cfg.model.vocab_size
        try:
            cfg.tokenizer.validate()
        except TrainwiseError as err:
            raise TrainwiseError(f"model.vocab_size = {cfg.model.vocab_size} sets tokenizer.vocab_size too, and "
                                 f"{err}") from None
    return cfg


def config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise TrainwiseError(f"config file '{path}' {not_a_file(path)}; pass an existing TOML file to --config (a run "
                             "directory's is its config.toml).")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise TrainwiseError(f"config file '{path}' is not valid TOML: {err}. Fix the line it names.") from None
    return config_from_dict(data)


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `section.key=value` strings; values are parsed as TOML scalars, else taken as strings."""
    explicit: dict[str, dict[str, Any]] = {}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise TrainwiseError(f"--set '{item}' must look like section.key=value, e.g. train.max_steps=100.")
        dotted, raw = item.split("=", 1)
        section, key = dotted.strip().split(".", 1)
        if section not in SECTIONS:
            raise TrainwiseError(f"--set '{item}': unknown section '{section}'{suggest(section, SECTIONS)}.")
        explicit.setdefault(section, {})[key] = _parse_value(raw.strip())
    # Resolved derived fields (ffn_hidden, ...) must be recomputed when their inputs change, so rebuild
    # from the user's explicit values rather than from the resolved ones.
    base = _explicit_dict(cfg)
    if "vocab_size" in explicit.get("tokenizer", {}) and "vocab_size" not in explicit.get("model", {}):
        base["model"].pop("vocab_size")
    elif "vocab_size" in explicit.get("model", {}) and "vocab_size" not in explicit.get("tokenizer", {}):
        base["tokenizer"].pop("vocab_size")
    for section, values in explicit.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


def _explicit_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """The config as a dict with the derived model fields left at their 'derive me' value when they
    equal what derivation would give, so a later change of d_model re-derives ffn_hidden."""
    data = config_to_dict(cfg)
    m = cfg.model
    if m.n_kv_heads == m.n_heads:
        data["model"]["n_kv_heads"] = 0
    if m.head_dim == (m.qk_rope_head_dim if m.attention == "mla" else m.d_model // m.n_heads):
        data["model"]["head_dim"] = 0
    if m.ffn_hidden == default_ffn_hidden(m.d_model, m.activation):
        data["model"]["ffn_hidden"] = 0
    if m.expert_ffn_hidden == m.ffn_hidden:
        data["model"]["expert_ffn_hidden"] = 0
    return data


def save_config(cfg: RunConfig, path: str | Path) -> None:
    write_atomic(path, to_toml(config_to_dict(cfg)))


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table: [[data.sources]] entries
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} to TOML")


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _coerce(value: Any, hint: Any, where: str) -> Any:
    hint_name = getattr(hint, "__name__", str(hint))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise TrainwiseError(f"{where} = {value!r} must be true or false.")
    if hint is int:
        # TOML reads nan and inf as floats; int() of them would raise rather than say which key is wrong
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or int(value) != value):
            raise TrainwiseError(f"{where} = {value!r} must be an integer.")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TrainwiseError(f"{where} = {value!r} must be a number.")
        if not math.isfinite(value):  # no setting means nan or inf; one would reach the weights as nan
            raise TrainwiseError(f"{where} = {value!r} must be a finite number.")
        return float(value)
    if hint is str:
        if isinstance(value, bool):  # --set train.activation_checkpointing=true, train.compile=false
            if where.endswith("activation_checkpointing"):
                return "full" if value else "none"
            return "true" if value else "false"
        if isinstance(value, (list, dict)):  # str() would make a name of "[1, 2]" without a word
            raise TrainwiseError(f"{where} = {_toml_value(value)} must be a single value, not a "
                                 f"{'list' if isinstance(value, list) else 'table'}.")
        return str(value)
    if "dict" in str(hint):  # data.sources: a list of tables
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise TrainwiseError(f"{where} = {value!r} must be a list of tables ([[{where}]] in TOML).")
        return [dict(v) for v in value]
    if "list" in str(hint):
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list):
            raise TrainwiseError(f"{where} = {value!r} must be a list of strings.")
        return [str(v) for v in value]
    raise TypeError(f"unsupported config type {hint_name}")
