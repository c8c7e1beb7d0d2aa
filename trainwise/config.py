"""The run's description: model, training, data, tokenizer and parallel settings.

One set of dataclasses, read by the planner and the trainer alike. A run is saved as TOML with one
section per dataclass (`[model]`, `[train]`, ...) and can be changed from the command line with
`--set section.key=value`. Unknown keys and bad values raise `TrainwiseError` naming the key and the
closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from trainwise.errors import TrainwiseError

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("rope", "learned")
ATTENTIONS = ("mha", "mla")  # mha covers MHA/GQA/MQA through n_kv_heads; mla = DeepSeek latent attention
GATINGS = ("softmax", "sigmoid")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "sgd")
CHECKPOINTING = ("none", "selective", "full")
COMPILE = ("auto", "true", "false")
STRATEGIES = ("none", "ddp", "zero1", "zero2", "fsdp")
FSDP_STRATEGIES = ("zero2", "fsdp")  # both run on FSDP2 (fully_shard)
RESUME_POLICIES = ("auto", "never", "always")


@dataclass
class ModelConfig:
    """A decoder-only Transformer. Zero in a derived field (ffn_hidden, n_kv_heads, head_dim) means
    "the usual value", resolved by `__post_init__` so that every reader sees the same number."""

    name: str = "trainwise-small"
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # 0 = n_heads (MHA); 1 = MQA; in between = GQA
    head_dim: int = 0  # 0 = d_model // n_heads
    ffn_hidden: int = 0  # 0 = 4*d_model, or 8/3*d_model rounded up to 64 for gated activations
    activation: str = "swiglu"
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    position: str = "rope"
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bias: bool = False  # biases in every linear layer (GPT-2 style)
    qkv_bias: bool = False  # biases on the q/k/v projections only (Qwen2 style)
    qk_norm: bool = False  # RMSNorm on each head's q and k (Qwen3 style)
    dropout: float = 0.0
    max_seq_len: int = 256
    init_std: float = 0.02
    # > 0: the loss computes the LM head's logits this many tokens at a time and recomputes them in
    # backward (trainwise.model.loss), so the fp32 B x T x V logits never exist whole. Changes memory
    # and adds one head matmul (2HV FLOPs/token); the loss and gradients stay the same. 0 = plain.
    loss_chunk_tokens: int = 0
    # Mixture-of-Experts (n_experts = 0: every layer dense)
    n_experts: int = 0
    top_k: int = 0
    expert_ffn_hidden: int = 0  # 0 = ffn_hidden
    n_shared_experts: int = 0
    first_dense_layers: int = 0
    moe_every: int = 1  # MoE on every n-th layer after first_dense_layers (1 = all)
    router_gating: str = "softmax"
    router_bias: bool = False  # learned router bias (e.g. DeepSeek's e_score_correction_bias)
    renormalize_top_k: bool = True
    dropless: bool = True  # every token reaches its top_k experts; false = capacity_factor applies
    capacity_factor: float = 1.25  # expert capacity = factor * tokens * top_k / n_experts (dropless=false)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    # Attention variant; the "mla" fields follow DeepSeek-V2/V3's config.json names
    attention: str = "mha"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        self.validate()
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.head_dim == 0:
            self.head_dim = self.d_model // self.n_heads
        if self.ffn_hidden == 0:
            self.ffn_hidden = default_ffn_hidden(self.d_model, self.activation)
        if self.n_experts and self.expert_ffn_hidden == 0:
            self.expert_ffn_hidden = self.ffn_hidden

    @property
    def gated(self) -> bool:
        """SwiGLU/GeGLU MLPs have three matrices (gate, up, down) instead of two."""
        return self.activation in ("swiglu", "geglu")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Layers before first_dense_layers stay dense; after that every moe_every-th layer is MoE."""
        if not self.is_moe or layer < self.first_dense_layers:
            return False
        return (layer - self.first_dense_layers) % self.moe_every == 0

    def validate(self) -> None:
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
        for key in positive:
            if getattr(self, key) <= 0:
                raise TrainwiseError(
                    f"model.{key} = {getattr(self, key)} must be a positive integer; set it with "
                    f"--set model.{key}=N (for example the default {getattr(ModelConfig, key)})."
                )
        for key in ("n_kv_heads", "head_dim", "ffn_hidden", "n_experts", "top_k", "expert_ffn_hidden",
                    "n_shared_experts", "first_dense_layers", "loss_chunk_tokens"):
            if getattr(self, key) < 0:
                raise TrainwiseError(f"model.{key} = {getattr(self, key)} must not be negative.")
        _choice("model.activation", self.activation, ACTIVATIONS)
        _choice("model.norm", self.norm, NORMS)
        _choice("model.position", self.position, POSITIONS)
        _choice("model.attention", self.attention, ATTENTIONS)
        _choice("model.router_gating", self.router_gating, GATINGS)
        if self.head_dim == 0 and self.attention == "mha" and self.d_model % self.n_heads:
            raise TrainwiseError(
                f"model.n_heads = {self.n_heads} does not divide model.d_model = {self.d_model}: each head "
                f"gets d_model / n_heads dimensions. Pick n_heads from {_divisors(self.d_model)} or set "
                "model.head_dim explicitly."
            )
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise TrainwiseError(
                f"model.n_kv_heads = {kv} does not divide model.n_heads = {self.n_heads}: grouped-query "
                f"attention shares each k/v head among n_heads / n_kv_heads query heads. Pick one of "
                f"{_divisors(self.n_heads)}."
            )
        if self.position == "rope" and (self.head_dim or self.d_model // self.n_heads) % 2:
            raise TrainwiseError("RoPE rotates pairs of dimensions, so the head dimension must be even.")
        if not 0.0 <= self.dropout < 1.0:
            raise TrainwiseError(f"model.dropout = {self.dropout} must be in [0, 1).")
        if self.top_k and not self.n_experts:
            raise TrainwiseError("model.top_k is set but model.n_experts = 0: set n_experts too for MoE.")
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise TrainwiseError(
                    f"model.top_k = {self.top_k} must be between 1 and model.n_experts = {self.n_experts}: "
                    "each token is sent to top_k of the n_experts routed experts."
                )
            if self.capacity_factor <= 0:
                raise TrainwiseError(
                    f"model.capacity_factor = {self.capacity_factor} must be > 0 (e.g. 1.25); for routing "
                    "without a capacity limit set model.dropless=true instead."
                )
            if self.moe_every < 1:
                raise TrainwiseError("model.moe_every must be >= 1.")


def default_ffn_hidden(d_model: int, activation: str) -> int:
    """4H for plain MLPs; for gated ones 2/3 of 4H (same parameter count), rounded up to 64 (Llama)."""
    if activation in ("swiglu", "geglu"):
        return 64 * math.ceil(8 * d_model / 3 / 64)
    return 4 * d_model


@dataclass
class TrainConfig:
    seed: int = 1337
    max_steps: int = 300
    micro_batch: int = 16
    grad_accum_steps: int = 1
    seq_len: int = 256
    optimizer: str = "adamw"
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    momentum: float = 0.9  # SGD only
    grad_clip: float = 1.0  # 0 = no clipping
    on_nonfinite: str = "skip"  # a NaN/inf loss or gradient: skip the step and count it, or "stop"
    precision: str = "auto"  # auto = bf16 autocast where the device has fast bf16 matmuls, else fp32
    activation_checkpointing: str = "none"
    compile: str = "auto"  # torch.compile the model: auto = where the run is long enough to repay it
    device: str = "auto"
    eval_every: int = 50
    eval_steps: int = 10
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    keep_best: bool = False  # also keep the checkpoint with the lowest validation loss (checkpoints/best.json)
    sample_tokens: int = 120
    # `train --out DIR` where DIR already holds a run of this config (a requeued job reruns its command):
    # auto = continue it from its latest checkpoint (step 0 if it has none), never = refuse, always = refuse
    # to start a new run (DIR must hold one). A DIR of another config is refused whatever the setting.
    resume: str = "auto"
    memory_check: str = "on"  # hold the planned peak against free memory before step 1: on (stop) | warn | off

    @property
    def tokens_per_step(self) -> int:
        """Tokens one process consumes per optimizer step: micro_batch x grad_accum_steps x seq_len."""
        return self.micro_batch * self.grad_accum_steps * self.seq_len

    def validate(self) -> None:
        for key in ("max_steps", "micro_batch", "grad_accum_steps", "seq_len", "eval_steps", "log_every"):
            if getattr(self, key) <= 0:
                raise TrainwiseError(f"train.{key} = {getattr(self, key)} must be a positive integer.")
        for key in ("warmup_steps", "eval_every", "checkpoint_every", "keep_checkpoints", "grad_clip",
                    "weight_decay", "min_lr"):
            if getattr(self, key) < 0:
                raise TrainwiseError(f"train.{key} = {getattr(self, key)} must not be negative.")
        if self.lr <= 0:
            raise TrainwiseError(f"train.lr = {self.lr} must be positive (e.g. 1e-3).")
        _choice("train.optimizer", self.optimizer, OPTIMIZERS)
        _choice("train.precision", self.precision, PRECISIONS)
        _choice("train.activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
        _choice("train.compile", self.compile, COMPILE)
        _choice("train.on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        _choice("train.resume", self.resume, RESUME_POLICIES)
        _choice("train.memory_check", self.memory_check, ("on", "warn", "off"))


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)  # empty = the built-in corpus
    text_field: str = "text"  # .jsonl/.csv/Parquet/Arrow field; a nested one as a.b or a.0.b
    val_fraction: float = 0.05
    encoding: str = "auto"  # auto (BOM, UTF-8, else detected) | utf-8 | any Python codec name
    include: list[str] = field(default_factory=list)  # globs a file found in a folder must match (any)
    exclude: list[str] = field(default_factory=list)  # globs that leave a file out
    workers: int = 0  # tokenizing processes; 0 = one per core
    # A mixture: [[data.sources]] tables with path (or paths), weight, and optionally name, text_field,
    # encoding; sampled in proportion to the weights. Replaces data.paths.
    sources: list[dict] = field(default_factory=list)

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 0.5:
            raise TrainwiseError(f"data.val_fraction = {self.val_fraction} must be in (0, 0.5).")
        if self.encoding != "auto":
            import codecs

            try:
                codecs.lookup(self.encoding)
            except LookupError:
                raise TrainwiseError(
                    f"data.encoding = '{self.encoding}' is not a codec Python knows; use auto, utf-8, or a codec "
                    "name such as gb18030, big5, shift_jis, euc_kr, cp1252."
                ) from None
        if self.workers < 0:
            raise TrainwiseError(f"data.workers = {self.workers} must be >= 0 (0 = one per core).")
        if self.sources:
            if self.paths:
                raise TrainwiseError("data.paths and data.sources are both set; a mixture lists every path in its "
                                     "[[data.sources]] tables, so leave data.paths empty (or drop data.sources).")
            self.source_configs()

    def source_configs(self) -> list[SourceConfig]:
        """One DataConfig per [[data.sources]] table, with its name and weight."""
        out = []
        allowed = ("path", "paths", "weight", "name", "text_field", "encoding")
        for i, table in enumerate(self.sources):
            where = f"data.sources[{i}]"
            unknown = [k for k in table if k not in allowed]
            if unknown:
                raise TrainwiseError(f"{where} has unknown key '{unknown[0]}'{_suggest(unknown[0], allowed)}; "
                                     f"a source takes {', '.join(allowed)}.")
            paths = table.get("paths", table.get("path"))
            if not paths:
                raise TrainwiseError(f"{where} has no path; give each source path = \"...\" (or paths = [...]).")
            weight = table.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise TrainwiseError(f"{where}.weight = {weight!r} must be a positive number.")
            paths = [paths] if isinstance(paths, str) else [str(p) for p in paths]
            source = SourceConfig(paths=paths, text_field=str(table.get("text_field", self.text_field)),
                                  val_fraction=self.val_fraction, encoding=str(table.get("encoding", self.encoding)),
                                  include=self.include, exclude=self.exclude, workers=self.workers,
                                  name=str(table.get("name", paths[0])), weight=float(weight))
            source.validate()
            out.append(source)
        names = [s.name for s in out]
        if len(set(names)) != len(names):
            raise TrainwiseError(f"data.sources names {names} repeat; give each source its own name = \"...\".")
        return out


@dataclass
class SourceConfig(DataConfig):
    """One source of a mixture: a DataConfig with a name and a sampling weight."""

    name: str = ""
    weight: float = 1.0


@dataclass
class TokenizerConfig:
    vocab_size: int = 4096

    def validate(self) -> None:
        if self.vocab_size < 260:
            raise TrainwiseError(
                f"tokenizer.vocab_size = {self.vocab_size} is too small: byte-level BPE needs the 256 "
                "byte tokens plus special tokens; use at least 260 (e.g. 4096)."
            )


@dataclass
class ParallelConfig:
    strategy: str = "none"

    def validate(self) -> None:
        _choice("parallel.strategy", self.strategy, STRATEGIES)


@dataclass
class LogConfig:
    tensorboard: bool = False
    wandb: bool = False  # also log to Weights & Biases (WANDB_MODE=offline keeps it on disk)
    wandb_project: str = "trainwise"

    def validate(self) -> None:
        pass


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> None:
        self.model.validate()
        for section in (self.train, self.data, self.tokenizer, self.parallel, self.log):
            section.validate()
        if self.train.seq_len > self.model.max_seq_len:
            raise TrainwiseError(
                f"train.seq_len = {self.train.seq_len} is longer than model.max_seq_len = "
                f"{self.model.max_seq_len}: the model cannot attend over more positions than it was built "
                f"for. Lower train.seq_len or raise model.max_seq_len to at least {self.train.seq_len}."
            )


SECTIONS = [f.name for f in fields(RunConfig)]


# ---------------------------------------------------------------------------------------------------
# dict <-> dataclass, TOML, overrides


def section_from_dict(cls: type, values: dict[str, Any], where: str) -> Any:
    """Build dataclass `cls` from `values`, rejecting unknown keys and coercing types."""
    hints = get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise TrainwiseError(f"unknown key '{where}.{key}'{_suggest(key, known, where)}.")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    parts = {}
    for section, values in data.items():
        if section not in SECTIONS:
            raise TrainwiseError(f"unknown config section '[{section}]'{_suggest(section, SECTIONS)}.")
        if not isinstance(values, dict):
            raise TrainwiseError(f"config section '{section}' must be a table of key = value pairs.")
        cls = get_type_hints(RunConfig)[section]
        parts[section] = section_from_dict(cls, values, section)
    cfg = RunConfig(**parts)
    model_vocab = data.get("model", {}).get("vocab_size")
    tokenizer_vocab = data.get("tokenizer", {}).get("vocab_size")
    if model_vocab is None and tokenizer_vocab is not None:
        cfg.model.vocab_size = cfg.tokenizer.vocab_size  # the model's vocab follows the tokenizer
    elif tokenizer_vocab is None and model_vocab is not None:
        cfg.tokenizer.vocab_size = cfg.model.vocab_size
    return cfg


def config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise TrainwiseError(f"config file '{path}' does not exist; pass an existing TOML file to --config.")
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
            raise TrainwiseError(f"--set '{item}': unknown section '{section}'{_suggest(section, SECTIONS)}.")
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
    if m.head_dim == m.d_model // m.n_heads:
        data["model"]["head_dim"] = 0
    if m.ffn_hidden == default_ffn_hidden(m.d_model, m.activation):
        data["model"]["ffn_hidden"] = 0
    if m.expert_ffn_hidden == m.ffn_hidden:
        data["model"]["expert_ffn_hidden"] = 0
    return data


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(to_toml(config_to_dict(cfg)), encoding="utf-8")


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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise TrainwiseError(f"{where} = {value!r} must be an integer.")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TrainwiseError(f"{where} = {value!r} must be a number.")
        return float(value)
    if hint is str:
        if isinstance(value, bool):  # --set train.activation_checkpointing=true, train.compile=false
            if where.endswith("activation_checkpointing"):
                return "full" if value else "none"
            return "true" if value else "false"
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


def _choice(where: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise TrainwiseError(f"{where} = '{value}' is not one of {', '.join(allowed)}{_suggest(value, allowed)}.")


def _suggest(word: str, candidates: Any, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.5)
    if not close:
        return ""
    names = " or ".join(f"'{prefix + '.' if prefix else ''}{c}'" for c in close)
    return f" (did you mean {names}?)"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
