"""The training run: text in, trained model, metrics and checkpoints out.

`train()` is what `trainwise train` calls. It validates everything that can be wrong with the input
(config, data, run directory) before it writes a single file, then runs the loop:

    for each optimizer step:          lr from the schedule
        one step of K micro-batches   (trainwise.runtime.step: forward, backward, clip, update)
        log, evaluate, checkpoint at their intervals
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from trainwise import rundir
from trainwise.config import RunConfig, load_config
from trainwise.cost.run import Run
from trainwise.data import corpus as data_mod
from trainwise.data.batches import BatchSampler
from trainwise.data.bpb import VAL_SEED, bits_per_byte, val_window_bytes
from trainwise.errors import TrainwiseError
from trainwise.export.hf import load_hf_dir, load_into
from trainwise.files import write_atomic, write_json_atomic
from trainwise.inference import load_run, sample_text
from trainwise.measure.memtrack import foreign_storages
from trainwise.report.html import write_report
from trainwise.runtime import checkpoint as ckpt
from trainwise.runtime import distributed
from trainwise.runtime.allocator import keep_freed_memory
from trainwise.runtime.mesh import check_layout, describe, layout_for, pipeline_micro_batches
from trainwise.runtime.optim import lr_at
from trainwise.runtime.parallelize import remove_compile, resolve_compile
from trainwise.runtime.precision import autocast, resolve_device, resolve_precision
from trainwise.runtime.step import NonFiniteGradient, TrainingStep, build_model, build_step
from trainwise.tokenizer import Tokenizer
from trainwise.trainer import relaunch
from trainwise.trainer.loggers import RunLog, require_wandb
from trainwise.trainer.memcheck import check_memory
from trainwise.trainer.observer import StepObserver
from trainwise.trainer.accounting import RunAccount, expert_counts, final_losses, nonfinite_diagnostic, numbered_blocks
from trainwise.verify.per_rank import format_per_rank, per_rank_verify


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float
    val_loss: float
    unigram_loss: float
    sample: str
    stopped_early: bool = False


def train(cfg: RunConfig | None = None, out: str | Path | None = None, resume: bool = False,
          max_steps: int | None = None, init_from: str | None = None, quiet: bool = False) -> TrainResult:
    """Run (or continue) a training run; see the module docstring. Returns the final numbers."""
    keep_freed_memory()  # steps reuse the heap instead of faulting in fresh pages (runtime.allocator)
    out = Path(out) if out else rundir.default_run_dir()
    cfg, resume, note = _resolve_config(cfg, out, resume, max_steps, init_from)
    t = cfg.train
    layout = layout_for(cfg.parallel, distributed.world_size(), t.grad_accum_steps)  # before anything starts
    device = distributed.local_device(resolve_device(t.device))
    precision, why = resolve_precision(t.precision, device)
    compiled, _ = resolve_compile(t.compile, cfg.model, t.max_steps, layout.strategy)
    planned = Run.of(cfg, precision, layout, compiled=compiled)  # the run description, built once
    d = distributed.init(planned, t.device)
    relaunch.check_ranks_agree(out, resume, d)
    quiet = quiet or not d.is_main
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    if note:
        say(note)
    foreign = foreign_storages(device)  # what the process held before this run: not the run's memory
    tokenizer, tokens, init_state = _prepare_inputs(cfg, out, resume, init_from, d, say)
    check_memory(planned, t.memory_check, device, precision, d, say)  # before the model and the run directory
    run, state = _build(cfg, out, resume, init_state, tokens, device, precision, d)
    run.val_bytes = val_window_bytes(tokenizer, tokens.val, cfg)  # None unless the tokenizer is byte-level
    account = RunAccount(cfg, distributed.unwrap(run.step.model), device, precision, run.step.compiled, say,
                           dp=d.layout.dp)
    step, tokens_seen = _restore_or_create(run, state, account, out, resume, tokenizer, say)
    _say_setup(run, tokens, why, say)
    progress = _Progress(step, tokens_seen)
    observer = StepObserver(run.step, d, cfg.train.max_steps, foreign)  # what verify measures, from outside
    with RunLog(out, cfg, enabled=d.is_main) as log, _StopRequest() as stop, contextlib.closing(observer):
        _train_steps(run, progress, account, log, stop, tokens, out, observer, quiet)
    if progress.stopped:
        say(f"stopped at step {progress.step} and saved a checkpoint; continue with: trainwise train --resume "
            f"{out} (or the same command again)")
        distributed.shutdown(d)
        return TrainResult(out, progress.step, progress.last_loss, progress.val_loss, float("nan"), "",
                           stopped_early=True)
    _save(run, out, progress.step, progress.tokens_seen)
    if progress.val_loss != progress.val_loss:  # nan: no evaluation happened yet
        progress.val_loss = _evaluate(run, tokens.val)
    return _finish(run, account, out, tokenizer, tokens, progress, observer, say)


def _resolve_config(cfg: RunConfig | None, out: Path, resume: bool, max_steps: int | None,
                    init_from: str | None) -> tuple[RunConfig, bool, str | None]:
    """(the validated config, resume?, a note on what was adjusted). The same command run again (a requeued
    job) continues its run (train.resume); a resumed run takes DIR's config.toml, where only max_steps may
    change. A pipeline's micro-batches are cut from the step's sequences where too few were asked for
    (runtime.mesh.pipeline_micro_batches), before the config is compared with a stored run's."""
    note = None
    if not resume:
        cfg = cfg or RunConfig()
        if max_steps is not None:
            cfg.train.max_steps = max_steps
        cfg.validate()
        note = pipeline_micro_batches(cfg)
        resume = relaunch.should_resume(out, cfg, init_from)
        max_steps = cfg.train.max_steps if resume else max_steps
    rundir.check_run_dir(out, resume)
    if resume:
        cfg = load_config(out / rundir.CONFIG)
    cfg = cfg or RunConfig()
    if max_steps is not None:
        cfg.train.max_steps = max_steps
    cfg.validate()
    check_layout(cfg)  # tp / pp / vpp against the model and batch, before anything starts
    if cfg.log.wandb:  # a missing package is a message now, before any file is written
        require_wandb()
    return cfg, resume, note


