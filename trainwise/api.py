"""The Python API, mirroring the CLI: `trainwise.train(...)`, `trainwise.load(DIR)`, `trainwise.plan(...)`."""

from __future__ import annotations

from pathlib import Path

from trainwise.config import ModelConfig, RunConfig
from trainwise.errors import TrainwiseError
from trainwise.inference import LoadedRun, load_run
from trainwise.planner.plan import Plan, plan_run
from trainwise.planner.spec import load_model
from trainwise.trainer.loop import TrainResult
from trainwise.trainer.loop import train as _train


def load(run_dir: str | Path, device: str = "auto") -> LoadedRun:
    """Same as `trainwise sample`'s loading: the latest checkpoint of a run directory (verified against its
    manifest) with its tokenizer and config; `.generate(prompt, ...)` samples from it."""
    return load_run(run_dir, device)


def train(config: RunConfig | None = None, out: str | Path | None = None, **kwargs) -> TrainResult:
    """Same as `trainwise train`; returns a TrainResult (run_dir, losses, sample)."""
    return _train(config, out, **kwargs)


def plan(model=None, *, params: float | None = None, tokens: float | None = None, **run) -> Plan:
    """Same as `trainwise plan`: `model` is a preset name, a trainwise TOML, a HF config.json or a
    ModelConfig; `run` takes plan_run's keywords (seq_len, micro_batch, gpu, gpus, precision, zero, ...).
    Returns a Plan (`.to_json()`, `.explain()`)."""
    settings = {}
    if isinstance(model, str):
        model, settings = load_model(model)
    elif model is not None and not isinstance(model, ModelConfig):
        raise TrainwiseError("plan(model=...) takes a preset name, a file path or a ModelConfig.")
    run_tokens = settings.pop("tokens", None)  # a trainwise TOML knows its run length
    settings.update(run)
    if tokens is None and run_tokens is None:
        raise TrainwiseError("plan() needs tokens=D, the number of training tokens.")
    return plan_run(model, params_count=params, tokens=tokens or run_tokens, **settings)
