"""The step-time model's parts with numbers worked by hand: the fits, the operator list, the pricing of
operators, the communication terms, and the plan that puts them together."""

import math
from collections import defaultdict

import pytest

from trainwise.config import ModelConfig
from trainwise.cost.comm import comm_seconds, exposed_comm, ring_seconds
from trainwise.cost.flops import flops_per_token_train
from trainwise.cost.ops import WEIGHT_CAST, Op, for_cuda
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.cost.steptime import (PROBE_WARN, StepTime, predict_step, probed_seconds, scale_batch,
                                     settled_probe, step_time)
from trainwise.cost.time import fit_linear
from trainwise.hardware.profile import Profile
from trainwise.measure.record import block_ops, step_ops
from trainwise.runtime.step import build_model
from trainwise.planner.plan import plan_run

TINY = ModelConfig(vocab_size=256, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)


def profile() -> Profile:
    cls = {"elementwise/other": [[1e6, 1e10]], "activation": [[1e6, 5e9]], "norm": [[1e6, 1e10]],
           "softmax/cross-entropy": [[1e6, 2e9]]}
    return Profile(matmul={"fp32": [0, 1e11, 1e10]}, elementwise={"fp32": cls},
                   attention={"fp32": {"forward": [0, 2e10], "backward": [0, 1e10]}},
                   optimizer=[1e-5, 1e-9], overhead=[1e-3, 1e-5], source="calibrated")


def test_fit_linear_recovers_coefficients_and_stays_non_negative():
    # t = 1 + 2x at x = 2, 4: 5 and 9 -> [1, 2] exactly
    assert fit_linear([([1, 2], 5), ([1, 4], 9)]) == pytest.approx([1, 2])
    # a matmul-like fit t = F/P + Q/BW with P = 1e11, BW = 1e10, from three shapes
    rows = [([f, q], f / 1e11 + q / 1e10) for f, q in ((1e9, 1e7), (1e6, 1e6), (1e8, 1e8))]
    inv_p, inv_bw = fit_linear(rows)
    assert 1 / inv_p == pytest.approx(1e11) and 1 / inv_bw == pytest.approx(1e10)
    # unconstrained least squares would give t = 3 - x (a negative time per unit): clamped to x >= 0
    assert min(fit_linear([([1, 1], 2), ([1, 2], 1)])) >= 0


def test_operators_are_priced_by_their_rule():
    p = profile()
    # mm 4096x256 @ 256x256 fp32: F = 2*4096*256*256 = 536,870,912; Q = 4*(4096*256 + 256*256 + 4096*256)
    # = 8,650,752 bytes -> F/P + Q/BW = 5.36870912e-3 + 8.650752e-4 = 6.23378432e-3 s
    mm = Op("aten.mm", "matmul", "forward", "fp32", (1, 4096, 256, 256), 1, 536_870_912, 8_650_752)
    mul = Op("aten.mul", "elementwise/other", "backward", "fp32", None, 10, 1e7, 1e8)  # 1e8 / 1e10 = 0.01 s
    sdpa = Op("aten._scaled_dot_product_flash_attention_for_cpu_backward", "attention", "backward", "fp32", None,
              2, 4e8, 1e6)  # 4e8 / 1e10 = 0.04 s (the backward rate) + its operands from memory: 1e6 / 1e10
    adam = Op("aten._foreach_addcdiv_", "optimizer", "optimizer", "fp32", None, 1, 1e6, 3e7)
    st = predict_step([mm, mul, sdpa, adam], p, n_param_tensors=10, n_params=1_000_000)
    times = {t.op.name: t.seconds for t in st.ops}
    assert times["aten.mm"] == pytest.approx(6.23378432e-3)
    assert times["aten.mul"] == pytest.approx(0.01)
    assert times[sdpa.name] == pytest.approx(0.0401)
    # optimizer: a x tensors + b x params = 1e-5 x 10 + 1e-9 x 1e6 = 1.1e-3 s
    assert times["aten._foreach_addcdiv_"] == pytest.approx(1.1e-3)
    # eager overhead: 1e-3 per step + 1e-5 x (1 + 10 + 2) forward/backward calls = 1.13e-3 s
    assert st.overhead_s == pytest.approx(1.13e-3)
    assert st.seconds == pytest.approx(6.23378432e-3 + 0.01 + 0.0401 + 1.1e-3 + 1.13e-3)
    assert st.top(1)[0].op.name == sdpa.name


