"""`trainwise scale sweep`: train a small IsoFLOP grid on the corpus inside a time budget, then fit it.

Design (and why):
- Models come from one shape ladder (shape(): width, depth = width / 64; head_dim 32, SwiGLU, RMSNorm,
  RoPE, tied embeddings: the default model's family), so N is the only thing that changes between them.
- Every run uses a constant LR after warmup (min_lr = lr). Then the first D tokens of a run are exactly
  a run of D tokens, and every validation row is a legitimate point (N, D, L) (trainwise.scale.points).
  With a cosine schedule only the final row of each run would count, and a 20-minute budget buys too few
  runs for five parameters. The price: the law describes constant-LR runs, so a prediction is for a run
  with the sweep's recipe (printed with the fit, stored in it); `predict` says so.
- IsoFLOP: each of SWEEP_MODELS sizes around the 20-tokens-per-parameter rule of Hoffmann et al. trains
  to the same compute C (exact per-token FLOPs of cost/flops.py, so D = C / flops_per_token). Because
  each curve holds every smaller D, the lower IsoFLOP slices C/2, C/4, ... are rows of the same runs.
- Seeds: the grid is sized for 1/SWEEP_SEEDS of the budget, and the rest trains it again with seeds 1,
  2, ...: a run's final loss moves with its seed by about as much as the law's error (the 20-minute
  builtin:stdlib sweep of benchmarks/RESULTS.md, every run scored on the same validation batches: 0.4-3.3%
  between three seeds of one model, the fit's rms error 1.4%), and a prediction is for a run's expected
  loss, so the fit goes through every seed's curve.
- Sizing: C is the largest compute whose predicted time fits the grid's share of the budget. The
  planner predicts each run's time (cost/plan.py: FLOPs / (calibrated peak x MFU)) with the MFU of each model measured
  on a few steps first (tiny models reach a small fraction of the peak the planner's default assumes), plus
  evaluation. After each run the measured wall time corrects the prediction of the ones left, and
  their tokens are resized to the time that is left. The probes count against the budget; a run never
  gets fewer than 4 x EVALS_PER_RUN steps, so a budget too small for that overruns.
- Repeated data: no run passes over the corpus more than REPEAT_EPOCHS times (the law has no term for
  repeated tokens; points.py leaves such rows out of any fit). On a small corpus that, not the time
  budget, bounds C: the largest C at which the grid's smallest model stays within those passes. The
  sweep says so (the default training corpus, 106k training tokens, is spent in a few minutes on a small
  CPU, and its fit identifies a power law in D and nothing about N or E): more text is what buys a
  bigger sweep, and the time left buys the grid again with other seeds. So without data the sweep takes
  SWEEP_DATA, the standard library's source (~3.3M training tokens with the 4096-token BPE).
- Pieces: the plan and each finished run are kept in the sweep's directory (SWEEP_STATE), so the same
  call continues a sweep that stopped, and the budget counts the time spent sizing and training, not the
  time between calls: on a shared machine the sweep runs in slices (benchmarks/scaling.py --piece-minutes).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from trainwise.config import RunConfig, apply_overrides
from trainwise.cost.flops import flops_per_token_train
from trainwise.cost.run import Machine, Run
from trainwise.cost.time import model_flops_utilization
from trainwise.data.corpus import prepare_tokenizer
from trainwise.data.sources import STDLIB_CORPUS
from trainwise.errors import TrainwiseError
from trainwise.files import write_json_atomic
from trainwise.planner.machine import device_hardware
from trainwise.planner.plan import plan_run
from trainwise.runtime.precision import resolve_device, resolve_precision
from trainwise.runtime.step import build_model, build_step, random_batches
from trainwise.scale.points import REPEAT_EPOCHS, non_embedding_params, train_tokens
from trainwise.trainer.loop import train

SWEEP_DATA = [STDLIB_CORPUS]  # the corpus of a sweep given no data (trainwise.data.sources)
SWEEP_WIDTHS = (64, 96, 128, 160, 192, 256, 320, 384, 512)
SWEEP_MODELS = 5
TOKENS_PER_PARAM = 20.0  # Hoffmann et al.'s compute-optimal ratio, used only to centre the grid
EVALS_PER_RUN = 16
SWEEP_SEEDS = 3  # runs per model: the grid takes 1/SWEEP_SEEDS of the budget (run_sweep)
# 512-token steps: on a corpus that bounds the sweep (the built-in one), the recipe that gets most out of
# each token. A d_model-128 model after 4 passes over it: 4.69 nats/token with 4 x 128-token steps,
# 4.85 with 8 x 256 (which also sat on the unigram plateau, ~6.4, from 50k to 130k tokens).
# 32 validation batches (16k tokens): on builtin:stdlib one model scored 4.16, 3.86, 3.56 and 3.82 nats on
# four draws of 8 batches, 3.70-3.89 on draws of 64; every run of a sweep is scored on the same draw
# (trainwise.data.bpb.VAL_SEED), and a larger one is a fairer sample of the split
SWEEP_TRAIN = dict(micro_batch=4, seq_len=128, warmup_steps=20, eval_steps=32, sample_tokens=16, compile="false",
                   checkpoint_every=0, keep_checkpoints=1)


def sweep_base(overrides: list[str]) -> RunConfig:
    """The sweep's base run: the default RunConfig with `overrides`, on SWEEP_DATA unless they name a corpus."""
    base = apply_overrides(RunConfig(), overrides)
    if not base.data.paths and not base.data.sources:
        base.data.paths = list(SWEEP_DATA)
    return base


