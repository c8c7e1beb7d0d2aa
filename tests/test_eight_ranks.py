"""Tensor, pipeline, data and expert parallelism together: tp 2 x pp 2 x dp 2 (DDP on the mesh, tied embeddings; a
dense first layer and two MoE layers whose experts are divided over the two replicas, ep 2, each expert's width over
tp) on 8 ranks under torchrun on gloo. Each rank's losses are one process's on the same global batch, the DCP
checkpoint of step SAVE_AT resumes to the same losses, every rank holds and sends what trainwise.cost.rank plans
(its peak within 10%), and the tied table's four copies of each tp shard (first and last stage, both dp replicas)
stay bit-equal.

Its own launch: the cases of tests/test_tp_pp.py run on 2 or 4 ranks; this is the layout that needs 8 (about 25 s on
2 cores, one thread per rank), so it trains alone. The hand-worked messages are the dense tp_pp_dp's."""

from __future__ import annotations

import pytest
from test_tp_pp import _launch, assert_ranks_as_planned, plan
from tp_pp_worker import SAVE_AT, STEPS, config

from trainwise.cost import rank as R
from trainwise.cost.layout import Layout

CASE, WORLD = "tp_pp_ep", 8
CASES = [CASE]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """The 8 ranks' results of one launch (test_tp_pp._launch: OMP_NUM_THREADS=1 per rank)."""
    return _launch(WORLD, tmp_path_factory.mktemp("eight"), CASES, timeout=420)


@pytest.fixture
def ranks(runs) -> list[dict]:
    return runs[CASE]


@pytest.mark.parametrize("case", CASES)
def test_losses_equal_one_process_with_the_same_global_batch(runs, case):
    """fp32, STEPS steps: every rank's losses within 1e-4 of one process's on the same dp x K micro-batches."""
    ranks = runs[case]
    reference = ranks[0]["reference"]
    assert len(reference) == STEPS
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference, rel=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_the_mid_run_checkpoint_resumes_to_the_same_losses(runs, case):
    """A fresh model of the same layout loads the DCP checkpoint of step SAVE_AT: the steps after it are the
    straight run's, bit for bit."""
    for rank in runs[case]:
        assert rank["resumed"] == rank["losses"][SAVE_AT:]


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_and_sends_what_the_plan_says(runs, case):
    """params, grads and optimizer bytes and every collective's calls and bytes equal cost.rank's plan for each
    of the 8 ranks (the MoE case's all-to-alls at the routing it measured); the step's peak within 10% of the
    plan's (the least of the worker's MEASURED steps)."""
    ranks = runs[case]
    assert_ranks_as_planned(ranks, plan(case, WORLD, [rank["measured"].get("expert_tokens") for rank in ranks]))


def test_tied_copies_stay_bit_equal_and_the_checkpoint_loads_in_one_process(ranks):
    """Every rank is on a pipeline end: ranks 0-3 hold the embedding, 4-7 the LM head's copy, each a tp shard
    (the worker digests the whole table, gathered over tp). All 8 digests are equal after STEPS steps, straight
    and resumed: the tied all-reduce (rank i with rank i + 4) and replicate's over dp leave every copy the same
    bits. The DCP checkpoint of step SAVE_AT gathered into one process gives step SAVE_AT's loss."""
    digests = {rank[key] for rank in ranks for key in ("tied", "tied_resumed")}
    assert len(digests) == 1 and None not in digests
    assert ranks[0]["one_process_at_save"] == pytest.approx(ranks[0]["losses"][SAVE_AT], rel=1e-5)


def test_tp_pp_dp_messages_worked_by_hand():
    """tp 2 x pp 2 x dp 2, DDP, tied, 2 micro-batches of 1 x 16 positions, d_model 32, vocab 300, fp32. Rank =
    (pp_rank x dp + dp_rank) x tp + tp_rank: ranks 0-3 are stage 0, 4-7 stage 1. Tensor and pipeline messages do
    not depend on dp: those of test_tp_pp's pp_tp case (untied there; tying adds no tp or pp message). The
    all-reduces, with bytes sent over n ranks 2 x (n - 1)/n x S:
      stage 0: block 0's two norm weights' partial gradients over tp (128 B each: 256 B), the gradient norm over
               8 ranks (2 x 7/8 x 4 = 7 B), the loss over pp (4 B), the rank's share of the tied table (150 x 32
               x 4 = 19200 B) with its copy on rank + 4 (19200 B), and replicate's one all-reduce per unit over
               dp 2: the embedding share (19200 B) and block 0 (7744 floats: 30976 B): 7 calls, 69643 B;
      stage 1: 3 norms (384 B), 7 B, 4 B, the tied copy 19200 B, and the units block 1 (30976 B) and the final
               norm with the head's copy (32 + 4800 floats: 19328 B): 8 calls, 69899 B."""
    cfg, layout, shape = config("tp_pp_dp").model, Layout(tp=2, pp=2, dp=2), R.StepShape(1, 16, 2, 4, 4)
    assert [layout.coords(r) for r in (0, 3, 4, 7)] == [(0, 0, 0), (1, 0, 1), (0, 1, 0), (1, 1, 1)]
    tp_pp_first = {"all_gather": {"calls": 10, "bytes": 10240}, "reduce_scatter": {"calls": 10, "bytes": 10240},
                   "send_recv": {"calls": 4, "bytes": 2048}}
    tp_pp_last = {**tp_pp_first, "all_gather": {"calls": 12, "bytes": 29440}}
    first = {**tp_pp_first, "all_reduce": {"calls": 7, "bytes": 256 + 7 + 4 + 19200 + 19200 + 30976}}
    last = {**tp_pp_last, "all_reduce": {"calls": 8, "bytes": 384 + 7 + 4 + 19200 + 30976 + 19328}}
    assert [R.rank_comm(cfg, layout, r, shape) for r in range(8)] == [first] * 4 + [last] * 4