def test_operands_come_from_memory_in_a_step():
    """Kernels are timed hot; in a step their operands were evicted by the step's other work since they were
    written: a timed matmul streams its bytes once more at the copy bandwidth, and element-wise work runs at
    most at its class's rate far past the cache (the grid's largest size), however fast it ran hot."""
    p = profile()
    p.elementwise["fp32"]["elementwise/other"] = [[1e6, 4e10], [1e8, 1e10]]  # hot 40 GB/s, from memory 10
    mul = Op("aten.mul", "elementwise/other", "forward", "fp32", None, 10, 1e6, 1e7)  # 1e6 bytes per call
    assert predict_step([mul], p, 0, 0).ops[0].seconds == pytest.approx(1e7 / 1e10)
    tiny = Op("aten.mul", "elementwise/other", "forward", "fp32", None, 10, 1e2, 1e3)  # slower than memory: kept
    p.elementwise["fp32"]["elementwise/other"] = [[1e2, 1e9], [1e8, 1e10]]
    assert predict_step([tiny], p, 0, 0).ops[0].seconds == pytest.approx(1e3 / 1e9)
    from trainwise.cost.steptime import kernel_key

    mm = Op("aten.mm", "matmul", "forward", "fp32", (1, 512, 512, 512), 4, 4 * 2 * 512**3, 4 * 3 * 4 * 512**2)
    p.kernels[kernel_key(mm)] = 1e-3  # timed hot: 1 ms a call; + 12,582,912 bytes / 1e10 B/s
    assert predict_step([mm], p, 0, 0).ops[0].seconds == pytest.approx(4e-3 + 4 * 3 * 4 * 512**2 / 1e10)


def test_ring_collectives_and_strategies():
    link = [1e-4, 1e9]  # 100 us per hop, 1 GB/s
    # all-reduce of 1e8 bytes over 2 ranks: 2 hops x 1e-4 + 2 x (1/2) x 1e8 / 1e9 = 0.1002 s
    assert ring_seconds("all_reduce", 1e8, 2, link) == pytest.approx(0.1002)
    assert ring_seconds("all_reduce", 1e8, 1, link) == 0
    # DDP: 1e8 bytes in 10 tensors of 1e7 = torch's buckets (1 MiB first, then 25 MiB, in reverse order) of 1, 3, 3
    # and 3 tensors, then the map of the tensors used: 5 x 2 x 1e-4 + 0.1 = 0.1010 s
    tensors = [10_000_000] * 10
    assert comm_seconds("ddp", 2, 1e8, 1e8, 3, 1, link, tensor_bytes=tensors) == {"all_reduce": pytest.approx(0.1010)}
    assert comm_seconds("ddp", 2, 1e8, 1e8, 3, 1, link) == {"all_reduce": pytest.approx(0.1004)}  # one tensor
    # ZeRO-1: the same all-reduces, then each updated tensor broadcast from its owner: 10 x 1e-4 + 0.05
    zero1 = comm_seconds("zero1", 2, 1e8, 1e8, 3, 1, link, tensor_bytes=tensors)
    assert zero1 == {"all_reduce": pytest.approx(0.1010), "broadcast": pytest.approx(0.0510)}
    # FSDP, K = 2, 3 blocks (4 messages): all-gather 4 x 1e-4 + 0.5 x 1e8 / 1e9 = 0.0504, twice per micro-batch
    # (before forward, before backward) x 2 micro-batches = 0.2016; one reduce-scatter 0.0504
    fsdp = comm_seconds("fsdp", 2, 1e8, 1e8, 3, 2, link)
    assert fsdp["all_gather"] == pytest.approx(0.2016) and fsdp["reduce_scatter"] == pytest.approx(0.0504)
    # each micro-batch's gradients reduce-scattered (Layout.fsdp_grad_sync "micro-batch"): two of them
    assert comm_seconds("fsdp", 2, 1e8, 1e8, 3, 2, link, reduces=2)["reduce_scatter"] == pytest.approx(0.1008)
    assert comm_seconds("zero2", 2, 1e8, 1e8, 3, 2, link)["all_gather"] == pytest.approx(0.1008)
    # CPU (gloo shares the cores): all of it shows; GPU: only what outlasts the compute
    assert exposed_comm(fsdp, 0.2, overlaps=False) == pytest.approx(0.252)
    assert exposed_comm(fsdp, 0.2, overlaps=True) == pytest.approx(0.052)


