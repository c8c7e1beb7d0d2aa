"""Tensor, sequence, pipeline and expert parallelism under torchrun on gloo (issue 30): the same losses as one
process, a DCP checkpoint mid-run that resumes to the same losses and reshards, every rank's states, peak and
messages as trainwise.cost.rank plans them (tied embeddings across pipeline stages, fp16's loss scaler and
torch.compile's blocks included), and layouts that cannot work refused before anything starts.

Two torchrun launches (tests/tp_pp_worker.py: the step builder, the comm counter and the peak meter the
trainer uses) train every layout STEPS steps with the checkpoint at step SAVE_AT and its resumption; one trainer
run goes through the CLI end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import set_args
from tp_pp_worker import SAVE_AT, STEPS, config

from trainwise.api import load
from trainwise.cli import main
from trainwise.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from trainwise.cost import rank as R
from trainwise.cost.layout import Layout
from trainwise.cost.schedule import in_flight
from trainwise.cost.run import Machine, Run
from trainwise.cost.schedule import rank_stages, schedule_ops
from trainwise.errors import TrainwiseError
from trainwise.planner.derivation import plan_table
from trainwise.planner.plan import plan_run
from trainwise.runtime.context_parallel import cp_ranks, head_tail_order, rank_positions, sequence_order
from trainwise.runtime.mesh import check_layout, layout_for, pipeline_micro_batches
from trainwise.verify.per_rank import predicted_ranks

WORKER = Path(__file__).with_name("tp_pp_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def rank_env() -> dict:
    """The ranks' environment, read when they start: one thread per rank (4 ranks on 2 cores), and the
    session's cache (tests/conftest.py), so the 1-thread calibration and the link are measured once per session."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


TWO_RANKS = ["tp", "pp_1f1b", "pp_interleaved", "pp_gpipe", "pp_tied", "moe_tp", "moe_pp", "ep", "ep_fsdp", "moe_fsdp",
             "fsdp_sync", "cp", "pp_zb", "pp_zb_moe", "pp_zbv", "pp_dualpipev", "pp_fp16"]
FOUR_RANKS = ["fsdp_tp", "pp_tp", "pp_tp_tied", "pp_dp", "pp_fsdp", "tp_dp_bf16", "dp_ep", "dp_ep_zero2", "tp_ep_fsdp",
              "cp_dp", "tp_cp", "pp_dp_ep"]
# Launched on 2 ranks of their own under -m slow: compiled blocks, of a pipeline stage and of DTensor shards (a cold
# kernel build, on one rank while the other waits: a third of the 2-rank launch's time). The default suite compiles
# per block in one process (tests/test_model.py) and trains the whole-model compile (tests/test_train.py).
SLOW = ["pp_compiled", "tp_compiled"]
CASES = TWO_RANKS + FOUR_RANKS + [pytest.param(case, marks=pytest.mark.slow) for case in SLOW]


def _start(n: int, out: Path, cases: list[str]) -> tuple[subprocess.Popen, int, Path, list[str]]:
    """A launch of the worker, not waited for: its output goes to OUT/stderr.txt (a pipe left unread while
    another launch is waited for would fill and stop it)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stderr.txt", "w") as err:
        proc = subprocess.Popen([*TORCHRUN, "--nproc-per-node", str(n), str(WORKER), str(out), *cases],
                                stdout=subprocess.DEVNULL, stderr=err, env=rank_env())
    return proc, n, out, cases


def _results(launch: tuple[subprocess.Popen, int, Path, list[str]], timeout: float) -> dict:
    proc, n, out, cases = launch
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()  # a no-op once it has ended
    assert proc.returncode == 0, (out / "stderr.txt").read_text()[-4000:]
    results = {case: [json.loads((out / f"{case}.rank{r}.json").read_text()) for r in range(n)] for case in cases}
    for case, ranks in results.items():  # the one-process run, with rank 0's results (tp_pp_worker.one_process)
        if (out / f"{case}.reference.json").exists():
            ranks[0].update(json.loads((out / f"{case}.reference.json").read_text()))
    return results


def _launch(n: int, out: Path, cases: list[str], timeout: float) -> dict:
    return _results(_start(n, out, cases), timeout)


class Runs(dict):
    """Each case's per-rank results; a SLOW case's launched when first asked for."""

    def __init__(self, out: Path, results: dict):
        super().__init__(results)
        self.out = out

    def __missing__(self, case: str) -> list[dict]:
        if case not in SLOW:
            raise KeyError(case)
        self.update(_launch(2, self.out / "slow", SLOW, timeout=300))
        return self[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    """Every layout's per-rank results: a 2-rank launch and a 4-rank launch, side by side (nothing they
    record is a time, and each leaves a core idle at times while its ranks wait on one another)."""
    out = tmp_path_factory.mktemp("tp_pp")
    two = _start(2, out / "two", [*TWO_RANKS, "reshard", "reshard_ep"])
    four = _start(4, out / "four", FOUR_RANKS)
    results = _results(two, timeout=300)
    results.update(_results(four, timeout=300))
    return Runs(out, results)


def plan(case: str, world: int, expert_tokens: list | None = None) -> list[dict]:
    """Every rank's plan; with expert parallelism its all-to-alls at the routing the run measured."""
    cfg = config(case)
    return predicted_ranks(cfg, cfg.train.precision, layout_for(cfg.parallel, world), expert_tokens)


