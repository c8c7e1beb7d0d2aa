"""GatedUnit (act(gate) x up as one autograd node, act(gate) computed again in backward) against autograd's two
nodes, on one training step of trainwise-small: the bytes one forward saves for backward, and the step's median
time in interleaved rounds (fp32 and bf16 autocast), the two side by side on this CPU.

    python benchmarks/bench_gated_unit.py      # about a minute on two cores; run it with nothing else running
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from trainwise.model.transformer import Transformer
from trainwise.presets import get_preset

ROUNDS, STEPS = 10, 3


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    platform.processor())


def main() -> None:
    cfg = get_preset("trainwise-small")
    torch.manual_seed(0)
    model = Transformer(cfg)
    x, y = (torch.randint(0, cfg.vocab_size, (8, 256)) for _ in range(2))
    forms = {"GatedUnit": [b.mlp.act for b in model.blocks], "two nodes": [b.mlp.act_recomputed for b in model.blocks]}

    def use(name: str) -> None:
        for block, act in zip(model.blocks, forms[name]):
            block.mlp.act = act

    def saved_bytes() -> int:
        seen = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, y)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in seen.items() if ptr not in params)

    def step(dtype: str) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; trainwise-small, "
          f"B 8 x T 256")
    for name in forms:
        use(name)
        print(f"  saved for backward (fp32), {name:<9}: {saved_bytes() / 2**20:8.2f} MiB")
    for dtype in ("fp32", "bf16"):
        times = {name: [] for name in forms}
        for name in forms:  # warm-up
            use(name)
            step(dtype)
        for r in range(ROUNDS):
            for name in (list(forms) if r % 2 else list(forms)[::-1]):
                use(name)
                start = time.perf_counter()
                for _ in range(STEPS):
                    step(dtype)
                times[name].append((time.perf_counter() - start) / STEPS)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"  {dtype}: step {med['GatedUnit'] * 1e3:.1f} ms (GatedUnit) vs {med['two nodes'] * 1e3:.1f} ms "
              f"(two nodes): ratio {med['GatedUnit'] / med['two nodes']:.3f}")


if __name__ == "__main__":
    main()