def test_a_cpu_plan_reduce_scatters_as_often_as_its_layout_says(calibrated):
    """The step-time model on this machine reads Layout.fsdp_grad_sync as the cluster step does: K micro-batches'
    reduce-scatters under "micro-batch", one under "step" (trainwise's trainer's). Two ranks on this machine are
    priced with its 1-thread calibration, which test_distributed's first run has measured."""
    from trainwise.cost.layout import make_layout
    from trainwise.presets import get_preset

    cfg = get_preset("trainwise-small")
    comm = {s: plan_run(Run(cfg, seq_len=min(2048, cfg.max_seq_len), grad_accum=4, recipe=get_recipe("fp32"),
                            machine=Machine(gpu="cpu"), tokens=1e6,
                            layout=make_layout(2, zero=3, micro_batches=4, fsdp_grad_sync=s))).step.comm
            for s in ("step", "micro-batch")}
    assert comm["micro-batch"]["reduce_scatter"] == pytest.approx(4 * comm["step"]["reduce_scatter"])
    assert comm["micro-batch"]["all_gather"] == comm["step"]["all_gather"]


def test_each_strategy_is_priced_at_its_collectives_as_its_steps_ran_them_else_alone():
    """Over gloo the link calibration fits each strategy's collectives to what they added to real steps
    (measure.reference.strategy_links): zero1 takes ddp's fit (the same DDP reducer); a strategy without
    a fit takes the link of the collectives timed alone."""
    p = profile()
    p.link, p.link_source = [1e-4, 1e9], "calibrated (gloo, 2 ranks)"
    p.strategy_links = {"fsdp": [2e-3, 4e8], "zero2": [1e-3, 5e8], "ddp": [5e-4, 8e8]}
    mm = Op("aten.mm", "matmul", "forward", "fp32", (1, 512, 512, 512), 4, 4 * 2 * 512**3, 4 * 3 * 4 * 512**2)
    common = dict(n_layers=3, grad_tensor_bytes=[25_000_000] * 4, n_params=25_000_000, grad_accum=1,
                  compute_dtype="fp32", optimizer="adamw", dp=2, grad_bytes=100_000_000, param_bytes=100_000_000)
    fsdp = step_time([mm], p, zero=3, **common)
    assert fsdp.comm == comm_seconds("fsdp", 2, 1e8, 1e8, 3, 1, [2e-3, 4e8])
    assert fsdp.comm_s == pytest.approx(sum(fsdp.comm.values()))  # a CPU: all of it shows
    assert "fsdp's collectives as its training steps ran them" in fsdp.comm_how and "2,000 us per hop" in fsdp.comm_how
    for zero, strategy in ((0, "ddp"), (1, "zero1")):
        st = step_time([mm], p, zero=zero, **common)
        assert st.comm == comm_seconds(strategy, 2, 1e8, 1e8, 3, 1, [5e-4, 8e8], tensor_bytes=[25_000_000] * 4)
        assert "500 us per hop" in st.comm_how and "training steps ran them" in st.comm_how
    assert "zero1's collectives as ddp's training steps ran them" in step_time([mm], p, zero=1, **common).comm_how
    p.strategy_links = {"fsdp": [2e-3, 4e8]}
    for zero, strategy in ((0, "ddp"), (1, "zero1")):
        st = step_time([mm], p, zero=zero, **common)
        assert st.comm == comm_seconds(strategy, 2, 1e8, 1e8, 3, 1, p.link, tensor_bytes=[25_000_000] * 4)
        assert "alone, calibrated (gloo, 2 ranks)" in st.comm_how
    assert step_time([mm], p, zero=3, **{**common, "dp": 1}).comm_how == ""  # one rank: nothing to say
    assert "the default link" in step_time([mm], profile(), zero=0, **common).comm_how  # no link calibrated