@pytest.mark.parametrize("case", CASES)
def test_losses_equal_one_process_with_the_same_global_batch(runs, case):
    """fp32, STEPS steps: every rank's losses within 1e-4 of one process's on the same dp x K micro-batches.
    pp_fp16 (fp16 autocast and its loss scaler, one process's too, a step skipped): within 1e-3, fp16's own
    rounding (a 10-bit mantissa: 4.9e-4 a rounding) of activations the two compute in other orders; its
    losses part by 5.7e-5 after 6 steps without the skipped step, 9.9e-5 with it. tp_dp_bf16 (bf16 autocast under
    FSDP2's replicate): within 1e-3 as well, bf16's coarser rounding (an 8-bit mantissa) the same way; 3.0e-4 seen."""
    reference = runs[case][0]["reference"]
    assert len(reference) == STEPS
    rel = 1e-3 if config(case).train.precision in ("fp16", "bf16") else 1e-4
    for rank in runs[case]:
        assert rank["losses"] == pytest.approx(reference, rel=rel)


@pytest.mark.parametrize("case", CASES)
def test_the_mid_run_checkpoint_resumes_to_the_same_losses(runs, case):
    """A fresh model of the same layout (compiled again, for the compiled cases) loads the DCP checkpoint of step
    SAVE_AT: the steps after it are the straight run's, bit for bit."""
    for rank in runs[case]:
        assert rank["resumed"] == rank["losses"][SAVE_AT:]


def test_moe_routing_under_tp_is_one_process_routing(runs):
    """fp32: the router sees the all-gathered tokens on every rank, computed in another order than in one
    process; each rank routes every token exactly as one process does."""
    ranks = runs["moe_tp"]
    assert ranks[0]["reference_routing"] and all(r["routing"] == ranks[0]["reference_routing"] for r in ranks)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_and_sends_what_the_plan_says(runs, case):
    """params, grads and optimizer bytes and every collective's calls and bytes equal cost.rank's plan for
    that rank; the step's peak within 10% of cost.rank_memory.rank_peak (the least of the MEASURED steps
    before SAVE_AT: see tp_pp_worker.train), GPipe included: its first backward finds all K micro-batches
    in flight but no gradients yet, its second one gradients and K - 1."""
    predicted = plan(case, len(runs[case]), [rank["measured"].get("expert_tokens") for rank in runs[case]])
    assert_ranks_as_planned(runs[case], predicted)


def assert_ranks_as_planned(ranks: list[dict], predicted: list[dict]) -> None:
    """Each rank's measured states and messages equal its plan's, its peak within 10%."""
    for r, (p, rank) in enumerate(zip(predicted, ranks, strict=True)):
        m = rank["measured"]
        for name in ("params", "grads", "optimizer"):
            assert m[name] == p[name], (r, name)
        assert m["comm"] == p["comm"], r
        error = m["peak_memory_bytes"] / p["peak_memory_bytes"] - 1
        assert abs(error) < 0.10, (r, m["peak_memory_bytes"], p["peak_memory_bytes"])


@pytest.mark.parametrize("case", ["pp_zbv", "pp_dualpipev"])
def test_a_v_schedule_evaluates_as_one_process(runs, case):
    """Evaluation through a V schedule (torch's V runtime runs its backward actions in eval() too: the batch's
    backward runs and its gradients are dropped): every rank's loss of one batch after the resumed steps is one
    process's after the same steps."""
    for rank in runs[case]:
        assert rank["eval"] == pytest.approx(runs[case][0]["reference_eval"], rel=1e-5)


def test_fp16_stages_scale_each_micro_batch_and_check_for_inf_over_the_job(runs):
    """fp16 under pp 2: each micro-batch's loss is multiplied by the scaler's scale inside the schedule (the
    losses of one fp16 process, above), and whether any rank's gradient is inf or NaN is one all-reduce of a
    4-byte flag over both ranks per step, beside the gradient norm's, the loss's and the tied table's. In step
    OVERFLOW_STEP only rank 0 finds an inf gradient (the worker makes its first block's norm weight's so, and one
    process's): both ranks skip that step as one process does (the losses after it equal its losses), and all
    three halve the scale once, 2^16 -> 2^15, and hold it after the resumed steps."""
    ranks = runs["pp_fp16"]
    assert ranks[0]["scale"] == ranks[1]["scale"] == ranks[0]["reference_scale"] == 2.0**15
    fp32 = plan("pp_tied", 2)  # the same layout, tied, in fp32: no scaler
    for rank, p in zip(ranks, fp32):
        measured = rank["measured"]["comm"]["all_reduce"]
        assert measured["calls"] == p["comm"]["all_reduce"]["calls"] + 1
        assert measured["bytes"] == p["comm"]["all_reduce"]["bytes"] + 4  # 2 ranks: 2 (n - 1) / n x 4 bytes


