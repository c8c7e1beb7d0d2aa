"""A run's account of itself: the plan up front, metrics rows, the progress bar, and at the end verify.json
(RunAccount.write_verify_json: the run measured against its plan).

Throughput numbers follow docs/ARCHITECTURE.md, "Counting FLOPs, MFU and HFU": model FLOPs per token come from
the planner (`cost.flops.flops_per_token_train`, no recompute, attention not halved); MFU = model FLOP/s /
(devices x peak FLOP/s of the dtype in use); HFU adds the recompute of activation checkpointing and of
the chunked loss (model.loss_chunk_tokens).
On a CPU the peak is this machine's measured matmul peak (`trainwise hardware --calibrate`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from trainwise import rundir
from trainwise.config import RunConfig
from trainwise.data.bpb import bits_per_byte
from trainwise.cost.flops import flops_per_token_train
from trainwise.cost.params import params as count_params
from trainwise.cost.steptime import PROBE_WARN, probed_seconds, settled_probe
from trainwise.cost.time import model_flops_utilization
from trainwise.files import write_json_atomic
from trainwise.hardware.cache import cached, cached_link, save_probe
from trainwise.measure.calibrate import calibrate_link
from trainwise.measure.reference import probe_speed, reference_speed
from trainwise.planner.machine import device_hardware
from trainwise.planner.plan import Plan, plan_for_run
from trainwise.units import fmt_bytes, fmt_finite
from trainwise.verify.verify import (
    build_verify,
    entry,
    format_table,
    measure_step,
    measured_from_step,
    probe_line,
    steady_step_time,
)

# The speed probe after a run (RunAccount.machine_speed) costs ~1 s: only runs whose steps took this long
PROBE_MIN_RUN_S = 30.0
# A speed probe at most this old (the previous run's, in a sweep of short runs or a test session) stands
# for the machine's speed now: the probe at a run's start already predates its steps by the run's length
PROBE_REUSE_S = 60.0


class RunAccount:
    def __init__(self, cfg: RunConfig, model: torch.nn.Module, device: torch.device, precision: str, compiled: bool,
                 say, dp: int | None = None):
        self.cfg, self.device, self.precision, self.say = cfg, device, precision, say
        t = cfg.train
        self.counts = count_params(cfg.model)
        self.model_flops_per_token = flops_per_token_train(cfg.model, t.seq_len)
        self.hardware_flops_per_token = flops_per_token_train(cfg.model, t.seq_len,
                                                               recompute=t.activation_checkpointing)
        self.hardware = hw = device_hardware(device, precision)
        self.peak_flops, self.peak_source = hw.peak_flops, hw.peak_source
        self.compiled = compiled  # how the step runs, for the step-time model: compiled, and on how many ranks
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # the plan is the data-parallel one (tokens per step = dp replicas' batches); a tensor- or pipeline-
        # parallel replica's per-rank shares are trainwise.cost.rank's (verify.json's per_rank)
        self.dp = dp or self.world_size
        if self.dp > 1 and device.type == "cpu" and cached_link("gloo", self.world_size) is None:
            say(f"measuring the gloo collectives over {self.world_size} ranks, alone and as training steps run them "
                "(about 15 s, once per machine: `trainwise hardware --calibrate` under torchrun)")
            calibrate_link()  # every rank: they are collectives
        # Under torchrun rank 0 alone probes the machine and prices the step (timing the step's new kernels),
        # the other ranks waiting at a barrier, as its calibration ran on one rank while the others waited for its
        # lock; the other ranks keep no probe and no plan (rank 0 writes plan.json and verify.json).
        self.probe = self.start_plan = None
        if self.rank == 0:
            self.probe = self._probe()  # the machine's speed now against its calibration (about a second)
            self.start_plan = self._say_plan(model, say)
        if self.world_size > 1:
            torch.distributed.barrier()

    def _say_plan(self, model: torch.nn.Module, say) -> dict:
        """The model, its FLOPs and the plan (plan_json, returned) as the run starts."""
        cfg, hw = self.cfg, self.hardware
        # a divided model's rank holds some of it (pipeline stages): the planner's count of the whole
        built = sum(p.numel() for p in model.parameters()) if self.dp == self.world_size else self.counts.total
        say(f"model {cfg.model.name}: {built:,} parameters ({self.counts.active:,} active per token), "
            f"{cfg.model.n_layers} layers, d_model {cfg.model.d_model}, vocab {cfg.model.vocab_size}")
        say(f"compute: {self.model_flops_per_token:,.0f} model FLOPs per token (fwd+bwd, exact, attention "
            f"not halved); MFU against {self.peak_flops / 1e9:,.1f} GFLOP/s ({self.peak_source})")
        plan = self.plan_json()
        mem, when = plan["memory"], plan["time"]
        say(f"plan: peak memory {fmt_bytes(mem['peak_bytes'])} (states {fmt_bytes(mem['states_bytes'])}, "
            f"activations {fmt_bytes(mem['activations_bytes'])}); {plan['flops']['total']:.3g} FLOPs in all, "
            f"{when['step_seconds']:.3g} s per step, {when['seconds']:,.0f} s in all at {when['mfu']:.1%} MFU "
            f"({when['source']})")
        if note := hw.calibration_note:
            say(f"      calibration: {note}")
        if probed := when.get("probe"):
            say(f"      {probe_line(probed, when['step_seconds'])}")
        say("      (plan.json; `trainwise plan --model RUN/config.toml --gpu cpu --explain` derives it)")
        return plan

    def plan(self) -> Plan:
        return plan_for_run(self.cfg, precision=self.precision, peak_flops=self.peak_flops, device=self.device.type,
                            compiled=self.compiled, world_size=self.dp)

    def plan_json(self) -> dict:
        """plan.json: the plan, and under time.probe the step predicted for the machine as probed."""
        plan = self.plan()
        out = plan.to_json()
        if self.probe is not None and plan.step is not None:
            keys = ("at", "ratio", "overhead_ratio", "kernel_ratio", "others_share", "load_factor")
            out["time"]["probe"] = {**{k: self.probe[k] for k in keys if k in self.probe},
                                    "step_seconds": probed_seconds(plan.step, self.probe)}
        return out

    def _probe(self) -> dict | None:
        """A speed probe of this machine (measure.reference.probe_speed), kept with its calibration, or the one
        kept there if it is under PROBE_REUSE_S old; None where the device has no calibrated reference steps
        (a table GPU)."""
        calibrated = ((self.hardware.calibration or {}).get("profile") or {}).get("probe_baseline_s")
        if not calibrated:
            return None
        last = (self.hardware.calibration or {}).get("last_probe") or {}
        if last.get("calibrated_s") == calibrated and 0 <= time.time() - last.get("unix", 0) < PROBE_REUSE_S:
            return last
        reading = probe_speed(self.device, calibrated)
        save_probe(self.device, reading)
        return reading

    def machine_speed(self) -> dict | None:
        """After the run: the calibration's reference steps timed again (measure.reference.reference_speed),
        as a verify.json entry {"predicted": their calibrated seconds (summed), "measured": now, "error"}: how much
        of the step-time error is this machine's speed having moved since it was calibrated. None where
        there is no such calibration (a table GPU). Under torchrun rank 0 alone calls it, the other ranks gone."""
        calibrated = ((cached(self.device) or {}).get("profile") or {}).get("probe_baseline_s")
        if not calibrated:
            return None
        now = reference_speed(self.device)
        return {**entry(sum(calibrated), sum(now)), "per_reference_s": now}

    def metrics_row(self, step: int, tokens: int, loss: float, lr: float, grad_norm: float,
                    step_time_s: float, tokens_per_step: int) -> dict:
        """One row of metrics.jsonl: `tokens_per_step` is every rank's together, so tokens/s and FLOP/s are the
        run's and MFU divides them by every rank's peak (world size x one device's)."""
        tokens_per_s = tokens_per_step / step_time_s
        flops_per_s = self.model_flops_per_token * tokens_per_s
        row = {
            "step": step, "tokens": tokens, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s, "flops_per_s": flops_per_s,
            "mfu": model_flops_utilization(flops_per_s, self.peak_flops, self.world_size),
        }
        if self.hardware_flops_per_token != self.model_flops_per_token:
            # HFU: the same ratio with the FLOPs the hardware ran, recomputation included
            row["hfu"] = model_flops_utilization(self.hardware_flops_per_token * tokens_per_s, self.peak_flops,
                                                 self.world_size)
        return row

    @staticmethod
    def postfix(row: dict) -> str:
        text = f"loss {row['loss']:.3f} lr {row['lr']:.1e} {row['tokens_per_s']:,.0f} tok/s MFU {row['mfu']:.0%}"
        if "val_loss" in row:
            text += f" val {row['val_loss']:.3f}"
        return text

    def write_verify_json(self, out: Path, tokens_seen: int, step: int, model: torch.nn.Module | None = None,
               optimizer_state: dict | None = None, step_peak_bytes: int | None = None) -> dict | None:
        """Write verify.json and print the predicted-vs-measured table. One extra training step runs on a
        copy of the model and optimizer (trainwise.verify.verify.measure_step): the run's weights,
        optimizer, sampler and RNG are left as they were."""
        if model is None:
            return None
        measured = measured_from_step(measure_step(self.cfg, model, optimizer_state, self.device, self.precision),
                                      step_peak_bytes)
        step_time, _ = steady_step_time(out)
        device = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else f"{self.device.type}")
        probe = self.probe
        if probe is not None and abs(probe["ratio"] - 1) > PROBE_WARN:  # a move must show at the end too
            end = probe_speed(self.device, probe["calibrated_s"])
            save_probe(self.device, end)
            probe = settled_probe(probe, end)
        result = build_verify(self.cfg, self.plan(), measured, step_time, device, self.peak_source, probe)
        result["run"] = {"precision": self.precision, "peak_flops": self.peak_flops, "peak_source": self.peak_source,
                         "step": step, "tokens": tokens_seen, "compiled": self.compiled, "world_size": self.world_size,
                         "dp": self.dp}
        if step_time and step_time * step >= PROBE_MIN_RUN_S and (speed := self.machine_speed()) is not None:
            result["machine_speed"] = speed
        write_json_atomic(out / rundir.VERIFY, result)
        self.say("\npredicted vs measured (verify.json):\n" + format_table(result))
        return result


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