def shape(d_model: int) -> tuple[int, int]:
    """(width, depth) of the ladder: depth = width / 64 (at least 2), Kaplan et al.'s shapes being flat
    in loss over a wide range of aspect ratios."""
    return d_model, max(2, round(d_model / 64))


def ladder_config(base: RunConfig, d_model: int, n_layers: int, train: dict | None = None) -> RunConfig:
    """The base run with the model resized to (d_model, n_layers), head_dim 32, and `train` settings
    (default: the sweep's recipe, a constant LR after warmup)."""
    train = {**SWEEP_TRAIN, "min_lr": base.train.lr} if train is None else train
    sets = [f"model.d_model={d_model}", f"model.n_layers={n_layers}", f"model.n_heads={d_model // 32}",
            f"model.n_kv_heads={d_model // 32}", f"model.name=\"scale-d{d_model}-l{n_layers}\"",
            f"model.max_seq_len={max(train.get('seq_len', base.train.seq_len), base.model.max_seq_len)}"]
    sets += [f"train.{k}={json.dumps(v)}" for k, v in train.items()]
    return apply_overrides(base, sets)


def ladder(base: RunConfig, widths=SWEEP_WIDTHS, train: dict | None = None) -> list[RunConfig]:
    return [ladder_config(base, *shape(d), train) for d in widths]


def flops_per_token(cfg: RunConfig) -> float:
    return flops_per_token_train(cfg.model, cfg.train.seq_len)


def sweep_precision(cfg: RunConfig) -> str:
    """The recipe the sweep's runs train in on this CPU (train.precision, auto resolved): its peak is the
    one their MFU is measured against and their time predicted with."""
    return resolve_precision(cfg.train.precision, resolve_device("cpu"))[0]


def measure_mfu(cfg: RunConfig, peak_flops: float, steps: int = 3) -> float:
    """Model FLOPs per second / peak over `steps` real training steps (after one warm-up step) of this
    model on random tokens: the MFU this machine gives this size right now."""
    device, precision = resolve_device("cpu"), sweep_precision(cfg)
    torch.manual_seed(0)
    step = build_step(build_model(cfg.model), cfg.train, device, precision)
    batches = random_batches(cfg.model.vocab_size, cfg.train.micro_batch, cfg.train.seq_len, 1, device)
    step(batches)
    start = time.perf_counter()
    for _ in range(steps):
        step(batches).loss.item()
    seconds = (time.perf_counter() - start) / steps
    return model_flops_utilization(flops_per_token(cfg) * cfg.train.tokens_per_step / seconds, peak_flops)


@dataclass
class SweepRun:
    config: RunConfig
    mfu: float  # measured before the sweep
    tokens: int = 0
    predicted_s: float = 0.0
    measured_s: float | None = None
    run_dir: Path | None = None