@pytest.mark.parametrize("case", CASES)
def test_the_plan_printed_before_the_run_is_what_verify_holds_it_to(case, capsys):
    """The plan of the run (plan_run on the trainer's layout) prints, as its step peak, states and activations,
    the per-rank model's highest rank: the prediction verify compares that rank's measurements with."""
    cfg = config(case)
    world = 4 if case in FOUR_RANKS else 2
    layout = layout_for(cfg.parallel, world, cfg.train.grad_accum_steps)
    plan = plan_run(Run.of(cfg, cfg.train.precision, layout, machine=Machine(peak_flops=1e12)))
    predicted = predicted_ranks(cfg, cfg.train.precision, layout)
    rank, _ = plan.peak_rank
    assert plan.peak_bytes == max(p["peak_memory_bytes"] for p in predicted) == predicted[rank]["peak_memory_bytes"]
    states = plan.to_json()["memory"]
    assert [states[f"{k}_bytes"] for k in ("params", "grads", "optimizer")] == [
        predicted[rank][k] for k in ("params", "grads", "optimizer")]
    print(plan_table(plan))
    assert f"(rank {rank}, the highest)" in capsys.readouterr().out


def test_tp_messages_worked_by_hand():
    """tp 2, micro_batch 2 x seq_len 16 (8 positions a rank), d_model 32, vocab 300, 2 layers, K = 2, fp32.
    A rank's share of the residual stream is 2 x 8 x 32 x 4 = 2048 bytes; per micro-batch each layer
    all-gathers attention's and the MLP's inputs and reduce-scatters their outputs (4 x 2048 sent), and the
    same again in backward: 8 messages of 2048 bytes per layer; the embedding reduce-scatters its output and
    all-gathers its gradient (2 x 2048); the head all-gathers its input (2048) and the logits (its 2 x 16 x
    150 x 4 = 19200 bytes) and reduce-scatters its input's gradient (2048).
      all_gather:     2 x (2 layers x 4 + 1 + 2) = 22 calls, 2 x (2 x 4 x 2048 + 2048 + 2048 + 19200) = 79360 B
      reduce_scatter: 2 x (2 layers x 4 + 1 + 1) = 20 calls, 20 x 2048 = 40960 B
      all_reduce:     5 norm weights' partial gradients (32 floats: 2 x 1/2 x 128 = 128 B each) + the gradient
                      norm (a 4-byte scalar: 4 B) = 6 calls, 644 B."""
    cfg = config("tp")
    comm = R.rank_comm(cfg.model, Layout(tp=2), 0, R.StepShape(2, 16, 2, 4, 4))
    assert comm == {"all_gather": {"calls": 22, "bytes": 79360}, "all_reduce": {"calls": 6, "bytes": 644},
                    "reduce_scatter": {"calls": 20, "bytes": 40960}}


def test_cp_messages_worked_by_hand():
    """cp 2 ("cp": DDP over the 2 ranks), micro_batch 2 x seq_len 16, 2 nkv heads of 8, 2 layers, K = 2, fp32.
    Rank 0 holds positions 0-3 and 12-15, rank 1 4-11. Per layer and micro-batch each rank's k and v (2 x 8
    positions x 2 x 2 x 8 floats) are all-gathered into 2 x 2 x 2 x 16 x 8 x 4 = 4096 bytes, of which it sends
    half, and their gradients reduce-scattered in backward (2048 B): 4 calls of each, 8192 B. All-reduces: each
    micro-batch's loss (a 4-byte scalar: 2 x 1/2 x 4 = 4 B), DDP's one bucket of every gradient (40480 floats,
    161920 B) and its map of the 14 tensors each rank used (56 B) over dp x cp = 2 ranks: 4 calls, 161984 B. dp 2 x
    cp 2: ranks 0, 1 divide one sequence, 2, 3 the next."""
    assert rank_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert rank_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert all(torch.equal(sequence_order(24, cp), head_tail_order(24, cp)) for cp in (2, 3, 6))
    assert [cp_ranks(Layout(dp=2, cp=2), r) for r in (0, 3)] == [[0, 1], [2, 3]]
    assert cp_ranks(Layout(dp=2, cp=2, tp=2), 5) == [5, 7]
    cfg, layout = config("cp"), layout_for(config("cp").parallel, 2)
    for rank in (0, 1):
        assert R.rank_comm(cfg.model, layout, rank, R.StepShape(2, 16, 2, 4, 4)) == {
            "all_gather": {"calls": 4, "bytes": 8192}, "all_reduce": {"calls": 4, "bytes": 161984},
            "reduce_scatter": {"calls": 4, "bytes": 8192}}