def test_operator_list_counts_what_the_planner_counts():
    B, T = 2, 16
    ops = step_ops(TINY, B, T)
    assert {o.phase for o in ops} == {"forward", "backward", "optimizer"}
    matmul_flops = sum(o.flops for o in ops if o.cls in ("matmul", "attention"))
    assert matmul_flops == flops_per_token_train(TINY, T) * B * T  # one FLOP count
    qkv = [o for o in ops if o.name == "aten.mm" and o.phase == "forward" and o.shape[2:] == (32, 64)]
    assert qkv and qkv[0].shape == (1, B * T, 32, (4 + 2 * 2) * 8)  # (B*T, H) x (H, (nh + 2 nkv) hd)
    # K micro-batches repeat forward and backward, not the optimizer step
    def key(o):
        return o.name, o.phase, o.dtype, o.shape, o.layout, o.per_call_bytes()

    k2 = {key(o): o.flops for o in step_ops(TINY, B, T, grad_accum=2)}
    for o in ops:
        assert k2[key(o)] == o.flops * (1 if o.phase == "optimizer" else 2)
    # compiled on a CPU: attention as two matmuls around a softmax, no SDPA kernel
    compiled = step_ops(TINY, B, T, compiled=True)
    assert not any(o.cls == "attention" for o in compiled) and any(o.name == "aten.bmm" for o in compiled)
    # micro-batch 2 x 2 priced from micro-batch 2's list: the same matmul FLOPs as recording it; the
    # weight-sized element-wise work (embedding gradient) is scaled too, by design an overestimate (<1%)
    scaled, real = scale_batch(ops, 2, T), step_ops(TINY, 2 * B, T)
    assert sum(o.flops for o in scaled if o.cls == "matmul") == sum(o.flops for o in real if o.cls == "matmul")
    assert sum(o.flops for o in scaled if o.phase != "optimizer") == pytest.approx(
        sum(o.flops for o in real if o.phase != "optimizer"), rel=0.01)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_record_priced_at_other_micro_batches_moves_what_recording_them_moves(precision):
    """A record with its fixed bytes (step_ops(fixed=True)) scaled to micro-batches 3 and 8 moves, op by op, the
    bytes a record of that micro-batch moves, eager and fused: autocast's weight casts and the gradients'
    casts do not grow with the tokens (scaled as activations, they had priced a 30B model's step 25% long)."""
    T = 16
    one = step_ops(TINY, 1, T, precision, checkpointing="full", fixed=True)
    key = lambda o: (o.name, o.phase, o.dtype)  # noqa: E731
    assert sum(o.fixed for o in one if o.name == WEIGHT_CAST) == sum(o.bytes for o in one if o.name == WEIGHT_CAST)
    for b in (3, 8):
        want, got = defaultdict(lambda: [0.0, 0.0]), defaultdict(lambda: [0.0, 0.0])
        for ops, out in ((step_ops(TINY, b, T, precision, checkpointing="full"), want), (scale_batch(one, b, T), got)):
            for o in ops:
                if o.phase != "optimizer" and o.dtype != "other":  # "other": the labels' copy a batch of 1 skips
                    out[key(o)][0] += o.bytes
                    out[key(o)][1] += o.moved(fused=True)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-9), k
    # the planner's per-block records (a depth-1 record takes its fixed bytes from the depth-2 one's calls)
    blocks, three = block_ops(TINY, 1, T, precision, "full"), block_ops(TINY, 3, T, precision, "full", fixed=False)
    for part, ops in blocks.items():
        want, got = defaultdict(float), defaultdict(float)
        for ops_, out in ((three[part], want), (scale_batch(ops, 3, T), got)):
            for o in ops_:
                if o.dtype != "other":
                    out[key(o)] += o.bytes
        assert got == pytest.approx(want, rel=1e-9), part


