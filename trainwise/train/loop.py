"""The training run: text in, trained model, metrics and checkpoints out.

`train()` is what `trainwise train` calls. It validates everything that can be wrong with the input
(config, data, run directory) before it writes a single file, then runs the loop:

    for each optimizer step:          lr from the schedule
        for each of K micro-batches:  loss = model(x, y) under autocast;  (loss / K).backward()
        clip the gradient norm;  optimizer.step();  zero the gradients
        log, evaluate, checkpoint at their intervals
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from trainwise import data as data_mod
from trainwise.config import RunConfig, load_config, save_config
from trainwise.errors import TrainwiseError
from trainwise.evaluate import bits_per_byte, val_window_bytes
from trainwise.model import Transformer
from trainwise.tokenizer import Tokenizer
from trainwise.train.allocator import keep_freed_memory
from trainwise.train import checkpoint as ckpt
from trainwise.train.checkpoint import capture_rng, restore_rng
from trainwise.train import distributed, relaunch
from trainwise.train.optim import build_optimizer, lr_at, step_if_finite
from trainwise.train.parallelize import (apply_activation_checkpointing, apply_compile, remove_compile,
                                        resolve_compile)
from trainwise.train.precision import autocast, resolve_device, resolve_precision


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float
    val_loss: float
    unigram_loss: float
    sample: str
    stopped_early: bool = False


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")


def check_run_dir(out: Path, resume: bool) -> None:
    if resume:
        if not (out / "config.toml").is_file():
            raise TrainwiseError(
                f"cannot resume '{out}': it has no config.toml, so it is not a trainwise run directory. "
                "Pass the directory a previous `trainwise train --out DIR` wrote."
            )
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TrainwiseError(
            f"run directory '{out}' already exists and is not empty; nothing was written to it. Continue "
            f"it with `trainwise train --resume {out}` or choose a new --out."
        )


def create_run_dir(out: Path, cfg: RunConfig, tokenizer: Tokenizer, reporter) -> None:
    """Write config.toml, tokenizer.json and plan.json into a hidden directory, then rename it to `out`:
    a run directory either has all three or does not exist."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_config(cfg, tmp / "config.toml")
    tokenizer.save(tmp / "tokenizer.json")
    reporter.write_plan(tmp / "plan.json")
    if out.is_dir():  # an existing empty directory (check_run_dir refused a non-empty one)
        out.rmdir()
    os.rename(tmp, out)


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


def nonfinite_diagnostic(model: torch.nn.Module, step: int, loss: torch.Tensor) -> str:
    """Name the step and the first tensor that went non-finite, for train.on_nonfinite = "stop"."""
    where = "the loss" if not torch.isfinite(loss).all() else None
    if where is None:
        for name, p in model.named_parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                where = f"the gradient of {name}"
                break
    return (f"non-finite values at step {step}: {where or 'the gradient norm'} is NaN or inf. The weights "
            "were not updated and no checkpoint was written with them. Lower train.lr, keep train.grad_clip "
            "on, or use train.precision=fp32; set train.on_nonfinite=skip to skip such steps instead.")


def expert_counts(model: torch.nn.Module) -> dict[str, list[int]]:
    """Tokens each MoE layer routed to each expert in the last forward, by layer index."""
    return {str(i): block.mlp.last_expert_counts.tolist() for i, block in enumerate(model.blocks)
            if getattr(block.mlp, "last_expert_counts", None) is not None}


def truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the checkpoint we resume from (a killed run may have logged past it)."""
    if not path.is_file():
        return
    rows = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for row in rows:
        try:
            if json.loads(row)["step"] <= step:
                kept.append(row)
        except (ValueError, KeyError):
            break  # a torn last line
    if len(kept) != len(rows):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(path)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: np.ndarray, cfg: RunConfig, device: torch.device,
             precision: str, forward=None) -> float:
    """Mean loss over eval_steps batches of the validation split: the same batches every time.
    forward: what to call instead of model(x, y), e.g. the eager forward of a compiled model."""
    sampler = data_mod.BatchSampler(tokens, cfg.train.micro_batch, cfg.train.seq_len, seed=cfg.train.seed + 1)
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


@dataclass
class _Run:
    """What the loop works with (built by `_build`), and what it accumulates between log rows."""

    cfg: RunConfig
    d: distributed.Dist
    device: torch.device
    precision: str
    model: torch.nn.Module  # wrapped for the strategy (DDP / FSDP2), maybe compiled
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: data_mod.BatchSampler
    params: list
    compiled: bool
    why_compile: str
    eval_forward: object  # the eager forward of a whole-model compile (evaluation calls it), else None
    gathered: dict  # zero2's gathered parameter bytes, measured by forward (distributed.gathered_params_meter)
    loss_sum: torch.Tensor  # micro-batch losses since the last log row, on the device
    skipped: torch.Tensor  # optimizer steps skipped for a non-finite gradient (this session), on the device
    last_grad_bytes: int = 0  # this rank's gradient bytes at the last step, for the per-rank memory check
    val_bytes: tuple[int, int] | None = None  # (targets, UTF-8 bytes) of the validation batches, for val_bpb
    peak_meter: object = None  # measure.memtrack.StepPeakMeter while the measured (last) step runs
    step_peak_bytes: int | None = None  # peak allocated bytes of the last step, as it really ran (verify.json)


def _prepare_inputs(cfg: RunConfig, out: Path, resume: bool, init_from: str | None, d: distributed.Dist, say):
    """(tokenizer, tokenized data, Hugging Face weights or None). Everything that can fail on user input
    happens here, before the run directory is touched. Rank 0 tokenizes first; the other ranks then
    find its work in the cache."""
    if not d.is_main:
        distributed.barrier(d)
    init_state = None
    if resume:
        tokenizer = Tokenizer.load(out / "tokenizer.json")
        if init_from and ckpt.latest_checkpoint(out) is None:  # relaunched before its first checkpoint
            from trainwise.export.hf import load_hf_dir

            init_state = load_hf_dir(init_from)[1]
    elif init_from:  # a Hugging Face checkpoint: its architecture, weights and tokenizer replace ours
        from trainwise.export.hf import load_hf_dir

        cfg.model, init_state, tokenizer = load_hf_dir(init_from)
        cfg.tokenizer.vocab_size = tokenizer.vocab_size
        cfg.validate()
    else:
        tokenizer = data_mod.prepare_tokenizer(cfg.data, cfg.tokenizer.vocab_size, say=say)
        cfg.model.vocab_size = tokenizer.vocab_size
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise TrainwiseError(
            f"tokenizer.json in {out} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.model.vocab_size}: the tokenizer does not belong to this run."
        )
    tokens = data_mod.prepare_data(cfg.data, tokenizer, cfg.train.seq_len)
    if d.is_main:
        distributed.barrier(d)
    return tokenizer, tokens, init_state


def _build(cfg: RunConfig, out: Path, resume: bool, init_state: dict | None, tokens, device: torch.device,
           precision: str, d: distributed.Dist) -> tuple[_Run, ckpt.Checkpoint | None]:
    """The model (seeded, loaded from the latest checkpoint on resume, then checkpointed, compiled and
    wrapped from outside), its optimizer, scaler and batch sampler; and the checkpoint to resume from."""
    seed_everything(cfg.train.seed)
    model = Transformer(cfg.model)
    if init_state is not None:
        from trainwise.export.hf import load_into

        load_into(model, init_state)
    state = None
    if resume and (latest := ckpt.latest_checkpoint(out)) is not None:
        state = ckpt.load_checkpoint(latest, model)  # full weights on every rank, before sharding
    model.to(device)
    if d.rank:
        torch.manual_seed(cfg.train.seed + d.rank)  # ranks draw different dropout masks
    if cfg.train.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    start_step = state.trainer_state["step"] if state is not None else 0
    compiled, why_compile = resolve_compile(cfg.train.compile, cfg.model, cfg.train.max_steps - start_step,
                                            d.strategy)
    if compiled:
        apply_compile(model, per_block=d.fsdp)
    # A whole-model compile traced the training graph; under no_grad it would compile a second one
    # (~12 s cold on this 2-core CPU) to save ~1 s per evaluation, so evaluation calls the eager forward.
    eval_forward = model.forward if compiled and not d.fsdp else None
    model = distributed.wrap(model, d, device, precision)
    model.train()
    run = _Run(
        cfg, d, device, precision, model,
        optimizer=build_optimizer(model, cfg.train, shard_states=d.active and d.strategy == "zero1"),
        scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
        sampler=data_mod.BatchSampler(tokens.train, cfg.train.micro_batch, cfg.train.seq_len, seed=cfg.train.seed,
                                      rank=d.rank, world_size=d.world_size),
        params=[p for p in model.parameters() if p.requires_grad],
        compiled=compiled, why_compile=why_compile, eval_forward=eval_forward,
        gathered=distributed.gathered_params_meter(model, d),
        loss_sum=torch.zeros((), device=device), skipped=torch.zeros((), device=device),
    )
    return run, state


def _optimizer_step(run: _Run, step: int) -> tuple[float, torch.Tensor]:
    """One optimizer step (0-based `step`) over grad_accum_steps micro-batches; returns (lr, gradient
    norm). A NaN/inf must never reach the weights: the default (skip) decides on the device, with no
    host sync; "stop" waits for the verdict every step so that it can name the step. (With fp16 the
    GradScaler skips such steps on its own and lowers the scale.)"""
    cfg, model, optimizer, scaler = run.cfg.train, run.model, run.optimizer, run.scaler
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    for micro in range(cfg.grad_accum_steps):
        x, y = run.sampler.next_batch()
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        with distributed.gradient_sync(model, run.d, micro == cfg.grad_accum_steps - 1):
            with autocast(run.device, run.precision):
                loss = model(x, y)
            scaler.scale(loss / cfg.grad_accum_steps).backward()
        run.loss_sum += loss.detach()
    scaler.unscale_(optimizer)
    grad_norm = distributed.local_value(torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip or float("inf")))
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    elif cfg.on_nonfinite == "stop" and not bool(torch.isfinite(grad_norm)):
        raise TrainwiseError(nonfinite_diagnostic(model, step + 1, loss))
    else:
        run.skipped += step_if_finite(optimizer, grad_norm)
    if run.d.active and step + 1 == cfg.max_steps:  # for the per-rank memory check
        run.last_grad_bytes = distributed.local_bytes(p.grad for p in run.params)
    if run.peak_meter is not None:  # DDP's buckets: resident all along, reachable only through the grads
        run.peak_meter.resident(p.grad for p in run.params)
    optimizer.zero_grad(set_to_none=True)
    return lr, grad_norm


def _log_row(run: _Run, reporter, step: int, tokens_seen: int, lr: float, grad_norm: torch.Tensor,
             interval_steps: int, elapsed_s: float, tokens_per_step: int) -> dict:
    """The metrics row of the steps since the last one: the loss averaged over ranks, throughput, MFU,
    skipped steps and MoE routing counts."""
    loss_sum = distributed.mean_across_ranks(run.loss_sum, run.d)
    loss = loss_sum.item() / (interval_steps * run.cfg.train.grad_accum_steps)
    row = reporter.metrics_row(step, tokens_seen, loss, lr, grad_norm.item(), elapsed_s / interval_steps,
                               tokens_per_step)
    if (source_tokens := run.sampler.source_counts()) is not None:
        row["source_tokens"] = source_tokens  # a mixture: tokens drawn from each source so far
    if skipped_steps := int(run.skipped.item()):
        row["skipped_steps"] = skipped_steps
    model = distributed.unwrap(run.model)
    if experts := expert_counts(model):
        row["expert_tokens"] = experts
        if not run.cfg.model.dropless:  # token-expert assignments over capacity, last forward
            row["expert_dropped"] = {i: b.mlp.last_dropped for i, b in enumerate(model.blocks) if str(i) in experts}
    run.loss_sum.zero_()
    return row


def _restore_or_create(run: _Run, state: ckpt.Checkpoint | None, reporter, out: Path, resume: bool,
                       tokenizer: Tokenizer, say) -> tuple[int, int]:
    """(step, tokens seen) to start from: on resume, what the checkpoint restores (optimizer, sampler,
    scaler, every rank's RNG); otherwise (0, 0), once rank 0 has created the run directory."""
    d, step, tokens_seen = run.d, 0, 0
    if resume:
        if state is not None:
            distributed.load_full_state(run.model, run.optimizer, state.optimizer_state, d)
            t = state.trainer_state
            step, tokens_seen = t["step"], t["tokens"]
            run.sampler.load_state_dict(t["sampler"])
            run.scaler.load_state_dict(t["scaler"]) if t.get("scaler") else None
            restore_rng(state.rng_state, t["rng"], d.rank)
            say(f"resumed {out} from {state.path.name} (step {step}, {tokens_seen:,} tokens)")
        else:
            say(f"{out} holds this run but no checkpoint yet (it stopped before its first save): starting "
                "again from step 0")
        if d.is_main:
            truncate_metrics(out / "metrics.jsonl", step)
            ckpt.remove_unfinished(out)
    elif d.is_main:
        create_run_dir(out, run.cfg, tokenizer, reporter)
    distributed.barrier(d)
    return step, tokens_seen


def _save(run: _Run, out: Path, step: int, tokens_seen: int) -> None:
    """A checkpoint of this step, gathered to rank 0 (a collective: every rank calls it)."""
    d = run.d
    model_state, optimizer_state = distributed.full_state(run.model, run.optimizer)
    rng_tensors, rng_plain = zip(*distributed.gather_objects(capture_rng(), d))
    if d.is_main:
        trainer_state = {"step": step, "tokens": tokens_seen, "sampler": run.sampler.state_dict(),
                         "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
                         "rng": list(rng_plain), "world_size": d.world_size}
        ckpt.save_checkpoint(out, step, model_state, optimizer_state, trainer_state,
                             {"ranks": list(rng_tensors)}, run.cfg.train.keep_checkpoints)
    distributed.barrier(d)


def train(cfg: RunConfig | None = None, out: str | Path | None = None, resume: bool = False,
          max_steps: int | None = None, init_from: str | None = None, quiet: bool = False) -> TrainResult:
    """Run (or continue) a training run; see the module docstring. Returns the final numbers."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    keep_freed_memory()  # steps reuse the heap instead of faulting in fresh pages (train.allocator)
    out = Path(out) if out else default_run_dir()
    if not resume:  # the same command run again (a requeued job) continues its run: train.resume
        cfg = cfg or RunConfig()
        if max_steps is not None:
            cfg.train.max_steps = max_steps
        cfg.validate()
        resume = relaunch.should_resume(out, cfg, init_from)
        max_steps = cfg.train.max_steps if resume else max_steps
    check_run_dir(out, resume)
    if resume:
        cfg = load_config(out / "config.toml")
    cfg = cfg or RunConfig()
    if max_steps is not None:
        cfg.train.max_steps = max_steps
    cfg.validate()
    if cfg.log.wandb:  # a missing package is a message now, before any file is written
        from trainwise.report.wandb_log import require_wandb

        require_wandb()
    d = distributed.init(cfg.parallel.strategy, cfg.train.device)
    relaunch.check_ranks_agree(out, resume, d)
    if not d.is_main:
        say = lambda *a: None  # noqa: E731
        quiet = True
    device = distributed.device_for(d, resolve_device(cfg.train.device))
    precision, why = resolve_precision(cfg.train.precision, device)
    from trainwise.measure.memtrack import StepPeakMeter, foreign_storages

    foreign = foreign_storages(device)  # what the process held before this run: not the run's memory
    tokenizer, tokens, init_state = _prepare_inputs(cfg, out, resume, init_from, d, say)
    from trainwise.train.memcheck import check_memory  # noqa: E402  (pulls in the planner)

    check_memory(cfg, device, precision, d, say)  # before the model exists and the run directory is made
    run, state = _build(cfg, out, resume, init_state, tokens, device, precision, d)
    run.val_bytes = val_window_bytes(tokenizer, tokens.val, cfg)  # None unless the tokenizer is byte-level
    from trainwise.train.report import RunReporter  # noqa: E402  (kept late: pulls in the planner)

    reporter = RunReporter(cfg, distributed.unwrap(run.model), device, precision, say)

    step, tokens_seen = _restore_or_create(run, state, reporter, out, resume, tokenizer, say)

    tokens_per_step = cfg.train.tokens_per_step * d.world_size
    say(f"precision: {precision} ({why}); compile: {'on' if run.compiled else 'off'} ({run.why_compile}"
        + ("; the first step compiles, tens of seconds" if run.compiled else "") + f"); device: {device}"
        + (f"; {d.strategy} over {d.world_size} ranks" if d.active else ""))
    say(f"data: {len(tokens.train):,} train / {len(tokens.val):,} val tokens; "
        f"B_eff = micro_batch {cfg.train.micro_batch} x grad_accum {cfg.train.grad_accum_steps}"
        + (f" x world_size {d.world_size}" if d.active else "")
        + f" = {tokens_per_step // cfg.train.seq_len} sequences of {cfg.train.seq_len} tokens "
        f"= {tokens_per_step:,} tokens per step")
    for line in data_mod.summary_lines(tokens):
        say(line)

    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8") if d.is_main else None
    tensorboard = None
    if cfg.log.tensorboard and d.is_main:
        from trainwise.report.tensorboard import TensorBoardLogger

        tensorboard = TensorBoardLogger(out)  # fed the same rows as metrics.jsonl
    wandb = None
    if cfg.log.wandb and d.is_main:
        from trainwise.report.wandb_log import WandbLogger

        wandb = WandbLogger(out, cfg)  # fed the same rows as metrics.jsonl
    bar = tqdm(total=cfg.train.max_steps, initial=step, disable=quiet, unit="step", dynamic_ncols=True,
               file=sys.stderr)
    last_loss, val_loss, stopped = float("nan"), float("nan"), False
    best = ckpt.best_checkpoint(out)
    best_val = best["val_loss"] if best else float("inf")
    interval_start, interval_steps = time.perf_counter(), 0
    with _StopRequest() as stop:
        while step < cfg.train.max_steps:
            if step + 1 == cfg.train.max_steps:  # verify.json's peak: the last step, as it really runs
                run.peak_meter = StepPeakMeter(device, foreign)
                run.peak_meter.start()
            lr, grad_norm = _optimizer_step(run, step)
            if run.peak_meter is not None:
                run.step_peak_bytes, run.peak_meter = run.peak_meter.stop(), None
            step += 1
            tokens_seen += tokens_per_step
            interval_steps += 1
            bar.update(1)
            stop_now = distributed.any_rank(stop.requested, d)  # every rank stops at the same step

            do_eval = cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.max_steps)
            if step % cfg.train.log_every == 0 or do_eval or step == cfg.train.max_steps or stop_now:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                row = _log_row(run, reporter, step, tokens_seen, lr, grad_norm, interval_steps,
                               time.perf_counter() - interval_start, tokens_per_step)
                last_loss = row["loss"]
                if do_eval:
                    val_loss = evaluate(run.model, tokens.val, cfg, device, precision, run.eval_forward)
                    row["val_loss"] = val_loss
                    if run.val_bytes:  # end-of-text targets count 0 bytes (trainwise.evaluate)
                        row["val_bpb"] = bits_per_byte(val_loss * run.val_bytes[0], run.val_bytes[1])
                if metrics is not None:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                if tensorboard is not None:
                    tensorboard.log(row)
                if wandb is not None:
                    wandb.log(row)
                bar.set_postfix_str(reporter.postfix(row))
                interval_start, interval_steps = time.perf_counter(), 0
            new_best = do_eval and cfg.train.keep_best and val_loss < best_val
            if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or stop_now or new_best:
                saving = time.perf_counter()
                _save(run, out, step, tokens_seen)
                interval_start += time.perf_counter() - saving  # step_time_s is the steps', not the saves'
            if new_best:
                best_val = val_loss
                if d.is_main:
                    ckpt.mark_best(out, step, val_loss)
            if stop_now:
                stopped = True
                break
    bar.close()
    if metrics is not None:
        metrics.close()
    if tensorboard is not None:
        tensorboard.close()
    if wandb is not None:
        wandb.close()
    if stopped:
        say(f"stopped at step {step} and saved a checkpoint; continue with: trainwise train --resume {out} "
            "(or the same command again)")
        distributed.shutdown(d)
        return TrainResult(out, step, last_loss, val_loss, float("nan"), "", stopped_early=True)
    _save(run, out, step, tokens_seen)
    if not val_loss == val_loss:  # nan: no evaluation happened yet
        val_loss = evaluate(run.model, tokens.val, cfg, device, precision, run.eval_forward)
    return _finish(run, reporter, out, tokenizer, tokens, step, tokens_seen, last_loss, val_loss, say)


def _finish(run: _Run, reporter, out: Path, tokenizer: Tokenizer, tokens, step: int, tokens_seen: int,
            last_loss: float, val_loss: float, say) -> TrainResult:
    """After the last step: the per-rank memory check (distributed), the final losses and a sample,
    verify.json (one measured step against the plan) and the HTML report, on rank 0."""
    cfg, d, device, model = run.cfg, run.d, run.device, run.model
    per_rank = None
    if d.active:  # the rest is rank 0's, on the gathered weights of the checkpoint just saved
        measured = distributed.rank_state_bytes(run.params, run.optimizer, run.last_grad_bytes, run.gathered["bytes"])
        measured["peak_memory_bytes"] = run.step_peak_bytes
        per_rank = distributed.per_rank_verify(cfg, distributed.gather_objects(measured, d), d)
        distributed.shutdown(d)
        if not d.is_main:
            return TrainResult(out, step, last_loss, val_loss, float("nan"), "")
        from trainwise.api import load

        model = load(out, device=str(device)).model
    if run.compiled:
        remove_compile(distributed.unwrap(model))
    unigram = data_mod.unigram_loss(tokens)
    sample = sample_text(model, tokenizer, device, cfg.train.sample_tokens, seed=cfg.train.seed)
    bpb = ""
    if run.val_bytes:
        bpb = f", {bits_per_byte(val_loss * run.val_bytes[0], run.val_bytes[1]):.4f} bits/byte"
    say(f"\nfinal: train loss {last_loss:.4f}, val loss {val_loss:.4f} nats/token{bpb} "
        f"(unigram baseline {unigram:.4f}; {unigram - val_loss:+.3f} better)")
    say("sample (temperature 0.8, top-k 50):\n" + "-" * 60 + f"\n{sample}\n" + "-" * 60)
    # Distributed: verify measures one step of the gathered model with a fresh optimizer, in one process;
    # the per-rank shards were measured above and are checked against the ZeRO plan.
    reporter.finish(out, tokens_seen, step, model=model,
                    optimizer=build_optimizer(model, cfg.train) if d.active else run.optimizer,
                    step_peak_bytes=None if d.active else run.step_peak_bytes)
    if per_rank is not None and (out / "verify.json").is_file():
        result = json.loads((out / "verify.json").read_text(encoding="utf-8"))
        result["per_rank"] = per_rank
        (out / "verify.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        say(distributed.format_per_rank(per_rank))
    if d.is_main:
        (out / "sample.txt").write_text(sample, encoding="utf-8")
        from trainwise.report.html import write_report

        say(f"report: {write_report(out)}")
    say(f"run saved in {out}")
    return TrainResult(out, step, last_loss, val_loss, unigram, sample)


def sample_text(model: torch.nn.Module, tokenizer: Tokenizer, device: torch.device, n_tokens: int,
                seed: int, prompt: str = "", temperature: float = 0.8, top_k: int = 50,
                top_p: float = 1.0) -> str:
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    out = model.generate(idx, n_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    new = out[0, len(ids):].tolist() if not prompt else out[0].tolist()
    return tokenizer.decode(new)
