"""Planner memory vs tracked memory of real CPU steps: states within 1%, peak within 10%."""

import subprocess
import sys

import pytest
import torch

from trainwise.config import ModelConfig, TrainConfig
from trainwise.cost import loss as L
from trainwise.cost.layout import Layout
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.measure.memtrack import track_train_step
from trainwise.planner.plan import plan_run
from trainwise.runtime.step import build_model, build_step, random_batches

CPU = torch.device("cpu")
SIZES = {"xs": dict(d_model=32, n_layers=1), "s": dict(d_model=64, n_layers=2), "m": dict(d_model=96, n_layers=3)}


def measure(size: str, precision: str, checkpointing: str, micro_batch: int, seq_len: int = 32):
    cfg = ModelConfig(vocab_size=512, n_heads=4, n_kv_heads=2, max_seq_len=seq_len, **SIZES[size])
    return track_vs_plan(cfg, precision, checkpointing, micro_batch, seq_len)


def track_vs_plan(cfg: ModelConfig, precision: str, checkpointing: str, micro_batch: int, seq_len: int):
    """(plan, tracked memory) of one real CPU training step of `cfg` (after a step that creates the
    optimizer states)."""
    torch.manual_seed(0)
    step = build_step(build_model(cfg), TrainConfig(activation_checkpointing=checkpointing), CPU, precision)
    batches = random_batches(cfg.vocab_size, micro_batch, seq_len, 1, CPU)
    step(batches)  # optimizer states exist from here on
    tracked = track_train_step(step, batches)
    recipe = get_recipe("fp32" if precision == "fp32" else "amp")
    plan = plan_run(Run(cfg, micro_batch=micro_batch, seq_len=seq_len, recipe=recipe, checkpointing=checkpointing,
                        tokens=1, machine=Machine(peak_flops=1e12)))
    return plan, tracked


def check(plan, tracked):
    s = plan.states
    assert tracked.params == pytest.approx(s.params, rel=0.01)
    assert tracked.grads == pytest.approx(s.grads, rel=0.01)
    assert tracked.optimizer == pytest.approx(s.optimizer, rel=0.01)
    assert tracked.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.10)


@pytest.mark.parametrize("precision,checkpointing", [("fp32", "none"), ("bf16", "full")])
def test_grid_slice(precision, checkpointing):
    check(*measure("s", precision, checkpointing, 2))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_op_level_checkpointing_keeps_what_the_plan_says(precision):
    """Op-level selective checkpointing (torchtitan's policy): the activations a real step keeps equal the
    plan's (cost.memory.op_saved_bytes per token and layer) within 1%, less than half of what no
    checkpointing keeps, and the peak within 10%. Blocks outweigh the loss here (d_model 128, 256 positions)."""
    from trainwise.cost.memory import activation_bytes

    cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256)
    plan, tracked = track_vs_plan(cfg, precision, "op", 2, 256)
    assert tracked.activations == pytest.approx(plan.activations_bytes, rel=0.01)
    recipe = get_recipe("fp32" if precision == "fp32" else "amp")
    assert plan.activations_bytes < 0.6 * activation_bytes(cfg, recipe, 2, 256, "none")
    assert tracked.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("micro_batch", [1, 4])
def test_memory_grid(size, precision, checkpointing, micro_batch):
    check(*measure(size, precision, checkpointing, micro_batch))


def test_accumulation_with_full_checkpointing_measures_its_plan():
    """Issue 17: K = 4 with full checkpointing read 2x its plan because the FLOP counter and the memory
    tracker shared one step (FlopCounterMode kept each micro-batch's activations alive). verify's
    measure_step now counts them on separate steps."""
    from trainwise.config import RunConfig
    from trainwise.verify.verify import measure_step

    cfg = RunConfig()
    cfg.model = ModelConfig(vocab_size=512, n_heads=4, n_kv_heads=2, max_seq_len=32, **SIZES["s"])
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.grad_accum_steps = 4, 32, 4
    cfg.train.activation_checkpointing = "full"
    model = build_model(cfg.model)
    measured = measure_step(cfg, model, None, CPU, "bf16")  # a fresh optimizer
    plan = plan_run(Run(cfg.model, micro_batch=4, seq_len=32, grad_accum=4, recipe=get_recipe("amp"),
                        checkpointing="full", layout=Layout(micro_batches=4), tokens=1,
                        machine=Machine(peak_flops=1e12)))
    assert measured.memory.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.10)
    assert measured.memory.activations == pytest.approx(plan.activations_bytes, rel=0.10)