def test_a_gpu_plan_prices_the_gpus_step_from_published_figures():
    ops = for_cuda(step_ops(TINY, 2, 16, "bf16"))
    names = {o.name for o in ops}
    assert "aten._scaled_dot_product_flash_attention" in names and "aten._fused_adamw_" in names
    assert not any("for_cpu" in n or "_foreach" in n for n in names)
    assert any(o.dtype == "bf16" and o.cls == "matmul" for o in ops)
    run = Run(TINY, micro_batch=2, seq_len=16, recipe=get_recipe("bf16"), tokens=1e6, machine=Machine(gpu="h100"))
    plan = plan_run(run)
    j = plan.to_json()["time"]
    assert j["source"] == "published microbenchmarks" and 0 < j["mfu"] < 0.7 and "MAMF" in j["source_detail"]
    assert j["step_seconds"] == pytest.approx(plan.cluster.seconds)
    assert j["tokens_per_s"] == pytest.approx(32 / plan.cluster.seconds)
    assert j["seconds"] == pytest.approx(1e6 / j["tokens_per_s"])
    # --mfu stays a what-if: C / (G x peak x MFU)
    what_if = plan_run(run, mfu=0.5)
    assert what_if.time_source == "assumed MFU (--mfu)" and what_if.step is None and what_if.cluster is None
    assert what_if.time.seconds == pytest.approx(what_if.total_flops / (989.4e12 * 0.5))


def test_the_worked_example_still_comes_out_exactly():
    p = plan_run(Run(None, recipe=get_recipe("fp32"), tokens=1e10, machine=Machine(peak_flops=100e12)),
                 params_count=1e9)
    assert p.states.total == 16e9 and p.total_flops == 6e19
    assert p.time.seconds == 1.5e6 and math.isclose(p.time.days, 17.36, abs_tol=5e-3)


def test_element_wise_work_is_priced_at_the_rate_of_its_size():
    """A class's rate is calibrated at several sizes per call; between them seconds per byte are
    interpolated linearly in log(bytes), and held at the ends."""
    from trainwise.cost.steptime import elementwise_rate

    grid = [[1e6, 4e10], [1e8, 1e10]]  # 25 ps/byte in cache, 100 ps/byte from memory
    assert elementwise_rate(grid, 1e3) == 4e10 and elementwise_rate(grid, 1e9) == 1e10
    # 1e7 is halfway in log: (25 + 100) / 2 = 62.5 ps/byte -> 1.6e10 bytes/s
    assert elementwise_rate(grid, 1e7) == pytest.approx(1.6e10)
    p = profile()
    p.elementwise["fp32"]["elementwise/other"] = grid
    # 10 calls of 1e7 bytes each: 1e8 bytes at 1.6e10 bytes/s = 6.25 ms, but in a step at most at the rate
    # from memory (test_operands_come_from_memory_in_a_step): 1e8 / 1e10 = 10 ms; compiled bf16: x1.29
    mul = Op("aten.mul", "elementwise/other", "forward", "fp32", None, 10, 1e7, 1e8)
    st = predict_step([mul], p, n_param_tensors=0, n_params=0)
    assert st.ops[0].seconds == pytest.approx(10e-3)
    from trainwise.cost.steptime import COMPILED_ELEMENTWISE

    compiled = predict_step([mul], p, 0, 0, compiled=True, precision="bf16")
    assert compiled.ops[0].seconds == pytest.approx(10e-3 * COMPILED_ELEMENTWISE["bf16"])
    assert compiled.overhead_s == pytest.approx(1e-3)  # fused kernels pay no eager per-op cost