def numbered_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(layer index, block) of the model, or of a pipeline rank's share (RankModel: indices as names)."""
    blocks = model.blocks
    return (list(blocks.items()) if isinstance(blocks, torch.nn.ModuleDict)
            else [(str(i), b) for i, b in enumerate(blocks)])


def expert_counts(model: torch.nn.Module) -> dict[str, list[int]]:
    """Tokens each MoE layer routed to each expert in the last forward, by layer index."""
    return {i: block.mlp.last_expert_counts.tolist() for i, block in numbered_blocks(model)
            if getattr(block.mlp, "last_expert_counts", None) is not None}


def final_losses(train_loss: float, val_loss: float, unigram: float, val_bytes: tuple[int, int] | None) -> str:
    """The run's closing line: its last losses (and bits per byte of the validation text) beside the unigram
    baseline; a diverged run's losses read 'not finite'."""
    bpb = f", {fmt_finite(bits_per_byte(val_loss * val_bytes[0], val_bytes[1]))} bits/byte" if val_bytes else ""
    return (f"\nfinal: train loss {fmt_finite(train_loss)}, val loss {fmt_finite(val_loss)} nats/token{bpb} "
            f"(unigram baseline {unigram:.4f}; {fmt_finite(unigram - val_loss, '+.3f')} better)")