def predict_seconds(cfg: RunConfig, tokens: float, peak_flops: float, mfu: float) -> float:
    """The planner's time for `tokens` training tokens, plus the evaluations (forward only: 1/3 of a
    training step's FLOPs per batch)."""
    run = Run.of(cfg, sweep_precision(cfg))
    plan = plan_run(replace(run, tokens=tokens, machine=Machine(peak_flops=peak_flops)), mfu=mfu)
    eval_tokens = EVALS_PER_RUN * cfg.train.eval_steps * cfg.train.micro_batch * cfg.train.seq_len
    return plan.time.seconds * (1 + eval_tokens / 3 / max(tokens, 1))


def choose_models(base: RunConfig, flops: float) -> list[RunConfig]:
    """SWEEP_MODELS consecutive ladder sizes centred on the one closest to TOKENS_PER_PARAM at `flops`."""
    configs = ladder(base)
    ratio = [abs(math.log(flops / flops_per_token(c) / non_embedding_params(c) / TOKENS_PER_PARAM)) for c in configs]
    centre = min(range(len(configs)), key=ratio.__getitem__)
    lo = max(0, min(centre - SWEEP_MODELS // 2, len(configs) - SWEEP_MODELS))
    return configs[lo:lo + SWEEP_MODELS]


def size_compute(base: RunConfig, budget_s: float, peak_flops: float, say,
                 max_tokens: float = math.inf) -> list[SweepRun]:
    """The largest C (within 2^(1/16)) whose runs fit budget_s and give no model more than max_tokens;
    the chosen models depend on C, and their predicted time on each one's measured MFU."""
    mfus: dict[str, float] = {}

    def runs_for(flops: float) -> list[SweepRun]:
        out = []
        for cfg in choose_models(base, flops):
            if cfg.model.name not in mfus:
                mfus[cfg.model.name] = measure_mfu(cfg, peak_flops)
                say(f"  measured MFU of {cfg.model.name}: {mfus[cfg.model.name]:.1%} of {peak_flops / 1e9:.0f} GFLOP/s")
            run = SweepRun(cfg, mfus[cfg.model.name], tokens=_tokens(cfg, flops))
            run.predicted_s = predict_seconds(cfg, run.tokens, peak_flops, run.mfu)
            out.append(run)
        return out

    def fits(flops: float) -> bool:
        if max(flops / flops_per_token(c) for c in choose_models(base, flops)) > max_tokens:
            return False  # before any MFU probe: the data bound costs nothing to check
        return sum(r.predicted_s for r in runs_for(flops)) <= budget_s

    # Upwards in steps of 2x, then bisect: only the models near the answer (and the cheap smaller ones)
    # are ever probed, never the largest of the ladder.
    lo = 1e10
    while lo < 1e18 and fits(2 * lo):
        lo *= 2
    hi = 2 * lo
    for _ in range(4):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return runs_for(lo)


def _tokens(cfg: RunConfig, flops: float) -> int:
    """D = C / FLOPs per token, rounded to whole optimizer steps (at least 4 evaluations' worth)."""
    per_step = cfg.train.tokens_per_step
    steps = max(4 * EVALS_PER_RUN, round(flops / flops_per_token(cfg) / per_step))
    return steps * per_step


SWEEP_STATE = "sweep.json"  # the sweep's plan and progress, in its directory: the same call continues it


class SweepStopped(TrainwiseError):
    """The sweep stopped between two runs at the caller's stop_at; the same call continues it."""


def run_sweep(minutes: float, out: str | Path, base: RunConfig | None = None, say=print,
              stop_at: float | None = None) -> list[SweepRun]:
    """Train the grid inside `minutes` (sizing included); returns the runs with their directories.

    The plan and every finished run are kept in out/SWEEP_STATE, so a call on a directory that holds
    one continues the sweep where it stopped. The budget counts the time spent sizing and training,
    not the time between calls. stop_at (a time.time()): stop before a run predicted to end after it
    (SweepStopped), at least one run per call; a shared machine's slices."""
    if minutes <= 0:
        raise TrainwiseError(f"--minutes {minutes} must be positive (e.g. 20).")
    out, base = Path(out), base or sweep_base([])
    state_path = out / SWEEP_STATE
    if state_path.is_file():
        state = json.loads(state_path.read_text(encoding="utf-8"))
        say(f"continuing the sweep in {out}: {sum(r['measured_s'] is not None for r in state['runs'])} runs done, "
            f"{state['spent_s'] / 60:.1f} of {state['minutes']:g} minutes spent")
    elif out.exists() and any(out.iterdir()):
        raise TrainwiseError(f"sweep directory '{out}' exists and is not empty; choose a new --out.")
    else:
        state = _plan(minutes, base, say)
    mark = time.perf_counter()  # the time since the state's spent_s was last charged
    runs = [_sweep_run(base, r) for r in state["runs"]]
    trained = 0

    def save():
        nonlocal mark
        state["spent_s"] += time.perf_counter() - mark
        mark = time.perf_counter()
        state["runs"] = [_run_state(r) for r in runs]
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(state_path, state)

    def train_one(run: SweepRun, label: str) -> None:
        nonlocal trained
        if trained and stop_at is not None and time.time() + state["correction"] * run.predicted_s > stop_at:
            save()
            raise SweepStopped(f"the sweep stopped before {label} ({state['spent_s'] / 60:.1f} of "
                               f"{state['minutes']:g} minutes spent); run the same command to continue.")
        run_dir = out / run_name(run.config)
        if run_dir.exists():  # a run cut off in an earlier call: its curve would be fitted as if whole
            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        result = train(run.config, out=run_dir, quiet=True)
        if result.stopped_early:  # SIGINT/SIGTERM: a cut curve would be fitted as if it were whole
            save()
            raise TrainwiseError(f"the sweep was interrupted during {result.run_dir} (step {result.step} of "
                                 f"{run.config.train.max_steps}); run the same command to train it again and "
                                 "continue, or start a new sweep.")
        run.measured_s, run.run_dir = time.perf_counter() - t0, result.run_dir
        trained += 1
        say(f"      measured {run.measured_s:,.0f} s, final val loss {result.val_loss:.4f} nats/token")

    grid = [r for r in runs if r.config.train.seed == base.train.seed]
    first_s = state["minutes"] * 60 / SWEEP_SEEDS  # the grid once; the time after it buys the grid with other seeds
    for i, run in enumerate(grid):
        if run.measured_s is not None:
            continue
        if i:  # resize what is left to the grid's time that is left, with the measured/predicted correction
            left_s = first_s - state["spent_s"] - (time.perf_counter() - mark)
            scale = left_s / (state["correction"] * sum(r.predicted_s for r in grid[i:]))
            scale = min(scale, state["max_c"] / state["grid_c"])  # time saved buys no extra passes: one C
            state["grid_c"] *= scale
            for r in grid[i:]:
                r.tokens = _tokens(r.config, _compute(r) * scale)
                r.predicted_s = predict_seconds(r.config, r.tokens, state["peak_flops"], r.mfu)
                _set_steps(r)
        say(f"[{i + 1}/{len(grid)}] {run.config.model.name}: {run.tokens:,} tokens ({run.config.train.max_steps} "
            f"steps), predicted {state['correction'] * run.predicted_s:,.0f} s")
        train_one(run, run.config.model.name)
        done = grid[:i + 1]
        state["correction"] = sum(r.measured_s for r in done) / sum(r.predicted_s for r in done)
        save()

    # The time after the grid buys the same runs again with other seeds (1, 2, ... up to SWEEP_SEEDS in all),
    # each while its first run's measured time still fits: a prediction is for a run's expected loss, and
    # the fit through every seed's curve describes their mean.
    for seed in range(1, SWEEP_SEEDS):
        for run in grid:
            if state["seeds_done"]:
                break
            again = next((r for r in runs
                          if r.config.train.seed == seed and r.config.model.name == run.config.model.name), None)
            if again is not None and again.measured_s is not None:
                continue
            if run.measured_s > state["minutes"] * 60 - state["spent_s"] - (time.perf_counter() - mark):
                state["seeds_done"] = True
                break
            if again is None:
                cfg = copy.deepcopy(run.config)
                cfg.train.seed = seed
                again = SweepRun(cfg, run.mfu, run.tokens, run.predicted_s)
                runs.append(again)
            say(f"[seed {seed}] {run.config.model.name}: {run.tokens:,} tokens again")
            train_one(again, f"{run.config.model.name} with seed {seed}")
            save()
    state["seeds_done"] = True
    runs = [r for r in runs if r.measured_s is not None]
    save()
    return runs


def run_name(cfg: RunConfig) -> str:
    seed = cfg.train.seed
    return cfg.model.name + (f"-seed{seed}" if seed != RunConfig().train.seed else "")


def _plan(minutes: float, base: RunConfig, say) -> dict:
    """Size the grid for 1/SWEEP_SEEDS of the budget: the sweep's state before any run."""
    start = time.perf_counter()
    unique = train_tokens(ladder_config(base, *shape(SWEEP_WIDTHS[0])),  # the sweep's seq_len
                          prepare_tokenizer(base.data, base.tokenizer.vocab_size))
    cap = REPEAT_EPOCHS * unique
    hw = device_hardware(torch.device("cpu"), sweep_precision(base))
    peak, source = hw.peak_flops, hw.peak_source
    say(f"sizing the sweep for {minutes:g} minutes: peak {peak / 1e9:,.1f} GFLOP/s ({source}); the corpus has "
        f"{unique:,} training tokens, so no run gets more than {REPEAT_EPOCHS} passes: {cap:,} tokens")
    first_s = minutes * 60 / SWEEP_SEEDS
    runs = size_compute(base, first_s - (time.perf_counter() - start), peak, say, cap)
    planned_s = sum(r.predicted_s for r in runs)
    say(f"IsoFLOP grid: {len(runs)} models x C = {_compute(runs[0]):.3g} FLOPs each (exact per-token FLOPs), "
        f"constant LR {base.train.lr:g} after {SWEEP_TRAIN['warmup_steps']} warmup steps; predicted "
        f"{planned_s / 60:.1f} min of training, then the same with other seeds (up to {SWEEP_SEEDS} each)")
    if max(r.tokens for r in runs) > cap / 2 ** (1 / 8) and planned_s < 0.8 * first_s:
        say(f"  bound by the corpus, not the budget: a larger C would give {runs[0].config.model.name} more than "
            f"{REPEAT_EPOCHS} passes over the {unique:,} tokens. More text buys a bigger sweep.")
    for r in runs:
        _set_steps(r)
    return {"minutes": minutes, "peak_flops": peak, "correction": 1.0, "seeds_done": False,
            "grid_c": _compute(runs[0]),  # the grid's C (its smallest model, never raised to the minimum of steps)
            "max_c": cap * flops_per_token(runs[0].config),  # the C at which that model reaches the passes' limit
            "runs": [_run_state(r) for r in runs], "spent_s": time.perf_counter() - start}


def _set_steps(run: SweepRun) -> None:
    cfg = run.config
    cfg.train.max_steps = run.tokens // cfg.train.tokens_per_step
    cfg.train.eval_every = max(1, cfg.train.max_steps // EVALS_PER_RUN)


def _run_state(run: SweepRun) -> dict:
    m = run.config.model
    return {"d_model": m.d_model, "n_layers": m.n_layers, "seed": run.config.train.seed, "mfu": run.mfu,
            "tokens": run.tokens, "predicted_s": run.predicted_s, "measured_s": run.measured_s,
            "run_dir": str(run.run_dir) if run.run_dir else None}


def _sweep_run(base: RunConfig, state: dict) -> SweepRun:
    cfg = ladder_config(base, state["d_model"], state["n_layers"])
    cfg.train.seed = state["seed"]
    run = SweepRun(cfg, state["mfu"], state["tokens"], state["predicted_s"], state["measured_s"],
                   Path(state["run_dir"]) if state["run_dir"] else None)
    _set_steps(run)
    return run


def _compute(run: SweepRun) -> float:
    return run.tokens * flops_per_token(run.config)