def test_kernels_timed_at_their_shape_override_the_fit_and_in_step_scales_all():
    p = profile()
    mm = Op("aten.mm", "matmul", "forward", "bf16", (1, 4096, 256, 4096), 3, 3 * 2 * 4096 * 256 * 4096, 1.0, "NT")
    # no table entry and no device to time it on: the fit (fp32's, the only dtype): F/P + Q/BW
    fit = 3 * 2 * 4096 * 256 * 4096 / 1e11 + 1.0 / 1e10
    assert predict_step([mm], p, 0, 0).ops[0].seconds == pytest.approx(fit)
    # a timed call of that shape and layout: 20 ms each, 3 calls = 60 ms; in a step x1.25 = 75 ms
    from trainwise.cost.steptime import kernel_key

    assert kernel_key(mm) == "matmul|bf16|1x4096x256x4096|NT"
    p.kernels[kernel_key(mm)] = 0.02
    p.in_step = 1.25
    st = predict_step([mm], p, 0, 0)
    assert st.ops[0].seconds == pytest.approx(0.075) and "timed at its shape" in st.ops[0].how
    # another layout of the same shape is another kernel (x.t() @ dy runs 1.5-2x slower here)
    assert predict_step([Op(**{**mm.__dict__, "layout": "TN"})], p, 0, 0).ops[0].seconds == pytest.approx(fit * 1.25)
    # calibrated per compute precision: a bf16 step's kernels lose more in a step than an fp32 step's;
    # fp16 autocast takes bf16's; a precision the calibration has no reference for takes in_step
    p.in_step_by = {"fp32": 1.1, "bf16": 1.3}
    for precision, factor in (("bf16", 1.3), ("fp16", 1.3), ("fp32", 1.1)):
        st = predict_step([mm], p, 0, 0, precision=precision)
        assert st.ops[0].seconds == pytest.approx(0.06 * factor)
        assert f"x{factor:.3g} in a {precision} step" in st.ops[0].how
    p.in_step_by = {"bf16": 1.3}
    assert predict_step([mm], p, 0, 0, precision="fp32").ops[0].seconds == pytest.approx(0.075)


def test_the_calibration_fits_an_in_step_factor_per_compute_precision(calibrated):
    """Real reference steps of both compute precisions: a factor for each, from that precision's references,
    and the step's plan prices its kernels with its own (in_step: the median of all, for older readers)."""
    import statistics

    from trainwise.hardware.cache import calibration_path, read_json
    from trainwise.measure.reference import OVERHEAD_REFERENCES, REFERENCE_STEPS

    entry = next(v for v in read_json(calibration_path()).values() if "profile" in v)
    prof = entry["profile"]
    assert set(prof["in_step_by"]) == {r[3] for r in REFERENCE_STEPS[OVERHEAD_REFERENCES:]} == {"fp32", "bf16"}
    per_step, per_op = prof["overhead"]
    ratios = {}
    for (_, _, _, precision), (_, t, kernels, calls) in zip(REFERENCE_STEPS[OVERHEAD_REFERENCES:],
                                                             prof["reference_steps"][OVERHEAD_REFERENCES:]):
        ratios.setdefault(precision, []).append(max((t - per_step - per_op * calls) / kernels, 0.5))
    assert prof["in_step_by"] == pytest.approx({k: statistics.median(v) for k, v in ratios.items()})
    assert prof["in_step"] == pytest.approx(statistics.median([r for v in ratios.values() for r in v]))


def test_a_new_calibration_starts_a_new_kernel_table():
    """The in-step factor is fitted against the table's kernel times: both must come from one state of the
    machine, whose speed moves by up to 2x between hours. Other machines' kernels stay."""
    from trainwise.hardware.cache import drop_kernel_table, kernel_table, save_kernel_table

    save_kernel_table("cpu|this", {"matmul|bf16|1x8x8x8|NN": 1e-6})
    save_kernel_table("cpu|other", {"matmul|bf16|1x8x8x8|NN": 2e-6})
    drop_kernel_table("cpu|this")
    assert kernel_table("cpu|this") == {} and kernel_table("cpu|other") == {"matmul|bf16|1x8x8x8|NN": 2e-6}


