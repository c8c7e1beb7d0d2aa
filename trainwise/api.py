"""The Python API, mirroring the CLI: `trainwise.train(...)`, `trainwise.load(DIR)`, `trainwise.plan(...)`."""

from __future__ import annotations

import inspect
from dataclasses import fields, replace
from pathlib import Path

from trainwise.config import ModelConfig, RunConfig
from trainwise.cost.layout import make_layout
from trainwise.cost.recipe import get_recipe, with_fp8_params, with_grad_dtype
from trainwise.cost.run import Machine, Run
from trainwise.errors import TrainwiseError
from trainwise.inference import LoadedRun, load_run
from trainwise.planner.plan import Plan, check_numbers, plan_run
from trainwise.planner.spec import load_model
from trainwise.trainer.loop import TrainResult
from trainwise.trainer.loop import train as _train

PLAN_KEYWORDS = ("mfu", "price", "memory_budget", "causal_halving")  # plan_run's own; the rest describe the Run
RUN_KEYWORDS = ("seq_len", "micro_batch", "grad_accum", "optimizer", "checkpointing", "compiled", "moe_imbalance",
                "fused", "loss_kernel")
LAYOUT_KEYWORDS = set(inspect.signature(make_layout).parameters) - {"micro_batches"}  # gpus, tp, pp, zero, ...


def load(run_dir: str | Path, device: str = "auto") -> LoadedRun:
    """Same as `trainwise sample`'s loading: the latest checkpoint of a run directory (verified against its
    manifest) with its tokenizer and config; `.generate(prompt, ...)` samples from it."""
    return load_run(run_dir, device)


def train(config: RunConfig | None = None, out: str | Path | None = None, **kwargs) -> TrainResult:
    """Same as `trainwise train`; returns a TrainResult (run_dir, losses, sample)."""
    return _train(config, out, **kwargs)


def plan(model=None, *, params: float | None = None, tokens: float | None = None, **run) -> Plan:
    """Same as `trainwise plan`: `model` is a preset name, a trainwise TOML, a HF config.json or a
    ModelConfig; `run` takes the command's flags as keywords (seq_len, micro_batch, grad_accum, precision,
    grad_dtype, fp8_params, optimizer, checkpointing, gpu, gpus, tp, pp, zero, peak_flops, mfu, price,
    memory_budget, ...), over a TOML's [train] settings. Returns a Plan (`.to_json()`, `.explain()`)."""
    toml_run = None
    if isinstance(model, str):
        model, toml_run = load_model(model)
    elif model is not None and not isinstance(model, ModelConfig):
        raise TrainwiseError("plan(model=...) takes a preset name, a file path or a ModelConfig.")
    run_tokens = toml_run and toml_run.tokens  # a trainwise TOML knows its run length
    if tokens is None and run_tokens is None:
        raise TrainwiseError("plan() needs tokens=D, the number of training tokens.")
    base = toml_run or Run(model, recipe=get_recipe("bf16"))
    described, plan_keywords = run_from_keywords(base, tokens or run_tokens, run)
    return plan_run(described, params_count=params, **plan_keywords)


def run_from_keywords(base: Run, tokens: float, keywords: dict) -> tuple[Run, dict]:
    """plan()'s keywords as the Run they describe (over `base`) and plan_run's own keywords."""
    kw = dict(keywords)
    plan_keywords = {k: kw.pop(k) for k in PLAN_KEYWORDS if k in kw}
    machine = Machine(**{f.name: kw.pop(f.name) for f in fields(Machine) if f.name in kw})
    recipe = get_recipe(kw.pop("precision")) if "precision" in kw else base.recipe
    if "grad_dtype" in kw:
        recipe = with_grad_dtype(recipe, kw.pop("grad_dtype"))
    if kw.pop("fp8_params", False):
        recipe = with_fp8_params(recipe)
    run = replace(base, tokens=tokens, recipe=recipe, machine=None if machine == Machine() else machine,
                  **{k: kw.pop(k) for k in RUN_KEYWORDS if k in kw})
    layout, split = kw.pop("layout", None), {k: kw.pop(k) for k in list(kw) if k in LAYOUT_KEYWORDS}
    if kw:
        raise TypeError(f"plan() got an unexpected keyword argument '{next(iter(kw))}'")
    check_numbers(("--tokens", run.tokens), ("--seq-len", run.seq_len), ("--micro-batch", run.micro_batch),
                  ("--grad-accum", run.grad_accum), *((f"--{k}", split.get(k)) for k in ("tp", "pp", "gpus")))
    if layout is None:
        layout = make_layout(split.pop("gpus", 1), micro_batches=run.grad_accum, **split)
    elif "tp_overlap" in split:
        layout = replace(layout, tp_overlap=split["tp_overlap"])
    return replace(run, layout=layout), plan_keywords