def test_pp_messages_worked_by_hand():
    """pp 2, 1F1B, 4 micro-batches of 1 x 16 positions, d_model 32, fp32: each micro-batch's activation is
    16 x 32 x 4 = 2048 bytes. Stage 0 sends 4 activations and receives 4 gradients; stage 1 the reverse;
    both all-reduce the step's loss and the squared gradient norm over pp (4 bytes each: 2 x 1/2 x 4)."""
    cfg = config("pp_1f1b")
    for rank in (0, 1):
        assert R.rank_comm(cfg.model, Layout(pp=2), rank, R.StepShape(1, 16, 4, 4, 4)) == {
            "all_reduce": {"calls": 2, "bytes": 8}, "send_recv": {"calls": 8, "bytes": 4 * 2048}}


def test_pp_tied_messages_worked_by_hand():
    """pp 2, 1F1B, tied, 3 micro-batches of 1 x 16 positions, d_model 32, vocab 300, fp32. As untied, each
    micro-batch's activation (2048 bytes) crosses once each way, and the loss and the squared norm are
    all-reduced over pp (4 B each); the table's gradient (300 x 32 x 4 = 38400 bytes) is all-reduced between
    stage 0's embedding and stage 1's copy as the head: 2 x 1/2 x 38400 = 38400 B sent by each."""
    cfg = config("pp_tied")
    for rank in (0, 1):
        assert R.rank_comm(cfg.model, Layout(pp=2), rank, R.StepShape(1, 16, 3, 4, 4)) == {
            "all_reduce": {"calls": 3, "bytes": 38408}, "send_recv": {"calls": 6, "bytes": 3 * 2048}}


@pytest.mark.parametrize("case", ["pp_tied", "pp_zb", "pp_zbv", pytest.param("pp_compiled", marks=pytest.mark.slow)])
def test_tied_copies_stay_bit_equal_and_the_checkpoint_loads_in_one_process(runs, case):
    """pp 2, tied: the first stage's embedding and the last stage's LM head (its own copy of the table) are
    bit-equal after STEPS steps, straight and resumed, on two ranks (1F1B, interleaved zero bubble) or on rank
    0, which holds both ends of a V (zbv: the worker digests the embedding there; the copy takes the same
    summed gradient); the DCP checkpoint of step SAVE_AT gathered into one process gives step SAVE_AT's loss
    (its weights before that step's update)."""
    first, last = runs[case]
    assert first["tied"] is not None and first["tied"] == first["tied_resumed"]
    assert last["tied"] == last["tied_resumed"] == (None if case == "pp_zbv" else first["tied"])
    assert first["one_process_at_save"] == pytest.approx(first["losses"][SAVE_AT], rel=1e-5)


def test_v_schedule_messages_worked_by_hand():
    """zbv (and dualpipev), pp 2: stages 0 and 3 on rank 0, 1 and 2 on rank 1, tied, 4 micro-batches of 1 x 16
    positions, d_model 32, fp32. Each micro-batch's activation (2048 bytes) crosses 0 -> 1 and 2 -> 3 forward
    and back as a gradient; 1 -> 2 stays on rank 1. Each rank: 2 sends and 2 receives a micro-batch (16 calls,
    8 x 2048 bytes), the loss and the squared norm over pp (4 B each), and no tied all-reduce: rank 0 sums the
    table's two gradients itself."""
    for schedule in ("zbv", "dualpipev"):
        layout = Layout(pp=2, vpp=2, pp_schedule=schedule, micro_batches=4)
        assert rank_stages(layout, 0) == [0, 3] and rank_stages(layout, 1) == [1, 2]
        for rank in (0, 1):
            assert R.rank_comm(config("pp_zbv").model, layout, rank, R.StepShape(1, 16, 4, 4, 4)) == {
                "all_reduce": {"calls": 2, "bytes": 8}, "send_recv": {"calls": 16, "bytes": 8 * 2048}}


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
@pytest.mark.parametrize("pp, micro_batches", [(2, 4), (4, 8), (4, 12), (4, 10)])
def test_zero_bubble_orders_run_each_micro_batch_once_per_stage(schedule, pp, micro_batches):
    """cost.schedule.schedule_ops reads torch's own order: on every rank and local stage, K forwards, and K
    backwards, whole (B) or as an input half (I) each followed later by its weight half (W); the micro-batches
    in flight at a backward never exceed the forwards run."""
    layout = Layout(pp=pp, vpp=2, pp_schedule=schedule, micro_batches=micro_batches)
    for rank in range(pp):
        ops = schedule_ops(layout, rank, micro_batches)
        for chunk in (0, 1):
            kinds = [k for k, c in ops if c == chunk]
            assert kinds.count("F") == micro_batches
            assert kinds.count("B") + kinds.count("I") == micro_batches == kinds.count("B") + kinds.count("W")
            pending = 0
            for kind in kinds:
                pending += (kind == "I") - (kind == "W")
                assert pending >= 0
        flights = in_flight(layout, rank, micro_batches)
        assert all(len(live) <= 2 * micro_batches for live, _ in flights)
        assert not flights[0][1] and all(after for _, after in flights[micro_batches * 2 - 1:])