class _StopRequest:
    """SIGTERM/SIGINT set a flag; the loop finishes the current optimizer step, saves, and exits."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class _Run:
    """What the loop works with (built by `_build`), and what it accumulates between log rows."""

    cfg: RunConfig
    d: distributed.Dist
    step: TrainingStep  # the model as it runs (checkpointed, compiled, wrapped for the strategy), optimizer, scaler
    sampler: BatchSampler
    why_compile: str
    loss_sum: torch.Tensor  # micro-batch losses since the last log row, on the device
    skipped: torch.Tensor  # optimizer steps skipped for a non-finite gradient (this session), on the device
    val_bytes: tuple[int, int] | None = None  # (targets, UTF-8 bytes) of the validation batches, for val_bpb


@dataclass
class _Progress:
    """Where the loop stands: steps and tokens done, the last losses, whether it was asked to stop."""

    step: int
    tokens_seen: int
    last_loss: float = float("nan")
    val_loss: float = float("nan")
    stopped: bool = False


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: np.ndarray, cfg: RunConfig, device: torch.device,
             precision: str, forward=None) -> float:
    """Mean loss over eval_steps batches of the validation split: the same batches every time.
    forward: what to call instead of model(x, y), e.g. the eager forward of a compiled model."""
    sampler = BatchSampler(tokens, cfg.train.micro_batch, cfg.train.seq_len, seed=VAL_SEED)
    was_training = model.training
    model.eval()
    forward = forward or model
    total = 0.0
    for _ in range(cfg.train.eval_steps):
        x, y = sampler.next_batch()
        with autocast(device, precision):
            total += forward(x.to(device), y.to(device)).item()
    model.train(was_training)
    return total / cfg.train.eval_steps


def _evaluate(run: _Run, tokens: np.ndarray) -> float:
    """evaluate() of the run's model as it trains, through the eager forward of a compiled one (a second
    compiled graph for no_grad would cost more than it saves)."""
    ts = run.step
    return evaluate(ts.model, tokens, run.cfg, ts.device, ts.precision, ts.loss)


def _prepare_inputs(cfg: RunConfig, out: Path, resume: bool, init_from: str | None, d: distributed.Dist, say):
    """(tokenizer, tokenized data, Hugging Face weights or None). Everything that can fail on user input
    happens here, before the run directory is touched. Rank 0 tokenizes first; the other ranks then
    find its work in the cache."""
    if not d.is_main:
        distributed.barrier(d)
    init_state = None
    if resume:
        tokenizer = Tokenizer.load(out / rundir.TOKENIZER)
        if init_from and rundir.latest_checkpoint(out) is None:  # relaunched before its first checkpoint
            init_state = load_hf_dir(init_from)[1]
    elif init_from:  # a Hugging Face checkpoint: its architecture, weights and tokenizer replace ours
        cfg.model, init_state, tokenizer = load_hf_dir(init_from)
        cfg.tokenizer.vocab_size = tokenizer.vocab_size
        cfg.validate()
    else:
        tokenizer = data_mod.prepare_tokenizer(cfg.data, cfg.tokenizer.vocab_size, say=say)
        cfg.model.vocab_size = tokenizer.vocab_size
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise TrainwiseError(
            f"{rundir.TOKENIZER} in {out} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.model.vocab_size}: the tokenizer does not belong to this run."
        )
    tokens = data_mod.prepare_data(cfg.data, tokenizer, cfg.train.seq_len)
    if d.is_main:
        distributed.barrier(d)
    return tokenizer, tokens, init_state


def _build(cfg: RunConfig, out: Path, resume: bool, init_state: dict | None, tokens, device: torch.device,
           precision: str, d: distributed.Dist) -> tuple[_Run, ckpt.Checkpoint | None]:
    """The model (seeded, loaded from the latest checkpoint on resume, then checkpointed, compiled and
    wrapped from outside by runtime.step's builder), its optimizer, scaler and batch sampler; and the
    checkpoint to resume from."""
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model)
    if init_state is not None:
        load_into(model, init_state)
    state, latest = None, rundir.latest_checkpoint(out) if resume else None
    if latest is not None and ckpt.is_sharded(latest):
        state = ckpt.read_trainer_state(latest)  # weights and optimizer go into the divided model below
    elif latest is not None:
        state = ckpt.load_checkpoint(latest, model)  # full weights on every rank, before sharding
    model.to(device)
    if d.rank:
        torch.manual_seed(cfg.train.seed + d.rank)  # ranks draw different dropout masks
    start_step = state.trainer_state["step"] if state is not None else 0
    if start_step > cfg.train.max_steps:  # before anything in the run directory changes
        raise TrainwiseError(
            f"the run in {out} is at step {start_step}, past train.max_steps = {cfg.train.max_steps}: give "
            f"--max-steps above {start_step} to train it further (`trainwise train --resume {out} --max-steps N`). "
            "Its files are left as they were.")
    compiled, why_compile = resolve_compile(cfg.train.compile, cfg.model, cfg.train.max_steps - start_step,
                                            d.strategy, divided=d.divided)
    if d.layout.cp > 1:  # runtime.mesh.check_layout refuses train.compile = true
        compiled, why_compile = False, "auto: context-parallel steps run eager"
    step = build_step(model, cfg.train, device, precision, dist=d, compile=compiled)
    if state is not None and state.optimizer_state is None:
        ckpt.load_sharded(latest, step.model, step.optimizer)
    # tensor- and pipeline-parallel ranks of one replica read the same batches
    sampler = BatchSampler(tokens.train, cfg.train.micro_batch, cfg.train.seq_len, seed=cfg.train.seed,
                           rank=d.dp_rank, world_size=d.layout.dp)
    run = _Run(cfg, d, step, sampler, why_compile, loss_sum=torch.zeros((), device=device),
               skipped=torch.zeros((), device=device))
    return run, state


def _restore_or_create(run: _Run, state: ckpt.Checkpoint | None, account: RunAccount, out: Path, resume: bool,
                       tokenizer: Tokenizer, say) -> tuple[int, int]:
    """(step, tokens seen) to start from: on resume, what the checkpoint restores (optimizer, sampler,
    scaler, every rank's RNG); otherwise (0, 0), once rank 0 has created the run directory."""
    d, step, tokens_seen = run.d, 0, 0
    if resume:
        if state is not None:
            if state.optimizer_state is not None:  # a divided model's states were loaded with its weights
                distributed.load_full_state(run.step.model, run.step.optimizer, state.optimizer_state, d)
            t = state.trainer_state
            step, tokens_seen = t["step"], t["tokens"]
            run.sampler.load_state_dict(t["sampler"])
            run.step.scaler.load_state_dict(t["scaler"]) if t.get("scaler") else None
            ckpt.restore_rng(state.rng_state, t["rng"], d.rank)
            say(f"resumed {out} from {state.path.name} (step {step}, {tokens_seen:,} tokens)")
        else:
            say(f"{out} holds this run but no checkpoint yet (it stopped before its first save): starting "
                "again from step 0")
        if d.is_main:
            rundir.truncate_metrics(out, step)
            rundir.remove_unfinished(out)
    elif d.is_main:
        rundir.create_run_dir(out, run.cfg, tokenizer, account.start_plan)
    distributed.barrier(d)
    return step, tokens_seen


def _say_setup(run: _Run, tokens, why_precision: str, say) -> None:
    """The run's settings as it starts: precision, compile, device, data and the effective batch."""
    cfg, d, step = run.cfg, run.d, run.step
    tokens_per_step = cfg.train.tokens_per_step * d.layout.dp
    say(f"precision: {step.precision} ({why_precision}); compile: {'on' if step.compiled else 'off'} "
        f"({run.why_compile}" + ("; the first step compiles, tens of seconds" if step.compiled else "")
        + f"); device: {step.device}" + (f"; {d.strategy} over {d.world_size} ranks" if d.active and d.mesh is None
                                         and d.layout.cp == 1
                                         else f"; {d.world_size} ranks: {describe(d.layout)}, data parallel "
                                              f"{d.strategy}" if d.active else ""))
    say(f"data: {len(tokens.train):,} train / {len(tokens.val):,} val tokens; "
        f"B_eff = micro_batch {cfg.train.micro_batch} x grad_accum {cfg.train.grad_accum_steps}"
        + (f" x data parallel {d.layout.dp}" if d.active else "")
        + f" = {tokens_per_step // cfg.train.seq_len} sequences of {cfg.train.seq_len} tokens "
        f"= {tokens_per_step:,} tokens per step")
    for line in data_mod.summary_lines(tokens):
        say(line)


def _train_steps(run: _Run, progress: _Progress, account: RunAccount, log: RunLog, stop: _StopRequest, tokens,
                 out: Path, observer: StepObserver, quiet: bool) -> None:
    """Optimizer steps until max_steps (or a stop request): logging, evaluating and checkpointing at
    their intervals; each step runs inside the observer (trainer.observer: what verify measures)."""
    t, d, device = run.cfg.train, run.d, run.step.device
    tokens_per_step = t.tokens_per_step * d.layout.dp
    bar = tqdm(total=t.max_steps, initial=progress.step, disable=quiet, unit="step", dynamic_ncols=True,
               file=sys.stderr)
    best = rundir.best_checkpoint(out)
    best_val = best["val_loss"] if best else float("inf")
    interval_start, interval_steps = time.perf_counter(), 0
    while progress.step < t.max_steps:
        with observer.step(progress.step):
            lr, grad_norm = _optimizer_step(run, progress.step, observer)
        interval_start += observer.own_seconds()  # step_time_s is the step's, not the peak meter's
        progress.step += 1
        progress.tokens_seen += tokens_per_step
        interval_steps += 1
        bar.update(1)
        step = progress.step
        stop_now = distributed.any_rank(stop.requested, d)  # every rank stops at the same step
        do_eval = t.eval_every and (step % t.eval_every == 0 or step == t.max_steps)
        if step % t.log_every == 0 or do_eval or step == t.max_steps or stop_now:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row = _log_row(run, account, step, progress.tokens_seen, lr, grad_norm, interval_steps,
                           time.perf_counter() - interval_start, tokens_per_step)
            if metered := observer.metered_steps():
                row["metered_steps"] = metered
            progress.last_loss = row["loss"]
            if do_eval:
                progress.val_loss = row["val_loss"] = _evaluate(run, tokens.val)
                if run.val_bytes:  # end-of-text targets count 0 bytes (trainwise.data.bpb)
                    row["val_bpb"] = bits_per_byte(progress.val_loss * run.val_bytes[0], run.val_bytes[1])
            log.log(row)
            bar.set_postfix_str(account.postfix(row))
            interval_start, interval_steps = time.perf_counter(), 0
        new_best = do_eval and t.keep_best and progress.val_loss < best_val
        if (t.checkpoint_every and step % t.checkpoint_every == 0) or stop_now or new_best:
            saving = time.perf_counter()
            _save(run, out, step, progress.tokens_seen)
            interval_start += time.perf_counter() - saving  # step_time_s is the steps', not the saves'
        if new_best:
            best_val = progress.val_loss
            if d.is_main:
                rundir.mark_best(out, step, progress.val_loss)
        if stop_now:
            progress.stopped = True
            break
    bar.close()


def _optimizer_step(run: _Run, step: int, observer: StepObserver) -> tuple[float, torch.Tensor]:
    """One optimizer step (0-based `step`) over grad_accum_steps micro-batches; returns (lr, gradient
    norm). A NaN/inf must never reach the weights: the default (skip) decides on the device, with no
    host sync; "stop" waits for the verdict every step so that it can name the step. (With fp16 the
    GradScaler skips such steps on its own and lowers the scale.)"""
    cfg, ts = run.cfg.train, run.step
    lr = lr_at(step, cfg)
    for group in ts.optimizer.param_groups:
        group["lr"] = lr
    batches = [tuple(t.to(ts.device, non_blocking=True) for t in run.sampler.next_batch())
               for _ in range(cfg.grad_accum_steps)]

    def after_update(phase: str) -> None:  # each forward's routing; the gradients, before they are freed
        if phase == "forward":
            observer.forward(step)
        if phase == "step":
            observer.gradients(step, (p.grad for p in ts.params))

    try:
        result = ts(batches, after_update, loss_sum=run.loss_sum)
    except NonFiniteGradient as err:
        raise TrainwiseError(nonfinite_diagnostic(ts.model, step + 1, err.loss)) from None
    if result.skipped is not None:
        run.skipped += result.skipped
    return lr, result.grad_norm


def _log_row(run: _Run, account: RunAccount, step: int, tokens_seen: int, lr: float, grad_norm: torch.Tensor,
             interval_steps: int, elapsed_s: float, tokens_per_step: int) -> dict:
    """The metrics row of the steps since the last one: the loss averaged over ranks, throughput, MFU,
    skipped steps and MoE routing counts."""
    loss_sum = distributed.mean_across_ranks(run.loss_sum, run.d)
    loss = loss_sum.item() / (interval_steps * run.cfg.train.grad_accum_steps)
    row = account.metrics_row(step, tokens_seen, loss, lr, grad_norm.item(), elapsed_s / interval_steps,
                               tokens_per_step)
    if (source_tokens := run.sampler.source_counts()) is not None:
        row["source_tokens"] = source_tokens  # a mixture: tokens drawn from each source so far
    if skipped_steps := int(run.skipped.item()):
        row["skipped_steps"] = skipped_steps
    model = distributed.unwrap(run.step.model)
    experts = expert_counts(model)
    dropped = {i: b.mlp.last_dropped for i, b in numbered_blocks(model) if i in experts}
    if run.d.layout.pp > 1:  # each pipeline rank routes its own layers: the row holds them all
        experts = {i: c for part in distributed.gather_objects(experts, run.d) for i, c in part.items()}
        dropped = {i: c for part in distributed.gather_objects(dropped, run.d) for i, c in part.items()}
    if experts:
        row["expert_tokens"] = dict(sorted(experts.items(), key=lambda kv: int(kv[0])))
        if not run.cfg.model.dropless:  # token-expert assignments over capacity, last forward
            row["expert_dropped"] = dropped
    run.loss_sum.zero_()
    return row


def _save(run: _Run, out: Path, step: int, tokens_seen: int) -> None:
    """A checkpoint of this step (a collective: every rank calls it): gathered to rank 0 in the
    single-process format, or, for a divided model (tp, pp or ep > 1), each rank's shards with DCP."""
    d, ts = run.d, run.step
    sharded = d.divided
    model_state, optimizer_state = (None, None) if sharded else distributed.full_state(ts.model, ts.optimizer)
    rng_tensors, rng_plain = zip(*distributed.gather_objects(ckpt.capture_rng(), d))
    trainer_state = rng_state = None
    if d.is_main:
        trainer_state = {"step": step, "tokens": tokens_seen, "sampler": run.sampler.state_dict(),
                         "scaler": ts.scaler.state_dict() if ts.scaler.is_enabled() else None,
                         "rng": list(rng_plain), "world_size": d.world_size}
        rng_state = {"ranks": list(rng_tensors)}
    if sharded:
        ckpt.save_sharded(out, step, ts.model, ts.optimizer, trainer_state, rng_state, run.cfg.train.keep_checkpoints,
                          lambda: distributed.barrier(d))
        return
    if d.is_main:
        ckpt.save_checkpoint(out, step, model_state, optimizer_state, trainer_state, rng_state,
                             run.cfg.train.keep_checkpoints)
    distributed.barrier(d)


def _finish(run: _Run, account: RunAccount, out: Path, tokenizer: Tokenizer, tokens, progress: _Progress,
            observer: StepObserver, say) -> TrainResult:
    """After the last step: the per-rank memory check (distributed), the final losses and a sample,
    verify.json (one measured step against the plan) and the HTML report, on rank 0."""
    cfg, d, device, model = run.cfg, run.d, run.step.device, run.step.model
    per_rank = None
    if d.active:  # the rest is rank 0's, on the gathered weights of the checkpoint just saved
        measured = distributed.gather_objects(observer.rank_measurements(), d)
        per_rank = per_rank_verify(cfg, measured, d, run.step.precision)
        distributed.shutdown(d)
        if not d.is_main:
            return TrainResult(out, progress.step, progress.last_loss, progress.val_loss, float("nan"), "")
        model = load_run(out, device=str(device)).model
    if run.step.compiled:
        remove_compile(distributed.unwrap(model))
    unigram = data_mod.unigram_loss(tokens)
    sample = sample_text(model, tokenizer, device, cfg.train.sample_tokens, seed=cfg.train.seed)
    say(final_losses(progress.last_loss, progress.val_loss, unigram, run.val_bytes))
    say("sample (temperature 0.8, top-k 50):\n" + "-" * 60 + f"\n{sample}\n" + "-" * 60)
    # Distributed: verify measures one step of the gathered model with a fresh optimizer, in one process;
    # the per-rank shards were measured above and are checked against the ZeRO plan.
    account.write_verify_json(out, progress.tokens_seen, progress.step, model=model,
                    optimizer_state=None if d.active else run.step.optimizer.state_dict(),
                    step_peak_bytes=None if d.active else observer.peak_bytes)
    if per_rank is not None and (out / rundir.VERIFY).is_file():
        result = json.loads((out / rundir.VERIFY).read_text(encoding="utf-8"))
        result["per_rank"] = per_rank
        write_json_atomic(out / rundir.VERIFY, result)
        say(format_per_rank(per_rank))
    if d.is_main:
        write_atomic(out / rundir.SAMPLE, sample)
        say(f"report: {write_report(out)}")
    say(f"run saved in {out}")
    return TrainResult(out, progress.step, progress.last_loss, progress.val_loss, unigram, sample)
