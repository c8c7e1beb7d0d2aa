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
from trainwise.model import Transformer
from trainwise.tokenizer import Tokenizer
from trainwise.train import checkpoint as ckpt
from trainwise.train import distributed
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


def capture_rng() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for trainer.json)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, plain


def restore_rng(tensors: dict, plain: dict | list, rank: int = 0) -> None:
    """Restore this rank's generators (checkpoints hold one entry per rank)."""
    if "ranks" in tensors:
        if rank >= len(tensors["ranks"]):
            raise TrainwiseError(
                f"the checkpoint was saved by {len(tensors['ranks'])} ranks; resume it with the same number "
                "of processes (torchrun --nproc-per-node)."
            )
        tensors, plain = tensors["ranks"][rank], plain[rank]
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["torch_cuda"]))
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


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


def train(cfg: RunConfig | None = None, out: str | Path | None = None, resume: bool = False,
          max_steps: int | None = None, init_from: str | None = None, quiet: bool = False) -> TrainResult:
    """Run (or continue) a training run; see the module docstring. Returns the final numbers."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    out = Path(out) if out else default_run_dir()
    check_run_dir(out, resume)
    if resume:
        cfg = load_config(out / "config.toml")
    cfg = cfg or RunConfig()
    if max_steps is not None:
        cfg.train.max_steps = max_steps
    cfg.validate()
    d = distributed.init(cfg.parallel.strategy, cfg.train.device)
    if not d.is_main:
        say = lambda *a: None  # noqa: E731
        quiet = True
    device = distributed.device_for(d, resolve_device(cfg.train.device))
    precision, why = resolve_precision(cfg.train.precision, device)

    # Everything that can fail on user input happens before the run directory is touched. Rank 0
    # tokenizes first; the other ranks then find its work in the cache.
    if not d.is_main:
        distributed.barrier(d)
    init_state = None
    if resume:
        tokenizer = Tokenizer.load(out / "tokenizer.json")
    elif init_from:  # a Hugging Face checkpoint: its architecture, weights and tokenizer replace ours
        from trainwise.export.hf import load_hf_dir

        cfg.model, init_state, tokenizer = load_hf_dir(init_from)
        cfg.tokenizer.vocab_size = tokenizer.vocab_size
        cfg.validate()
    else:
        tokenizer = data_mod.prepare_tokenizer(cfg.data, cfg.tokenizer.vocab_size)
        cfg.model.vocab_size = tokenizer.vocab_size
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise TrainwiseError(
            f"tokenizer.json in {out} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.model.vocab_size}: the tokenizer does not belong to this run."
        )
    tokens = data_mod.prepare_data(cfg.data, tokenizer, cfg.train.seq_len)
    if d.is_main:
        distributed.barrier(d)
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
    optimizer = build_optimizer(model, cfg.train, shard_states=d.active and d.strategy == "zero1")
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    sampler = data_mod.BatchSampler(tokens.train, cfg.train.micro_batch, cfg.train.seq_len, seed=cfg.train.seed,
                                    rank=d.rank, world_size=d.world_size)
    from trainwise.train.report import RunReporter  # noqa: E402  (kept late: pulls in the planner)

    reporter = RunReporter(cfg, distributed.unwrap(model), device, precision, say)

    step, tokens_seen = 0, 0
    if resume:
        if state is not None:
            distributed.load_full_state(model, optimizer, state.optimizer_state, d)
            t = state.trainer_state
            step, tokens_seen = t["step"], t["tokens"]
            sampler.load_state_dict(t["sampler"])
            scaler.load_state_dict(t["scaler"]) if t.get("scaler") else None
            restore_rng(state.rng_state, t["rng"], d.rank)
            say(f"resumed {out} from {state.path.name} (step {step}, {tokens_seen:,} tokens)")
        if d.is_main:
            truncate_metrics(out / "metrics.jsonl", step)
    elif d.is_main:
        create_run_dir(out, cfg, tokenizer, reporter)
    distributed.barrier(d)

    tokens_per_step = cfg.train.tokens_per_step * d.world_size
    say(f"precision: {precision} ({why}); compile: {'on' if compiled else 'off'} ({why_compile}"
        + ("; the first step compiles, tens of seconds" if compiled else "") + f"); device: {device}"
        + (f"; {d.strategy} over {d.world_size} ranks" if d.active else ""))
    say(f"data: {len(tokens.train):,} train / {len(tokens.val):,} val tokens; "
        f"B_eff = micro_batch {cfg.train.micro_batch} x grad_accum {cfg.train.grad_accum_steps}"
        + (f" x world_size {d.world_size}" if d.active else "")
        + f" = {tokens_per_step // cfg.train.seq_len} sequences of {cfg.train.seq_len} tokens "
        f"= {tokens_per_step:,} tokens per step")

    def save() -> None:
        model_state, optimizer_state = distributed.full_state(model, optimizer)  # collective under FSDP
        rng_tensors, rng_plain = zip(*distributed.gather_objects(capture_rng(), d))
        if d.is_main:
            trainer_state = {"step": step, "tokens": tokens_seen, "sampler": sampler.state_dict(),
                             "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                             "rng": list(rng_plain), "world_size": d.world_size}
            ckpt.save_checkpoint(out, step, model_state, optimizer_state, trainer_state,
                                 {"ranks": list(rng_tensors)}, cfg.train.keep_checkpoints)
        distributed.barrier(d)

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    gathered = distributed.gathered_params_meter(model, d)  # zero2's per-rank parameters (measured by forward)
    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8") if d.is_main else None
    tensorboard = None
    if cfg.log.tensorboard and d.is_main:
        from trainwise.report.tensorboard import TensorBoardLogger

        tensorboard = TensorBoardLogger(out)  # fed the same rows as metrics.jsonl
    bar = tqdm(total=cfg.train.max_steps, initial=step, disable=quiet, unit="step", dynamic_ncols=True,
               file=sys.stderr)
    loss_sum = torch.zeros((), device=device)
    last_loss, val_loss, stopped = float("nan"), float("nan"), False
    last_grad_bytes = 0
    best = ckpt.best_checkpoint(out)
    best_val = best["val_loss"] if best else float("inf")
    skipped = torch.zeros((), device=device)  # optimizer steps skipped for a non-finite gradient (this session)
    interval_start, interval_steps = time.perf_counter(), 0
    with _StopRequest() as stop:
        while step < cfg.train.max_steps:
            lr = lr_at(step, cfg.train)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for micro in range(cfg.train.grad_accum_steps):
                x, y = sampler.next_batch()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with distributed.gradient_sync(model, d, micro == cfg.train.grad_accum_steps - 1):
                    with autocast(device, precision):
                        loss = model(x, y)
                    scaler.scale(loss / cfg.train.grad_accum_steps).backward()
                loss_sum += loss.detach()
            scaler.unscale_(optimizer)
            grad_norm = distributed.local_value(
                torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip or float("inf")))
            # A NaN/inf must never reach the weights. The default (skip) decides on the device, with no
            # host sync; "stop" waits for the verdict every step so that it can name the step. (With
            # fp16 the GradScaler skips such steps on its own and lowers the scale.)
            if scaler.is_enabled():
                scaler.step(optimizer)
                scaler.update()
            elif cfg.train.on_nonfinite == "stop" and not bool(torch.isfinite(grad_norm)):
                raise TrainwiseError(nonfinite_diagnostic(model, step + 1, loss))
            else:
                skipped += step_if_finite(optimizer, grad_norm)
            if d.active and step + 1 == cfg.train.max_steps:  # for the per-rank memory check
                last_grad_bytes = distributed.local_bytes(p.grad for p in params)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            interval_steps += 1
            bar.update(1)
            stop_now = distributed.any_rank(stop.requested, d)  # every rank stops at the same step

            do_eval = cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.max_steps)
            if step % cfg.train.log_every == 0 or do_eval or step == cfg.train.max_steps or stop_now:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - interval_start
                loss_sum = distributed.mean_across_ranks(loss_sum, d)
                last_loss = loss_sum.item() / (interval_steps * cfg.train.grad_accum_steps)
                row = reporter.metrics_row(step, tokens_seen, last_loss, lr, grad_norm.item(),
                                           elapsed / interval_steps, tokens_per_step)
                if skipped_steps := int(skipped.item()):
                    row["skipped_steps"] = skipped_steps
                experts = expert_counts(distributed.unwrap(model))
                if experts:
                    row["expert_tokens"] = experts
                    if not cfg.model.dropless:  # token-expert assignments over capacity, last forward
                        row["expert_dropped"] = {i: b.mlp.last_dropped for i, b in
                                                 enumerate(distributed.unwrap(model).blocks) if str(i) in experts}
                if do_eval:
                    val_loss = evaluate(model, tokens.val, cfg, device, precision, eval_forward)
                    row["val_loss"] = val_loss
                if metrics is not None:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                if tensorboard is not None:
                    tensorboard.log(row)
                bar.set_postfix_str(reporter.postfix(row))
                loss_sum.zero_()
                interval_start, interval_steps = time.perf_counter(), 0
            new_best = do_eval and cfg.train.keep_best and val_loss < best_val
            if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or stop_now or new_best:
                save()
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
    if not stopped:
        save()
    if stopped:
        say(f"stopped at step {step} and saved a checkpoint; continue with: trainwise train --resume {out}")
        distributed.shutdown(d)
        return TrainResult(out, step, last_loss, val_loss, float("nan"), "", stopped_early=True)

    if not val_loss == val_loss:  # nan: no evaluation happened yet
        val_loss = evaluate(model, tokens.val, cfg, device, precision, eval_forward)
    per_rank = None
    if d.active:  # the rest is rank 0's, on the gathered weights of the checkpoint just saved
        measured = distributed.rank_state_bytes(params, optimizer, last_grad_bytes, gathered["bytes"])
        per_rank = distributed.per_rank_verify(cfg, distributed.gather_objects(measured, d), d)
        distributed.shutdown(d)
        if not d.is_main:
            return TrainResult(out, step, last_loss, val_loss, float("nan"), "")
        from trainwise.api import load

        model = load(out, device=str(device)).model
    if compiled:
        remove_compile(distributed.unwrap(model))
    unigram = data_mod.unigram_loss(tokens)
    sample = sample_text(model, tokenizer, device, cfg.train.sample_tokens, seed=cfg.train.seed)
    say(f"\nfinal: train loss {last_loss:.4f}, val loss {val_loss:.4f} nats/token "
        f"(unigram baseline {unigram:.4f}; {unigram - val_loss:+.3f} better)")
    say("sample (temperature 0.8, top-k 50):\n" + "-" * 60 + f"\n{sample}\n" + "-" * 60)
    # Distributed: verify measures one step of the gathered model with a fresh optimizer, in one process;
    # the per-rank shards were measured above and are checked against the ZeRO plan.
    reporter.finish(out, tokens_seen, step, model=model,
                    optimizer=build_optimizer(model, cfg.train) if d.active else optimizer)
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