def test_pp_tp_messages_worked_by_hand():
    """pp 2 x tp 2, untied, 2 micro-batches of 1 x 16 positions, d_model 32, fp32. A micro-batch's residual
    stream is 16 x 32 x 4 = 2048 bytes; an all-gather or reduce-scatter of it over tp 2 sends half: 1024 B.
    Stage 0 (ranks 0, 1): block 0 (4 all-gathers, 4 reduce-scatters per micro-batch, forward and backward)
    and the embedding (1 reduce-scatter, 1 all-gather): 2 x 5 = 10 each, 10240 B each; it sends each
    micro-batch's T/tp positions (1024 B) and receives their gradients: 4 calls, 2048 B; all-reduces: block
    0's two norm weights' partial gradients over tp (128 B each), the gradient norm over 4 ranks (2 x 3/4 x
    4 = 6 B) and the loss over pp (4 B): 4 calls, 266 B. Stage 1 (ranks 2, 3): block 1 and the head (its
    input all-gathered, 1024 B, and its logits, 16 x 300 x 4 = 19200 B of which it sends 9600; its input's
    gradient reduce-scattered): all-gathers 2 x 6 = 12 calls, 2 x (5 x 1024 + 9600) = 29440 B,
    reduce-scatters 2 x 5 = 10, 10240 B; the same 4 transfers; all-reduces 3 norms + 2 scalars: 394 B."""
    cfg, layout, shape = config("pp_tp").model, Layout(tp=2, pp=2), R.StepShape(1, 16, 2, 4, 4)
    first = {"all_gather": {"calls": 10, "bytes": 10240}, "all_reduce": {"calls": 4, "bytes": 266},
             "reduce_scatter": {"calls": 10, "bytes": 10240}, "send_recv": {"calls": 4, "bytes": 2048}}
    last = {"all_gather": {"calls": 12, "bytes": 29440}, "all_reduce": {"calls": 5, "bytes": 394},
            "reduce_scatter": {"calls": 10, "bytes": 10240}, "send_recv": {"calls": 4, "bytes": 2048}}
    assert [R.rank_comm(cfg, layout, r, shape) for r in range(4)] == [first, first, last, last]


def test_fsdp_tp_messages_worked_by_hand():
    """FSDP over dp 2 of tp 2, tied, 2 micro-batches of 1 x 16 positions, fp32. A tp rank's share: the
    root unit (embedding 150 x 32 + final norm 32 = 4832 elements) and two blocks of 7744; FSDP2 halves
    each: 2416 and 3872 elements a rank. Each unit is all-gathered before forward and again before backward
    (fsdp reshards after forward) in both micro-batches: 12 calls, a rank sending its shard, 2 x 2 x (2416 +
    2 x 3872) x 4 = 162560 B; its gradients reduce-scattered once: 3 calls, 40640 B. Tensor parallelism as in
    the tp case, per micro-batch: 2 blocks x 4 + embedding 1 + head input 1 = 10 all-gathers of 1024 B and
    the logits' (9600 B), 10 reduce-scatters of 1024 B: x 2 = 22 calls, 39680 B and 20 calls, 20480 B. All-
    reduces: 5 norm weights' partial gradients over tp (128 B each) and the gradient norm over 4 ranks (6 B).
    The same under bf16 (FSDP2's policy gathers the weights in bf16): the partial gradients are still 128 B each,
    reduced in FSDP2's fp32 reduce dtype (as measured: trainwise-small's tp 2 x dp 2 bf16 run all-reduces its
    nine 256-wide norm weights' gradients in 9216 B, where bf16 would be 4608)."""
    cfg, layout, shape = config("fsdp_tp").model, Layout(dp=2, tp=2, zero=3), R.StepShape(1, 16, 2, 4, 4)
    expected = {"all_gather": {"calls": 12 + 22, "bytes": 162560 + 39680}, "all_reduce": {"calls": 6, "bytes": 646},
                "reduce_scatter": {"calls": 3 + 20, "bytes": 40640 + 20480}}
    assert all(R.rank_comm(cfg, layout, r, shape) == expected for r in range(4))
    # under FSDP2's bf16 policy the weights are gathered in bf16, their partial gradients reduced in fp32: 5 x 128 B
    bf16 = R.rank_comm(cfg, layout, 0, R.StepShape(1, 16, 2, 2, 2, param_bytes=2))
    assert bf16["all_reduce"] == {"calls": 6, "bytes": 5 * 128 + 6}