@pytest.mark.parametrize("precision,checkpointing,k", [("fp32", "none", 1), ("bf16", "full", 4)])
def test_step_peak_meter_agrees_with_memtracker(precision, checkpointing, k):
    """The allocator-level meter (what verify.json's peak uses, compiled or not) and MemTracker's
    dispatcher-level count see the same eager step."""
    from trainwise.measure.memtrack import StepPeakMeter, _storages

    cfg = ModelConfig(vocab_size=512, n_heads=4, n_kv_heads=2, max_seq_len=32, **SIZES["s"])
    torch.manual_seed(0)
    step = build_step(build_model(cfg), TrainConfig(activation_checkpointing=checkpointing), CPU, precision)
    model, opt = step.model, step.optimizer
    batches = random_batches(cfg.vocab_size, 2, 32, k, CPU)
    step(batches)
    # the meter counts every tensor this process holds (other tests' leftovers too); MemTracker this model's
    own = [*model.parameters(), *model.buffers(), *(v for st in opt.state.values() for v in st.values())]
    meter = StepPeakMeter(CPU)
    meter.start()
    others = sum(meter._base.values()) - sum(_storages(own, CPU).values())
    step(batches)
    metered = meter.stop() - others
    tracked = track_train_step(step, batches)
    assert metered == pytest.approx(tracked.peak_bytes, rel=0.02)
    recipe = get_recipe("fp32" if precision == "fp32" else "amp")
    plan = plan_run(Run(cfg, micro_batch=2, seq_len=32, grad_accum=k, recipe=recipe, checkpointing=checkpointing,
                        layout=Layout(micro_batches=k), tokens=1, machine=Machine(peak_flops=1e12)))
    assert metered == pytest.approx(plan.peak_bytes, rel=0.10)


