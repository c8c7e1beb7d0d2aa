"""`plan --simulate`: one step on fake tensors, tracked per category, agreeing with the planner."""

import pytest

from trainwise.config import ModelConfig
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.planner.plan import plan_run
from trainwise.verify.simulate import simulate_report, simulate_step


def test_simulated_step_matches_plan():
    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    mem = simulate_step(cfg, 2, 64, "bf16")
    plan = plan_run(Run(cfg, micro_batch=2, seq_len=64, recipe=get_recipe("amp"), tokens=1,
                        machine=Machine(peak_flops=1e12)))
    assert mem.params == plan.states.params
    assert mem.optimizer == pytest.approx(plan.states.optimizer, rel=0.01)  # + one fp32 step counter per tensor
    assert mem.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.10)
    assert "peak" in simulate_report(plan, mem)


def test_accumulation_peaks_at_the_second_micro_batch():
    """The step's peak with K >= 2 micro-batches is the second one's (gradients kept beside its activations),
    so simulate_step runs two of any K: the peak of K = 4096 is the planner's for K = 4096, and above K = 1's."""
    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)

    def planned(k: int) -> int:
        return plan_run(Run(cfg, micro_batch=2, seq_len=64, grad_accum=k, recipe=get_recipe("amp"), tokens=1,
                            machine=Machine(peak_flops=1e12))).peak_bytes

    one, many = simulate_step(cfg, 2, 64, "bf16", grad_accum=1), simulate_step(cfg, 2, 64, "bf16", grad_accum=4096)
    assert many.peak_bytes == simulate_step(cfg, 2, 64, "bf16", grad_accum=2).peak_bytes > one.peak_bytes
    assert many.peak_bytes == pytest.approx(planned(4096), rel=0.10)


@pytest.mark.slow
def test_llama_3_8b_simulates_without_allocating():
    import resource

    from trainwise.presets import get_preset

    cfg = get_preset("llama-3-8b")
    mem = simulate_step(cfg, 1, 2048, "bf16")
    plan = plan_run(Run(cfg, seq_len=2048, recipe=get_recipe("amp"), tokens=1, machine=Machine(peak_flops=1e12)))
    assert mem.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.10)
    assert mem.peak_bytes > 100e9
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 2 * 2**30


@pytest.mark.parametrize("lr", [0.1, "tensor"])
def test_the_fused_sgd_update_runs_on_fake_tensors_without_real_copies(lr):
    """The fused SGD update (the trainer's SGD, as the recorder and --simulate run it) on a fake 100,000^2
    parameter (40 GB in fp32): no fallback to the CPU kernel on real zero-filled copies of the parameter, its
    gradient and its momentum (which `plan --model deepseek-v3 --optimizer sgd` ran, and was killed for)."""
    from unittest import mock

    import torch
    from torch._subclasses import fake_tensor

    from trainwise.measure.fake import fake_step_mode

    with mock.patch.object(fake_tensor, "run_fallback_kernel", side_effect=AssertionError("a real copy")):
        with fake_step_mode():
            w = torch.nn.Parameter(torch.empty(100_000, 100_000))
            w.grad = torch.empty_like(w)
            opt = torch.optim.SGD([w], lr=torch.tensor(0.1) if lr == "tensor" else lr, momentum=0.9, fused=True)
            opt.step()
            opt.step()  # the momentum buffer made on the first step, updated on the second
            assert opt.state[w]["momentum_buffer"].shape == w.shape
