"""What a run says about itself while it trains: the plan up front, metrics rows, the progress bar.

Throughput numbers follow DESIGN.md's conventions: model FLOPs per token come from the planner
(`cost.flops.flops_per_token_train`, no recompute, attention not halved); MFU = model FLOP/s /
(devices x peak FLOP/s of the dtype in use); HFU adds the recompute of activation checkpointing and of
the chunked loss (model.loss_chunk_tokens).
On a CPU the peak is this machine's measured matmul peak (`trainwise hardware --calibrate`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainwise.config import RunConfig
from trainwise.cost.flops import flops_per_token_train
from trainwise.cost.params import params as count_params
from trainwise.cost.plan import fmt_bytes


def device_peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s, where it came from) for MFU on this device and precision."""
    if device.type == "cuda":
        from trainwise.cost.hardware import lookup_cuda_device

        found = lookup_cuda_device(torch.cuda.get_device_name(device))
        if found is not None:
            return found.peak(precision), f"{found.name} datasheet ({precision})"
    from trainwise.measure.calibrate import busy_note, calibrate

    measured = calibrate(device)
    note = busy_note(measured)
    return (measured["peak_flops"][precision],
            f"measured {precision} matmul peak of this {device.type}" + (f"; {note}" if note else ""))


# The speed probe after a run (RunReporter.machine_speed) costs ~1 s: only runs whose steps took this long
PROBE_MIN_RUN_S = 30.0


class RunReporter:
    def __init__(self, cfg: RunConfig, model: torch.nn.Module, device: torch.device, precision: str, say):
        self.cfg, self.device, self.precision, self.say = cfg, device, precision, say
        t = cfg.train
        self.counts = count_params(cfg.model)
        self.model_flops_per_token = flops_per_token_train(cfg.model, t.seq_len)
        self.hardware_flops_per_token = flops_per_token_train(cfg.model, t.seq_len,
                                                               recompute=t.activation_checkpointing)
        self.peak_flops, self.peak_source = device_peak_flops(device, precision)
        # How the step will run, for the step-time model: compiled (whole model or per block) and ranks.
        self.compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in (model, *model.blocks))
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        built = sum(p.numel() for p in model.parameters())
        say(f"model {cfg.model.name}: {built:,} parameters ({self.counts.active:,} active per token), "
            f"{cfg.model.n_layers} layers, d_model {cfg.model.d_model}, vocab {cfg.model.vocab_size}")
        say(f"compute: {self.model_flops_per_token:,.0f} model FLOPs per token (fwd+bwd, exact, attention "
            f"not halved); MFU against {self.peak_flops / 1e9:,.1f} GFLOP/s ({self.peak_source})")
        plan = self.plan().to_json()
        mem, when = plan["memory"], plan["time"]
        say(f"plan: peak memory {fmt_bytes(mem['peak_bytes'])} (states {fmt_bytes(mem['states_bytes'])}, "
            f"activations {fmt_bytes(mem['activations_bytes'])}); {plan['flops']['total']:.3g} FLOPs in all, "
            f"{when['step_seconds']:.3g} s per step, {when['seconds']:,.0f} s in all at {when['mfu']:.1%} MFU "
            f"({when['source']})")
        say("      (plan.json; `trainwise plan --model RUN/config.toml --gpu cpu --explain` derives it)")

    def plan(self):
        from trainwise.cost.plan import plan_for_run  # noqa: PLC0415

        return plan_for_run(self.cfg, precision=self.precision, peak_flops=self.peak_flops, device=self.device.type,
                            compiled=self.compiled, world_size=self.world_size)

    def machine_speed(self) -> dict | None:
        """After the run: the calibration's reference steps timed again (measure.kernels.reference_speed),
        as a verify.json entry {"predicted": their calibrated seconds (summed), "measured": now, "error"}: how much
        of the step-time error is this machine's speed having moved since it was calibrated. None where
        there is no such calibration (a table GPU, torchrun ranks of one thread each)."""
        if self.world_size > 1:
            return None
        from trainwise.measure.calibrate import cached
        from trainwise.measure.kernels import reference_speed

        calibrated = ((cached(self.device) or {}).get("profile") or {}).get("reference_fastest_s")
        if not calibrated:
            return None
        now = reference_speed(self.device)
        return {"predicted": sum(calibrated), "measured": sum(now), "error": sum(now) / sum(calibrated) - 1,
                "per_reference_s": now}

    def write_plan(self, path: Path) -> None:
        path.write_text(json.dumps(self.plan().to_json(), indent=1), encoding="utf-8")

    def metrics_row(self, step: int, tokens: int, loss: float, lr: float, grad_norm: float,
                    step_time_s: float, tokens_per_step: int) -> dict:
        tokens_per_s = tokens_per_step / step_time_s
        flops_per_s = self.model_flops_per_token * tokens_per_s
        row = {
            "step": step, "tokens": tokens, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s, "flops_per_s": flops_per_s,
            "mfu": flops_per_s / self.peak_flops,
        }
        if self.hardware_flops_per_token != self.model_flops_per_token:
            row["hfu"] = self.hardware_flops_per_token * tokens_per_s / self.peak_flops
        return row

    @staticmethod
    def postfix(row: dict) -> str:
        text = f"loss {row['loss']:.3f} lr {row['lr']:.1e} {row['tokens_per_s']:,.0f} tok/s MFU {row['mfu']:.0%}"
        if "val_loss" in row:
            text += f" val {row['val_loss']:.3f}"
        return text

    def finish(self, out: Path, tokens_seen: int, step: int, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None, step_peak_bytes: int | None = None) -> dict | None:
        """Write verify.json and print the predicted-vs-measured table. One extra training step runs on a
        copy of the model and optimizer (trainwise.measure.verify.measure_step): the run's weights,
        optimizer, sampler and RNG are left as they were."""
        if model is None:
            return None
        from trainwise.measure.verify import build_verify, format_table, measure_step, measured_from_step, steady_step_time

        measured = measured_from_step(measure_step(self.cfg, model, optimizer, self.device, self.precision),
                                      step_peak_bytes)
        step_time, _ = steady_step_time(out / "metrics.jsonl")
        device = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else f"{self.device.type}")
        result = build_verify(self.cfg, self.plan(), measured, step_time, device, self.peak_source)
        result["run"] = {"precision": self.precision, "peak_flops": self.peak_flops, "peak_source": self.peak_source,
                         "step": step, "tokens": tokens_seen, "compiled": self.compiled, "world_size": self.world_size}
        if step_time and step_time * step >= PROBE_MIN_RUN_S and (speed := self.machine_speed()) is not None:
            result["machine_speed"] = speed
        (out / "verify.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        self.say("\npredicted vs measured (verify.json):\n" + format_table(result))
        return result