def test_dcp_checkpoint_reshards_and_loads_in_one_process(runs):
    """tp 2's checkpoint of step SAVE_AT loaded into pp 2 (DCP reshards) and into one process: the next step's loss."""
    for rank in runs["reshard"]:
        assert rank["pp_next_step"] == pytest.approx(rank["tp_next_step"], rel=1e-4)
    one = runs["reshard"][0]
    assert one["one_process_next_step"] == pytest.approx(one["tp_next_step"], rel=1e-4)


def test_expert_parallel_routes_resumes_and_reshards_as_one_process(runs):
    """ep 2 (dp 2, and dp 4 as edp 2 x ep 2, with capacity drops; beside DDP and beside FSDP2; beside tp 2, each
    expert's width split over tp): the last data-parallel rank's last forward routes as one process routes that
    micro-batch; the DCP checkpoint resumes to bit-identical losses; loaded at ep 1 (tp 2 on the same two ranks)
    and into one process, every expert and optimizer state is the checkpoint's bit for bit, each stored once, and
    the next step's loss is the ep run's."""
    for case in ("ep", "dp_ep", "ep_fsdp", "dp_ep_zero2", "tp_ep_fsdp"):
        ranks = runs[case]
        assert ranks[0]["reference_routing"] and ranks[-1]["routing"] == ranks[0]["reference_routing"]
        assert all(rank["resumed"] == rank["losses"][SAVE_AT:] for rank in ranks)
    for source in ("ep", "ep_fsdp"):
        loss = runs[source][0]["losses"][SAVE_AT]
        for rank in runs["reshard_ep"]:
            resharded = rank[source]
            assert resharded["stored_once"] and resharded["model_equal"] and resharded["optimizer_equal"]
            assert resharded["tp_next_step"] == pytest.approx(loss, rel=1e-4)
        one = runs["reshard_ep"][0][source]
        assert one["one_process_equal"] and one["one_process_next_step"] == pytest.approx(loss, rel=1e-4)


def test_ep_messages_worked_by_hand():
    """dp 2 = ep 2 ("ep": 2 MoE layers of 4 experts, top 2, d_model 32), K = 2 micro-batches of 2 x 16 tokens,
    fp32. Each rank routes 2 layers x 2 micro-batches x 32 tokens x 2 = 128 assignments in the step; say rank 0
    sent [40, 30, 50, 8] to experts 0-3 and rank 1 [20, 44, 36, 28]. Rank 0 holds experts 0 and 1: it sends
    50 + 8 = 58 rows to rank 1 and receives 20 + 44 = 64 (rank 1 the reverse), each row 32 x 4 = 128 bytes,
    once forward (dispatch, combine) and once backward (their gradients): 2 x 122 x 128 = 31232 B; and per layer
    and micro-batch one exchange of the counts (2 int64 to the other rank: 16 B): 4 x 16 = 64 B; 4 x 5 = 20
    calls. Uniform routing (64 per expert) sends 2 x 256 x 128 + 64 = 65600 B. All-reduces: DDP's one bucket
    of the dense gradients (embedding 9600 + 2 blocks x 15552 + final norm 32 = 40736 floats; 2 x 1/2 x 162944
    B) and its map of the 22 tensors each rank used (the model split: 88 B), the gradient norm (4 B) and the two
    layers' expert loads (8 floats: 32 B); the experts' gradients have no other rank to be reduced with (edp 1). dp
    4 = edp 2 x ep 2 ("dp_ep": a dense and a MoE layer, K = 1): DDP's bucket (9600 + 15424 + 15552 + 32 = 40608
    floats, 162432 B: 2 x 3/4 x 162432 = 243648 B sent) and map (21 tensors, 84 B: 126 B sent), the rank's expert
    gradients (2 experts x 3 x 32 x 128 floats = 98304 B) over edp 2 (98304 B sent), the norm (6 B) and the load
    (4 floats: 24 B)."""
    cfg, layout = config("ep").model, Layout(dp=2, ep=2)
    tokens = ((40, 30, 50, 8), (20, 44, 36, 28))
    all_reduce = {"calls": 4, "bytes": 162944 + 88 + 4 + 32}
    for rank in (0, 1):
        assert R.rank_comm(cfg, layout, rank, R.StepShape(2, 16, 2, 4, 4, expert_tokens=tokens)) == {
            "all_reduce": all_reduce, "all_to_all": {"calls": 20, "bytes": 31296}}
        assert R.rank_comm(cfg, layout, rank, R.StepShape(2, 16, 2, 4, 4))["all_to_all"] == {
            "calls": 20, "bytes": 65600}
    assert [R.expert_group(Layout(dp=4, ep=2), r) for r in range(4)] == [([0, 1], 0), ([0, 1], 1), ([2, 3], 0),
                                                                          ([2, 3], 1)]
    dp_ep = R.rank_comm(config("dp_ep").model, Layout(dp=4, ep=2), 3, R.StepShape(2, 16, 1, 4, 4))
    assert dp_ep["all_reduce"] == {"calls": 5, "bytes": 243648 + 126 + 98304 + 6 + 24}