def test_the_operator_list_records_layouts_casts_and_kernel_shapes():
    B, T = 2, 16
    ops = step_ops(TINY, B, T, "bf16")
    fwd = [o for o in ops if o.name == "aten.mm" and o.phase == "forward"]
    assert fwd and all(o.layout == "NT" for o in fwd)  # x @ W.t(): nn.Linear's weight, transposed
    assert any(o.layout == "TN" for o in ops if o.name == "aten.mm" and o.phase == "backward")  # dW = dy.t() @ x
    # autocast's casts are memory work with no FLOPs; a parameter's cast is recorded apart (WEIGHT_CAST): every
    # fp32 weight a matmul reads (the tied LM head reads the embedding's) is read (4 bytes) and written in bf16
    # (2) once per forward
    casts = [o for o in ops if "_to_copy" in o.name and o.phase == "forward"]
    assert casts and all(o.flops == 0 for o in casts)
    matrices = sum(p.numel() for p in build_model(TINY, "meta").parameters() if p.dim() == 2)
    assert sum(o.bytes for o in casts if o.name == WEIGHT_CAST) == 6 * matrices
    # attention as (batch, heads, kv heads, T, head dim), forward and backward alike
    attn = {o.phase: o.shape for o in ops if o.cls == "attention"}
    assert attn == {"forward": (B, 4, 2, T, 8), "backward": (B, 4, 2, T, 8)}
    # each element-wise record's calls move the same bytes
    assert all(o.bytes == o.per_call_bytes() * o.calls for o in ops)


def test_an_moe_steps_grouped_matmuls_are_recorded_with_their_expert_shapes():
    moe = ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32,
                      n_experts=4, top_k=2, expert_ffn_hidden=32)
    grouped = {(o.phase, o.shape, o.layout) for o in step_ops(moe, 2, 16, "bf16") if "grouped_mm" in o.name}
    # 2 x 16 tokens x top-2 = 64 rows, 16 per expert: (S, 32) x (E, 32, 2 x 32) up, (S, 32) x (E, 32, 32) down
    assert ("forward", (4, 16, 32, 64), "NN") in grouped and ("forward", (4, 16, 32, 32), "NN") in grouped
    # the experts' weight gradients: (K', S) x (S, N) split along S into 4 groups
    assert ("backward", (4, 32, 16, 64), "TN:split-k") in grouped


def test_the_host_allocator_keeps_freed_memory():
    """glibc's thresholds are raised once per process (runtime.allocator); a subprocess shows that a large
    block freed and allocated again, step after step, is served from the heap (no new page faults)."""
    import subprocess
    import sys

    code = ("import resource\nfrom trainwise.runtime.allocator import keep_freed_memory\nimport torch\n"
            "assert keep_freed_memory() and keep_freed_memory()\n"
            "for _ in range(10):\n    x = torch.ones(1 << 23); del x\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(10):\n    y = torch.ones(1 << 23); del y\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")
    faults = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    off = subprocess.run([sys.executable, "-c", code.replace("assert keep_freed_memory() and keep_freed_memory()\n",
                                                             "")], capture_output=True, text=True, check=True)
    # without the setting each 32 MiB block is mmapped afresh: 10 x 8,192 pages faulted (81,930 measured);
    # with it, once the heap has grown (a few steps), the block is reused: none (0 measured)
    assert int(off.stdout) > 60_000 and faults < 2_000



def test_a_probe_inside_its_band_keeps_the_calibrated_prediction():
    """probed_seconds: overhead x its ratio + operators x theirs + communication, once the reading is more
    than PROBE_WARN from the calibration, either way; inside it, the calibrated step unchanged."""
    step = StepTime(seconds=1.0, compute_s=0.7, overhead_s=0.2, comm_s=0.1, ops=[], source="calibrated",
                    compiled=False)
    near = {"ratio": 1 + PROBE_WARN, "overhead_ratio": 1.6, "kernel_ratio": 1.2}
    assert probed_seconds(step, near) == 1.0
    moved = {"ratio": 1.2, "overhead_ratio": 1.5, "kernel_ratio": 1.15}
    assert probed_seconds(step, moved) == pytest.approx(0.2 * 1.5 + 0.7 * 1.15 + 0.1)
    fast = {"ratio": 0.8, "overhead_ratio": 0.5, "kernel_ratio": 0.84}
    assert probed_seconds(step, fast) == pytest.approx(0.2 * 0.5 + 0.7 * 0.84 + 0.1)


