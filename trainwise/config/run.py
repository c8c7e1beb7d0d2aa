"""[train], [data], [tokenizer], [parallel], [log] and the whole run (RunConfig)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field, fields

from trainwise.config.checks import choice, suggest
from trainwise.config.model import ModelConfig
from trainwise.errors import TrainwiseError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "sgd")
# selective: Korthikanti et al.'s attention-core recompute; op: torchtitan's op-level policy (the output of every
# other matmul and of attention kept, the rest of each block recomputed); full: each block's input kept
CHECKPOINTING = ("none", "selective", "op", "full")
COMPILE = ("auto", "true", "false")
STRATEGIES = ("none", "ddp", "zero1", "zero2", "fsdp")
PP_SCHEDULES = ("1f1b", "interleaved", "gpipe", "interleaved_zb", "zbv", "dualpipev")
# schedules that run several stages per pipeline rank (parallel.vpp of them); zbv and dualpipev two, in a V
MULTI_STAGE_SCHEDULES = ("interleaved", "interleaved_zb", "zbv", "dualpipev")
# When FSDP reduce-scatters a step's gradients: once, after the last micro-batch ("step"), or each micro-batch's
# as its backward runs ("micro-batch"): trainwise.cost.layout.Layout.fsdp_grad_sync
FSDP_GRAD_SYNCS = ("step", "micro-batch")
FSDP_STRATEGIES = ("zero2", "fsdp")  # both run on FSDP2 (fully_shard)
# The ZeRO stage each parallel.strategy realises on the data-parallel dimension, and back (a plan's stage as
# the trainer runs it over more than one rank).
ZERO_STAGE = {"none": 0, "ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
STRATEGY_OF_STAGE = {stage: name for name, stage in ZERO_STAGE.items() if name != "none"}
RESUME_POLICIES = ("auto", "never", "always")


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
                    "weight_decay", "min_lr", "sample_tokens"):
            if getattr(self, key) < 0:
                raise TrainwiseError(f"train.{key} = {getattr(self, key)} must not be negative.")
        if self.lr <= 0:
            raise TrainwiseError(f"train.lr = {self.lr} must be positive (e.g. 1e-3).")
        if self.min_lr > self.lr:  # the cosine schedule would raise the rate from lr to min_lr as it "decays"
            raise TrainwiseError(
                f"train.min_lr = {self.min_lr:g} is above train.lr = {self.lr:g}: the learning rate would rise over "
                f"the run instead of decaying to it. Set train.min_lr at most train.lr, e.g. train.min_lr="
                f"{self.lr / 10:g} (a tenth, as the defaults {TrainConfig.lr:g} and {TrainConfig.min_lr:g} are).")
        for key in ("beta1", "beta2", "momentum"):  # torch's optimizers refuse others without naming the key
            if not 0.0 <= getattr(self, key) < 1.0:
                raise TrainwiseError(f"train.{key} = {getattr(self, key)} must be in [0, 1) (e.g. 0.9).")
        if not 0 <= self.seed < 2**32:  # Python, NumPy and torch are all seeded with it; NumPy takes 32 bits
            raise TrainwiseError(f"train.seed = {self.seed} must be between 0 and 2**32 - 1 = {2**32 - 1}.")
        choice("train.optimizer", self.optimizer, OPTIMIZERS)
        choice("train.precision", self.precision, PRECISIONS)
        choice("train.activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
        choice("train.compile", self.compile, COMPILE)
        choice("train.on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        choice("train.resume", self.resume, RESUME_POLICIES)
        choice("train.memory_check", self.memory_check, ("on", "warn", "off"))


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
                raise TrainwiseError(f"{where} has unknown key '{unknown[0]}'{suggest(unknown[0], allowed)}; "
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
    """How a torchrun job divides the work: world size = dp x pp x tp (x cp); `strategy` says how the
    data-parallel dimension shards (trainwise.runtime.mesh). tp runs with sequence parallelism; pp splits
    the layers into pp x vpp stages fed grad_accum_steps micro-batches per step. ep divides each MoE layer's
    routed experts over ep of the data-parallel ranks (dp = edp x ep, trainwise.runtime.expert_parallel), with
    parallel.strategy = ddp, zero2 or fsdp (with tp, each expert's width also split over the tp ranks). cp
    divides each sequence over cp ranks, which join the data-parallel ones in the gradient reduction (world
    size = dp x cp x tp; attention over all-gathered keys and values, trainwise.runtime.context_parallel),
    without pp so far."""

    strategy: str = "none"
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    vpp: int = 1  # stages per pipeline rank (interleaved 1F1B, Narayanan et al. 2021)
    cp: int = 1
    ep: int = 1
    # with accumulation under fsdp: "step" sums the micro-batches' unsharded fp32 gradients and reduce-scatters
    # them once; "micro-batch" reduce-scatters each one's into the rank's shard (less memory, K x the reductions)
    fsdp_grad_sync: str = "step"

    def validate(self) -> None:
        choice("parallel.strategy", self.strategy, STRATEGIES)
        choice("parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        choice("parallel.fsdp_grad_sync", self.fsdp_grad_sync, FSDP_GRAD_SYNCS)
        if self.fsdp_grad_sync == "micro-batch" and (self.strategy != "fsdp" or self.pp > 1):
            raise TrainwiseError(
                f"parallel.fsdp_grad_sync = micro-batch says when FSDP reduce-scatters gradients, but this run is "
                f"parallel.strategy = {self.strategy} with parallel.pp = {self.pp}: it needs parallel.strategy=fsdp "
                "and no pipeline stages (torch's pipeline schedules reduce at each stage's last backward); set "
                "parallel.fsdp_grad_sync=step otherwise.")
        for key in ("tp", "pp", "vpp", "cp", "ep"):
            if getattr(self, key) < 1:
                raise TrainwiseError(f"parallel.{key} = {getattr(self, key)} must be a positive integer (1 = off).")
        if self.cp > 1 and self.pp > 1:
            raise TrainwiseError(
                f"parallel.cp = {self.cp} with parallel.pp = {self.pp}: trainwise trains context parallelism with "
                "tensor parallelism and the data-parallel dimension, not across pipeline stages yet; set "
                "parallel.pp=1 (or parallel.cp=1).")
        if self.ep > 1:
            self._check_ep()
        if self.vpp > 1 and self.pp_schedule not in MULTI_STAGE_SCHEDULES:
            raise TrainwiseError(
                f"parallel.vpp = {self.vpp} gives each pipeline rank {self.vpp} stages, which the {self.pp_schedule} "
                f"schedule does not run; set parallel.pp_schedule to one of {', '.join(MULTI_STAGE_SCHEDULES)} (or "
                f"parallel.vpp=1 for {self.pp_schedule}).")
        if self.pp_schedule in ("interleaved", "interleaved_zb") and self.pp > 1 and self.vpp < 2:
            raise TrainwiseError(
                f"parallel.pp_schedule = {self.pp_schedule} needs parallel.vpp >= 2 stages per pipeline rank (with "
                "one it is 1F1B); set parallel.vpp=2, or parallel.pp_schedule=1f1b.")
        if self.pp_schedule in ("zbv", "dualpipev") and self.pp > 1 and self.vpp != 2:
            raise TrainwiseError(
                f"parallel.pp_schedule = {self.pp_schedule} runs exactly two stages per pipeline rank, placed in a V "
                f"(rank r holds stages r and 2 pp - 1 - r); set parallel.vpp=2 (it is {self.vpp}).")
        if self.strategy == "zero1" and (self.tp > 1 or self.pp > 1):
            raise TrainwiseError(
                f"parallel.strategy = zero1 with parallel.tp = {self.tp}, parallel.pp = {self.pp}: ZeRO-1's optimizer "
                "(ZeroRedundancyOptimizer) does not take tensor- or pipeline-parallel parameters; use "
                "parallel.strategy=zero2 (optimizer states and gradients sharded, FSDP2) or fsdp instead.")

    def _check_ep(self) -> None:
        """Expert parallelism as trainwise trains it: over the data-parallel ranks (of each stage) that DDP or
        FSDP2 (zero2, fsdp) runs (with tp, each expert's width split over tp as well)."""
        if self.strategy not in ("ddp", "zero2", "fsdp"):
            raise TrainwiseError(
                f"parallel.ep = {self.ep} with parallel.strategy = {self.strategy}: expert parallelism divides the "
                "experts over data-parallel ranks; set parallel.strategy to ddp, zero2 or fsdp (ZeRO-1's optimizer, "
                "ZeroRedundancyOptimizer, does not take divided experts), or parallel.ep=1.")

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica spans: tp x pp (the data-parallel size is world size / this)."""
        return self.tp * self.pp


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
        check_op_checkpointing(self.model, self.train.activation_checkpointing, "train.activation_checkpointing")


def check_op_checkpointing(model: ModelConfig, checkpointing: str, name: str) -> None:
    """Op-level selective checkpointing is built (and its memory modelled) for dense blocks of multi-head or
    grouped-query attention; a clear error for the others."""
    if checkpointing == "op" and (model.is_moe or model.attention == "mla"):
        what = "a mixture-of-experts model" if model.is_moe else "multi-head latent attention"
        raise TrainwiseError(
            f"{name} = 'op' with {what}: op-level selective checkpointing covers dense blocks of multi-head or "
            "grouped-query attention; use 'selective' (the attention core recomputed) or 'full' instead.")


SECTIONS = [f.name for f in fields(RunConfig)]