def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_trainer_runs_tp_end_to_end_with_per_rank_verify(corpus, tmp_path):
    """`trainwise train` under torchrun with parallel.tp=2: the losses of one process, a DCP checkpoint the
    one-process API loads, and verify.json's per_rank holding each rank to the plan, comm included."""
    # no checkpoint before the measured last step: right after a DCP save rank 0's step peak read up to 12% high;
    # 7 steps, so that the peak is the median of five steps' (trainer.observer.PEAK_STEPS), not of fewer. 64 wide:
    # in some launches every measured step reads one fp32 B x T x V buffer more at its peak (76,800 bytes; which
    # thread frees a collective's buffer is gloo's scheduling: trainer.observer), +11% of the 32-wide model's
    # peak, +5.8% of this one's
    extra = ("train.eval_every=0", "train.max_steps=7", "train.micro_batch=2", "train.checkpoint_every=7",
             "model.d_model=64")
    single = tmp_path / "single"
    assert main(["train", "--out", str(single), "--quiet", *set_args(corpus, *extra)]) == 0
    run = tmp_path / "tp"
    proc = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", "-m", "trainwise", "train", "--quiet", "--out", str(run),
                           *set_args(corpus, *extra, "parallel.tp=2")], capture_output=True, text=True, timeout=300,
                          env=rank_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert losses(run) == pytest.approx(losses(single), rel=1e-4)
    assert (run / "checkpoints/step_00000007/dcp/.metadata").is_file()
    assert load(run).generate("The ", max_new_tokens=5, seed=0).startswith("The ")
    section = json.loads((run / "verify.json").read_text())["per_rank"]
    assert section["layout"] == {"dp": 1, "pp": 1, "tp": 2, "cp": 1, "ep": 1, "vpp": 1, "pp_schedule": None}
    for rank in section["ranks"]:
        for name in ("params", "grads", "optimizer"):
            assert rank[name]["error"] == 0, (name, rank[name])
        assert abs(rank["peak_memory_bytes"]["error"]) < 0.10, rank["peak_memory_bytes"]
        for kind, e in rank["comm"].items():
            assert (e["calls"]["measured"] == e["calls"]["predicted"]
                    and e["bytes"]["measured"] == e["bytes"]["predicted"]), kind
    assert main(["verify", str(run)]) == 0
    # export gathers the full weights from the DCP shards: the tensors the run's checkpoint holds, bit for bit (the
    # one-process run's are close but not equal: AdamW's step, about lr for any gradient, follows the sign of a
    # gradient near zero, which tp's other summation order can flip)
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    gathered = load(run).model.state_dict()
    assert torch.equal(exported["model.embed_tokens.weight"], gathered["embed.weight"])
    reference = load_file(single / "checkpoints/step_00000007/model.safetensors")
    torch.testing.assert_close(exported["model.embed_tokens.weight"], reference["embed.weight"], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("sets, hint", [
    (["parallel.tp=3"], "parallel.tp=2"),
    (["parallel.pp=4", "model.tie_embeddings=false", "train.grad_accum_steps=4"], "parallel.pp=2"),
    (["parallel.pp=2", "model.tie_embeddings=false", "train.micro_batch=1"], "at least 2 micro-batches per step"),
    (["parallel.pp=2", "model.tie_embeddings=false", "parallel.pp_schedule=interleaved", "parallel.vpp=2",
      "model.n_layers=4", "train.grad_accum_steps=3"], "use 4 micro-batches or parallel.vpp=1"),
    (["parallel.cp=2", "parallel.strategy=ddp"], "torchrun --nproc-per-node 2"),
    (["parallel.cp=3", "parallel.strategy=ddp"], "train.seq_len = 32 is not a multiple of 6"),
    (["parallel.cp=2", "parallel.pp=2", "parallel.strategy=ddp"], "set parallel.pp=1 (or parallel.cp=1)"),
    (["parallel.cp=2", "parallel.strategy=ddp", "model.n_experts=4", "model.top_k=2"], "dense models"),
    (["parallel.tp=2"], "torchrun --nproc-per-node 2"),
    (["parallel.pp=2", "parallel.pp_schedule=zbv", "model.n_layers=4", "train.grad_accum_steps=2"], "parallel.vpp=2"),
    (["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.vpp=2", "model.n_layers=4",
      "train.grad_accum_steps=2", "train.micro_batch=1"],
     "at least as many micro-batches per step as stages, 2 pp = 4"),
    (["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.vpp=2", "model.n_layers=4", "train.grad_accum_steps=4",
      "parallel.strategy=fsdp"], "use parallel.strategy=ddp"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_zb", "parallel.vpp=2", "model.n_layers=4",
      "train.grad_accum_steps=4", "train.compile=true"], "set train.compile=false"),
    (["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.vpp=2", "model.n_layers=4", "train.grad_accum_steps=4",
      "model.n_experts=4", "model.top_k=2"], "parallel.pp_schedule=interleaved_zb"),
    (["parallel.ep=2", "parallel.strategy=ddp"], "model.n_experts = 0"),
    (["parallel.ep=3", "parallel.strategy=ddp", "model.n_experts=4", "model.top_k=2"], "parallel.ep=2 or 4"),
    (["parallel.ep=2", "parallel.strategy=zero1", "model.n_experts=4", "model.top_k=2"], "ddp, zero2 or fsdp"),
    (["parallel.ep=2", "parallel.strategy=ddp", "model.n_experts=4", "model.top_k=2"], "torchrun --nproc-per-node 2"),
])
def test_a_layout_that_cannot_work_is_one_clear_error_before_anything_starts(corpus, tmp_path, capsys, sets, hint):
    """The trainer's own rules (runtime.mesh.check_layout) and the ones a plan shares (cost.layout.check_layout,
    in the config's names), before the run directory exists."""
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", *set_args(corpus, *sets)]) != 0
    err = capsys.readouterr().err
    assert hint in " ".join(err.split()) and "Traceback" not in err
    assert not out.exists()


