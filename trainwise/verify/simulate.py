"""`trainwise plan --simulate`: one real training step of the trainwise model on fake tensors.

On fake tensors (trainwise.measure.fake) every tensor has a shape, dtype and device but no storage, so
the step allocates nothing: an 8B-parameter model "trains" one step in a few hundred MB of real memory.
MemTracker (trainwise.measure.memtrack) still sees every storage the step would create,
so its per-category figures are what the real step would use, to compare with the planner's formulas.
"""

from __future__ import annotations

import torch

from trainwise.config import ModelConfig, TrainConfig
from trainwise.measure.fake import fake_step_mode
from trainwise.measure.memtrack import MemoryBreakdown, track_train_step
from trainwise.runtime.step import build_model, build_step


def simulate_step(model_cfg: ModelConfig, micro_batch: int, seq_len: int, precision: str = "fp32",
                  checkpointing: str = "none", optimizer: str = "adamw", grad_accum: int = 1) -> MemoryBreakdown:
    """Tracked memory of one steady-state step (optimizer states already present) on fake CPU tensors.
    precision: "fp32" or "bf16" (bf16 autocast over fp32 weights, the trainer's recipe). Of K micro-batches
    two are run: every one after the second holds what the second holds (the gradients kept from the first
    backward beside its own activations), so the step's peak is theirs, and K = 4096 takes two steps' time."""
    device = torch.device("cpu")
    train_cfg = TrainConfig(optimizer=optimizer, micro_batch=micro_batch, seq_len=seq_len,
                            grad_accum_steps=grad_accum, activation_checkpointing=checkpointing)
    with fake_step_mode():
        step = build_step(build_model(model_cfg), train_cfg, device, precision)
        ids = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len + 1))
        batches = [(ids[:, :-1], ids[:, 1:])] * min(grad_accum, 2)
        step(batches[:1])  # creates the optimizer states
        return track_train_step(step, batches)


def simulate_report(plan, mem: MemoryBreakdown) -> str:
    """Analytic (planner) vs simulated memory, per category, with the error."""
    s = plan.states
    rows = [("params", s.params + s.master, mem.params), ("grads", s.grads, mem.grads),
            ("optimizer", s.optimizer, mem.optimizer), ("activations", plan.activations_bytes, mem.activations),
            ("peak", plan.peak_bytes, mem.peak_bytes)]
    out = [f"{'memory (one step)':<18} {'analytic':>24} {'simulated':>24} {'error':>8}"]
    for name, pred, meas in rows:
        err = f"{meas / pred - 1:+.1%}" if pred else "n/a"
        out.append(f"{name:<18} {_b(pred):>24} {_b(meas):>24} {err:>8}")
    out.append(f"simulated temporaries at the peak: {_b(mem.temporaries)}; buffers {_b(mem.buffers)}")
    return "\n".join(out)


def _b(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:,.3f} GB ({n / 2**30:,.3f} GiB)"