def test_evaluation_and_sampling_peaks():
    """Evaluation (no_grad forward and loss) and generation with its KV cache against the planner."""
    import numpy as np

    from trainwise.config import RunConfig
    from trainwise.cost import memory as M
    from trainwise.cost.recipe import get_recipe
    from trainwise.measure.memtrack import StepPeakMeter, _storages, live_tensors
    from trainwise.trainer.loop import evaluate

    cfg = RunConfig()
    cfg.model = ModelConfig(vocab_size=2048, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.eval_steps = 4, 64, 2
    torch.manual_seed(0)
    model = build_model(cfg.model)
    tokens = np.random.default_rng(0).integers(0, 2048, 20_000).astype(np.uint16)
    for precision in ("fp32", "bf16"):
        meter = StepPeakMeter(CPU)
        meter.start()
        evaluate(model, tokens, cfg, CPU, precision)
        resident = sum(_storages(live_tensors(), CPU).values())
        planned = M.eval_peak_bytes(cfg.model, get_recipe("fp32" if precision == "fp32" else "amp"), resident, 4, 64)
        assert meter.stop() == pytest.approx(planned, rel=0.10)
    meter = StepPeakMeter(CPU)
    meter.start()
    model.generate(torch.zeros(1, 8, dtype=torch.long), 80, top_k=50)
    resident = sum(_storages(live_tensors(), CPU).values())
    assert meter.stop() == pytest.approx(M.sample_peak_bytes(cfg.model, resident, 1, 8), rel=0.10)


def test_step_peak_meter_keeps_the_profilers_unknown_block_line_out_of_the_terminal(capfd, recwarn):
    """A block allocated before start() and freed while the profiler records (a step frees the previous
    step's gradients and batch) makes PyTorch's CPU allocator log "Memory block of unknown size was
    allocated before the profiling started" from C++ to stderr, on the first such free in a process and
    every 1000th after: 1000 such frees log it at least once, whatever the process did before. Under a
    bare profiler the line comes (the condition is real); under the meter nothing of it reaches stderr or
    the warnings, and the peak is still measured."""
    from torch.profiler import ProfilerActivity, profile

    from trainwise.measure.memtrack import StepPeakMeter

    blocks = [torch.ones(4) for _ in range(1000)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        del blocks
    assert "Memory block of unknown size" in capfd.readouterr().err

    blocks = [torch.ones(4) for _ in range(1000)]
    meter = StepPeakMeter(CPU)
    meter.start()
    del blocks
    new = torch.ones(1 << 20)  # 4 MiB allocated inside the stretch: the peak above what was resident
    peak = meter.stop()
    captured = capfd.readouterr()
    assert "Memory block" not in captured.err and "Memory block" not in captured.out, captured.err
    assert not [w for w in recwarn if "Memory block" in str(w.message)]
    assert peak - sum(meter._base.values()) == pytest.approx(new.numel() * new.element_size(), rel=0.01)


def test_step_peak_meter_leaves_out_what_a_worker_thread_holds_past_the_runs_use():
    """A collective's worker thread (gloo's) keeps its input and output until its next job: the run has let
    go of them, the allocator frees them late, on that thread, or after the step. Played with a real thread:
    a buffer handed to it and released by the run before the step's own peak is not in that peak, whether
    the thread frees it during the step or after; the run's own tensors are."""
    import threading

    from trainwise.measure.memtrack import StepPeakMeter

    mib = 1 << 20
    for free_during_step in (True, False):
        held, release, done = [], threading.Event(), threading.Event()

        def worker():
            release.wait()
            held.clear()
            done.set()

        thread = threading.Thread(target=worker)
        thread.start()
        meter = StepPeakMeter(CPU)
        meter.start()
        # 4 MiB the run allocates, hands to the worker and drops; the worker holds the storage, no tensor of
        # Python's (gloo holds it in C++)
        held.append(torch.ones(mib).untyped_storage())
        own = torch.ones(2 * mib)  # 8 MiB of its own, alive at the peak
        if free_during_step:
            release.set()
            done.wait()
        peak = meter.stop() - sum(meter._base.values())
        release.set()
        thread.join()
        assert peak == pytest.approx(own.numel() * own.element_size(), rel=0.01), free_during_step


def test_the_spans_of_one_stretch_each_get_their_own_peak():
    """Repetitions of a step measured in one stretch (the trainer's last steps under torchrun): each span's
    peak is what was resident at the start, what the spans before it left alive, and its own high point;
    the stretch's peak is the highest moment of all, spans or not. The observer's step peak is their median
    (trainer.observer.steady_peak), so one span read high or low does not decide it."""
    from trainwise.measure.memtrack import StepPeakMeter
    from trainwise.trainer.observer import steady_peak

    mib = 1 << 20
    meter = StepPeakMeter(CPU)
    meter.start()
    with meter.span():
        a = torch.ones(mib)  # 4 MiB, freed in the span
        del a
    with meter.span():
        kept = torch.ones(2 * mib)  # 8 MiB, alive into the next span
        b = torch.ones(mib)
        del b
    between = torch.ones(4 * mib)  # 16 MiB outside any span, freed before the next
    del between
    with meter.span():
        c = torch.ones(mib // 2)  # 2 MiB beside the 8 still held
        del c
    peak = meter.stop()
    base = sum(meter._base.values())
    got = [round((p - base) / mib) for p in meter.span_peaks]
    assert got == [4, 12, 10], got
    assert round((peak - base) / mib) == 8 + 16 and kept.numel() == 2 * mib
    assert steady_peak([7, 3, 5]) == 5 and steady_peak([7, 3]) == 3 and steady_peak([4]) == 4


def test_an_address_allocated_again_without_a_recorded_free_ends_the_first_block_there():
    """The profiler does not record every free of a collective's worker (seen under cp x dp: a 42,624-byte
    buffer's address reused by a 38,400-byte one with no free between, so the first stayed counted all step
    and the peak read +13% on CI). The allocator reusing the address proves the first block gone by then: it
    is counted up to the reuse, no further (not left out: FSDP2's gathered parameters end that way too, and
    were in use until shortly before)."""
    from trainwise.measure.memtrack import _own_events

    kib = 1024
    events = [(1, 42 * kib, 0xA, 1), (2, 8 * kib, 0xB, 1), (3, 38 * kib, 0xA, 1), (4, -38 * kib, 0xA, 1),
              (5, -8 * kib, 0xB, 1)]
    own = [n for _, n in _own_events(events, counted={}, reachable=set())]
    assert own == [42 * kib, 8 * kib, -42 * kib, 38 * kib, -38 * kib, -8 * kib]
    running = [sum(own[:i + 1]) for i in range(len(own))]
    assert max(running) == 50 * kib and running[-1] == 0
    # a block resident at the start (in `counted`) whose free went unrecorded (PyTorch's CPU allocator reports
    # no free of a block allocated while no profiler ran: DDP's first gradient buckets, replaced in its second
    # iteration) ends where its address is allocated again, not at the end of the stretch
    events = [(1, 64 * kib, 0xB, 1), (2, 32 * kib, 0xA, 1), (3, -32 * kib, 0xA, 1), (4, -64 * kib, 0xB, 1)]
    own = [n for _, n in _own_events(events, counted={0xA: 160 * kib}, reachable=set())]
    assert own == [64 * kib, -160 * kib, 32 * kib, -32 * kib, -64 * kib]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_its_states_outweigh_peaks_where_the_plan_says(tied, precision):
    """Wide and short (a 4096 x 256 table, 16 positions): the peak is the end of backward or the optimizer
    step, not the activations. The fused AdamW updates in place (no scratch moment: the plan had one and read
    9-20% high), and a tied table's two gradients are summed at the end of backward (two table-sized buffers in
    fp32, one under autocast: cost.rank_memory.tied_grad_sum). Within 1% on the allocator-level meter."""
    from trainwise.measure.memtrack import StepPeakMeter, _storages

    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                      tie_embeddings=tied)
    torch.manual_seed(0)
    step = build_step(build_model(cfg), TrainConfig(), CPU, precision)
    batches = random_batches(cfg.vocab_size, 1, 16, 1, CPU)
    step(batches)
    own = [*step.model.parameters(), *step.model.buffers(),
           *(v for st in step.optimizer.state.values() for v in st.values())]
    meter = StepPeakMeter(CPU)
    meter.start()
    others = sum(meter._base.values()) - sum(_storages(own, CPU).values())
    step(batches)
    metered = meter.stop() - others
    plan = plan_run(Run(cfg, micro_batch=1, seq_len=16, recipe=get_recipe("fp32" if precision == "fp32" else "amp"),
                        tokens=1, machine=Machine(peak_flops=1e12)))
    states = plan.states.params + plan.states.grads + plan.states.optimizer
    table = 4 * cfg.vocab_size * cfg.d_model  # fp32 gradients
    assert plan.peak_bytes == states + (0 if not tied else table if precision == "bf16" else 2 * table)
    assert metered == pytest.approx(plan.peak_bytes, rel=0.01)


# One cross-entropy forward and backward on fp32 logits, vocabulary-sharded on a one-rank mesh under torch's
# loss_parallel (as a tensor-parallel stack calls it) or plain: prints the allocator's high point above the logits
# (the run's own allocations; a fresh process, so that no process group outlives it).
LOSS_PEAK = """
import sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile
from trainwise.measure.memtrack import _allocations
N, V, parallel = 512, 4096, sys.argv[2] == "parallel"
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(sys.argv[1], 1))
torch.manual_seed(0)
labels = torch.randint(0, V, (N,))
x = torch.randn(N, V)
x = (distribute_tensor(x, init_device_mesh("cpu", (1,)), [Shard(-1)]) if parallel else x).requires_grad_()
with loss_parallel() if parallel else torch.enable_grad(), profile(activities=[ProfilerActivity.CPU],
                                                                   profile_memory=True) as prof:
    F.cross_entropy(x, labels).backward()
running = high = 0
for _, nbytes, _, _ in _allocations(prof)[0]:
    running += nbytes
    high = max(high, running)
print(high)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("parallel", [False, True])
def test_torchs_cross_entropy_backward_holds_what_the_plan_says(tmp_path, parallel):
    """F.cross_entropy's backward beside the saved fp32 log-probabilities (4V a token): plain, the log-softmax's
    and the logits' gradients (8V); under loss_parallel, whose nll_loss backward makes both as (one-hot + exp(saved))
    x the incoming gradient, three buffers at once (12V). Measured at the allocator on one rank, whose shard is the
    whole vocabulary: the plan's bytes for the same tokens on tp ranks, times tp."""
    kind = "parallel" if parallel else "plain"
    out = subprocess.run([sys.executable, "-c", LOSS_PEAK, str(tmp_path / "store"), kind], capture_output=True,
                         text=True, check=True)
    N, V, tp = 512, 4096, 2 if parallel else 1
    cfg, recipe = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4), get_recipe("fp32")
    planned = L.loss_saved_bytes_per_token(cfg, recipe) * N + L.loss_backward_bytes(cfg, recipe, N, tp) * tp
    assert int(out.stdout.split()[-1]) == pytest.approx(planned, rel=0.005)  # + the labels' masks and indices