def test_a_pipeline_cuts_its_micro_batches_from_the_steps_sequences():
    """parallel.pp = 2 on a run of one micro-batch of 16 sequences (the default): 2 micro-batches of 8, the
    global batch the same, and a sentence that says so; dualpipev's 2 pp; none where the sequences do not
    divide (check_layout's error then) or the micro-batches are enough already."""
    cfg = RunConfig(parallel=ParallelConfig(pp=2))
    note = pipeline_micro_batches(cfg)
    assert (cfg.train.micro_batch, cfg.train.grad_accum_steps) == (8, 2)
    assert "16 sequences run as 2 micro-batches of 8" in note
    cfg = RunConfig(parallel=ParallelConfig(pp=2, pp_schedule="dualpipev", vpp=2))
    assert pipeline_micro_batches(cfg) and (cfg.train.micro_batch, cfg.train.grad_accum_steps) == (4, 4)
    for train in (TrainConfig(micro_batch=3), TrainConfig(micro_batch=4, grad_accum_steps=2)):
        cfg = RunConfig(train=train, parallel=ParallelConfig(pp=2))
        assert pipeline_micro_batches(cfg) is None and cfg.train == train


def test_world_size_not_divisible_by_the_layout_names_one_that_works():
    with pytest.raises(TrainwiseError, match=r"6 ranks.*tp = 4 x parallel.pp = 1 = 4.*Start 4 ranks"):
        layout_for(ParallelConfig(tp=4, strategy="fsdp"), 6)
    assert layout_for(ParallelConfig(tp=2, pp=2, strategy="fsdp"), 8, micro_batches=4) == Layout(
        dp=2, pp=2, tp=2, zero=3, sequence_parallel=True, micro_batches=4, fsdp_grad_sync="step")  # the trainer's
    with pytest.raises(TrainwiseError, match=r"parallel.ep = 4 does not divide the 6 data-parallel.*Start 4 ranks"):
        layout_for(ParallelConfig(ep=4, strategy="ddp"), 6)
    assert layout_for(ParallelConfig(ep=2, strategy="ddp"), 4).expert_dp == 2
    with pytest.raises(TrainwiseError, match=r"6 ranks.*parallel.cp = 4 = 4.*Start 4 ranks.*divisor of 6 \(2, 3, 6\)"):
        layout_for(ParallelConfig(cp=4, strategy="ddp"), 6)
    with pytest.raises(TrainwiseError, match="parallel.strategy=ddp"):
        layout_for(ParallelConfig(cp=2), 2)
    assert layout_for(ParallelConfig(cp=2, strategy="fsdp"), 4) == Layout(dp=2, cp=2, zero=3, cp_impl="allgather",
                                                                           fsdp_grad_sync="step")


def test_a_mixture_of_experts_model_passes_the_check_under_pipeline_parallelism():
    """moe_pp trains as one process does (test_losses_equal_one_process_with_the_same_global_batch): the trainer
    lets it start."""
    check_layout(config("moe_pp"))


def test_heads_not_divisible_by_tp_names_the_numbers():
    cfg = RunConfig(model=ModelConfig(n_heads=8, n_kv_heads=2), parallel=ParallelConfig(tp=4))
    with pytest.raises(TrainwiseError, match="parallel.tp = 4 does not divide model.n_kv_heads = 2.*parallel.tp=2"):
        check_layout(cfg)