def test_other_processes_share_of_the_cores_lengthens_the_probed_step_inside_the_band_too():
    """measure.load.load_factor: others' core-seconds per second on the cores our threads use, x, cost a step
    that waits on its slowest thread 1 / (1 - x); nothing below LOAD_MIN_CORES, on cores we leave free or
    without a reading. probed_seconds multiplies the step (not its communication) by it, whatever the band."""
    from trainwise.measure.load import LOAD_MAX_SHARE, LOAD_MIN_CORES, load_factor

    assert load_factor(0.065, threads=2, cores=2) == pytest.approx(1 / (1 - 0.13))
    assert load_factor(LOAD_MIN_CORES / 2 * 0.99, threads=2, cores=2) == 1.0 and load_factor(None, 2, 2) == 1.0
    assert load_factor(0.25, threads=1, cores=2) == 1.0  # half of 2 cores: the core we leave free
    assert load_factor(0.75, threads=1, cores=2) == pytest.approx(2.0)  # 1.5 cores: half of ours
    assert load_factor(0.9, threads=2, cores=2) == pytest.approx(1 / (1 - LOAD_MAX_SHARE))
    step = StepTime(seconds=1.0, compute_s=0.7, overhead_s=0.2, comm_s=0.1, ops=[], source="calibrated",
                    compiled=False)
    near = {"ratio": 1.02, "overhead_ratio": 1.0, "kernel_ratio": 1.03, "load_factor": 1.25}
    assert probed_seconds(step, near) == pytest.approx(0.9 * 1.25 + 0.1)
    moved = {"ratio": 1.2, "overhead_ratio": 1.5, "kernel_ratio": 1.15, "load_factor": 1.25}
    assert probed_seconds(step, moved) == pytest.approx((0.2 * 1.5 + 0.7 * 1.15) * 1.25 + 0.1)


def test_a_probe_reads_a_real_background_process_as_load():
    """measure.reference.probe_speed on this machine with one process spinning: it reads others' share of
    the cores and a load factor above 1 (a spinner shares a core with one of our threads: x ~ 0.5)."""
    import subprocess
    import sys
    import time

    import torch

    from trainwise.measure.reference import REFERENCE_STEPS, probe_speed

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a two-thread step (a test worker runs one): one of its threads waits on the spinner
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        probe = probe_speed(torch.device("cpu"), [1.0] * len(REFERENCE_STEPS), seconds=0.5)
    finally:
        spinner.kill()
        spinner.wait()
        torch.set_num_threads(threads)
    assert probe["others_share"] > 0.1 and probe["load_factor"] > 1.2


def test_a_move_counts_only_when_the_probe_at_the_end_shows_it_too():
    """settled_probe: a slow reading at the start and a calibrated one at the end (a VM's slow spell of a
    few seconds) settle on the end's, which leaves the calibrated prediction; slow at both ends stays slow."""
    step = StepTime(seconds=1.0, compute_s=0.7, overhead_s=0.2, comm_s=0.1, ops=[], source="calibrated",
                    compiled=False)
    spike = {"ratio": 1.4, "overhead_ratio": 1.5, "kernel_ratio": 1.4, "at": "start"}
    calm = {"ratio": 1.05, "overhead_ratio": 1.1, "kernel_ratio": 1.0, "at": "end"}
    settled = settled_probe(spike, calm)
    assert settled["at"] == "end" and settled["readings"] == [1.4, 1.05] and probed_seconds(step, settled) == 1.0
    slow = {"ratio": 1.5, "overhead_ratio": 1.6, "kernel_ratio": 1.5, "at": "end"}
    settled = settled_probe(spike, slow)
    assert settled["at"] == "start" and probed_seconds(step, settled) == pytest.approx(0.2 * 1.5 + 0.7 * 1.4 + 0.1)
