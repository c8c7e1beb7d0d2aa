"""Mixture-of-Experts in the cluster step: the grouped expert GEMMs and the dispatch as their own terms, and
the most loaded expert-parallel rank under imbalanced routing (--moe-imbalance)."""

import json
from dataclasses import replace

import pytest
from runs import run_of

from trainwise.cli import main
from trainwise.config import ModelConfig
from trainwise.cost.cluster import dispatch_copies
from trainwise.cost.layout import Layout, make_layout
from trainwise.cost.rank_memory import stage_activation_bytes
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import MOE_IMBALANCE, Run
from trainwise.errors import TrainwiseError
from trainwise.planner.plan import plan_run
from trainwise.verify.per_rank import received_routing

MOE = ModelConfig(name="moe-plan", vocab_size=32000, d_model=1024, n_layers=4, n_heads=16, n_kv_heads=4,
                  ffn_hidden=2816, n_experts=16, top_k=2, expert_ffn_hidden=704, max_seq_len=4096)


def plan(**kw):
    return plan_run(run_of(MOE, tokens=1e9, seq_len=4096, micro_batch=1, grad_accum=8, gpus=16, ep=8, zero=1,
                           precision="bf16-mixed", gpu="h100-sxm", **kw))


def test_the_most_loaded_rank_sets_the_pace():
    """The breakdown sums to the step; balanced routing adds nothing; at imbalance 1.5 the most loaded rank's
    expert GEMMs and dispatch take half as long again, and nothing else moves; unless told, routing is planned
    as trained models route (cost.run.MOE_IMBALANCE), between the two."""
    even, skewed, default = plan(moe_imbalance=1.0), plan(moe_imbalance=1.5), plan()
    for p in (even, skewed):
        assert sum(p.cluster.breakdown.values()) == pytest.approx(p.step_seconds)
    b, s = even.cluster.breakdown, skewed.cluster.breakdown
    assert b["experts_s"] > 0 and b["ep_comm_s"] > 0 and b["imbalance_s"] == 0
    assert s["imbalance_s"] == pytest.approx(0.5 * (b["experts_s"] + b["ep_comm_s"]))
    assert {k: v for k, v in s.items() if k not in ("imbalance_s", "bubble_s")} == pytest.approx(
        {k: v for k, v in b.items() if k not in ("imbalance_s", "bubble_s")})
    assert skewed.step_seconds > even.step_seconds
    assert default.run.moe_imbalance == MOE_IMBALANCE and 1 < MOE_IMBALANCE < 1.5
    assert default.cluster.breakdown["imbalance_s"] == pytest.approx(
        (MOE_IMBALANCE - 1) * (b["experts_s"] + b["ep_comm_s"]))
    # a dense model has no expert terms
    dense = plan_run(run_of(ModelConfig(name="dense", vocab_size=32000, d_model=1024, n_layers=4, n_heads=16,
                                        n_kv_heads=4, max_seq_len=4096), tokens=1e9, seq_len=4096, gpus=8,
                            gpu="h100-sxm"))
    assert dense.cluster.breakdown["experts_s"] == dense.cluster.breakdown["imbalance_s"] == 0


def test_a_capacity_factor_caps_the_most_loaded_rank(capsys):
    """A model that drops what exceeds each expert's capacity (model.dropless false) holds the most loaded rank
    to capacity_factor x the mean, whatever the routing: 1.5 routed at a factor of 1.25 waits for 1.25, and a
    routing under the factor is unchanged."""
    capped = replace(MOE, dropless=False, capacity_factor=1.25)
    even = plan_run(run_of(capped, tokens=1e9, seq_len=4096, micro_batch=1, grad_accum=8, gpus=16, ep=8, zero=1,
                           precision="bf16-mixed", gpu="h100-sxm", moe_imbalance=1.0)).cluster.breakdown
    for routed, waits in ((1.5, 1.25), (1.1, 1.1)):
        b = plan_run(run_of(capped, tokens=1e9, seq_len=4096, micro_batch=1, grad_accum=8, gpus=16, ep=8, zero=1,
                            precision="bf16-mixed", gpu="h100-sxm", moe_imbalance=routed)).cluster.breakdown
        assert b["imbalance_s"] == pytest.approx((waits - 1) * (even["experts_s"] + even["ep_comm_s"]))
        assert b["ep_comm_s"] == pytest.approx(even["ep_comm_s"])


def test_node_limited_routing_sends_one_copy_per_node_reached():
    """DeepSeek-V3's group-limited routing with the groups over the nodes the ep group spans
    (cost.cluster.dispatch_copies): the dispatch sends a token once per node it can reach (at most
    router_group_top_k nodes, twice that where each group spans two nodes, never more than top_k); inside one
    node, or without groups, once per routed expert."""
    dsv3_like = replace(MOE, top_k=8, router_groups=8, router_group_top_k=4)
    assert [dispatch_copies(dsv3_like, nodes) for nodes in (1, 2, 4, 8, 16)] == [8, 2, 4, 4, 8]
    assert dispatch_copies(MOE, 8) == MOE.top_k

    def sent(cfg, ep):
        p = plan_run(run_of(cfg, tokens=1e9, seq_len=4096, micro_batch=1, grad_accum=8, gpus=16, ep=ep, zero=1,
                            precision="bf16-mixed", gpu="h100-sxm"))
        return p.cluster.comm["all_to_all"]
    grouped = replace(MOE, router_groups=4, router_group_top_k=1)  # top_k 2, one group: one node of two
    across, one_node = sent(grouped, 16), sent(grouped, 8)
    assert across["calls"] == sent(MOE, 16)["calls"] and across["bytes"] == pytest.approx(sent(MOE, 16)["bytes"] / 2)
    assert one_node == sent(MOE, 8)


def test_an_allgather_dispatch_gathers_every_token_and_reduce_scatters_in_fp32():
    """--ep-dispatch allgather (Megatron-Core's allgather dispatcher): per MoE layer and pass every token of the
    tp x ep ranks all-gathered and the outputs reduce-scattered, one of the two in the activations' bf16 and the
    other in fp32 (forward: gather bf16, combine fp32; backward the reverse), no all-to-all; the most loaded rank
    computes more but receives what every rank does."""
    def step(dispatch, imbalance):
        return plan_run(run_of(MOE, tokens=1e9, seq_len=4096, micro_batch=1, grad_accum=8, gpus=16, ep=8, zero=0,
                               precision="bf16-mixed", gpu="h100-sxm", ep_dispatch=dispatch,
                               moe_imbalance=imbalance)).cluster
    gathered = step("allgather", 1.0)
    act = 4096 * MOE.d_model * 2  # one micro-batch's tokens x H in bf16
    # each kind per layer and micro-batch: (n - 1) / n of the 8 ranks' tokens, in bf16 in one pass, fp32 in the other
    per_layer = 7 / 8 * 8 * act * (1 + 2)
    for kind in ("all_gather", "reduce_scatter"):
        assert gathered.comm[kind]["calls"] == 8 * MOE.n_layers * 2
        assert gathered.comm[kind]["bytes"] == pytest.approx(8 * MOE.n_layers * per_layer)
    assert "all_to_all" not in gathered.comm and "all_to_all" in step("alltoall", 1.0).comm
    b, skewed = gathered.breakdown, step("allgather", 1.5).breakdown
    assert skewed["imbalance_s"] == pytest.approx(0.5 * b["experts_s"]) and skewed["ep_comm_s"] == b["ep_comm_s"]
    with pytest.raises(TrainwiseError, match="--ep-dispatch 'scatter' must be one of alltoall, allgather"):
        make_layout(16, ep=8, ep_dispatch="scatter")
    with pytest.raises(TrainwiseError, match="--ep-overlap hides the expert-parallel all-to-alls"):
        make_layout(16, ep=8, ep_dispatch="allgather", ep_overlap=True)


def test_imbalance_below_one_is_refused():
    with pytest.raises(TrainwiseError, match="at least 1"):
        plan(moe_imbalance=0.8)


def test_explain_and_json_show_the_moe_terms(capsys):
    args = ["plan", "--model", "qwen3-30b-a3b", "--gpu", "h100-sxm", "--gpus", "16", "--pp", "2", "--ep", "8",
            "--zero", "1", "--seq-len", "4096", "--micro-batch", "2", "--grad-accum", "32", "--precision", "fp8",
            "--moe-imbalance", "1.2"]
    assert main(args + ["--explain"]) == 0
    out = capsys.readouterr().out
    for term in ("experts    = m x grouped GEMMs of the rank's 16 experts", "ep comm    = m x (all-to-all dispatch",
                 "imbalance  = m x (1.2 - 1)", "the most loaded expert-parallel rank's experts keep 1.2 x the mean's "
                 "routed copies (--moe-imbalance)"):
        assert term in out
    assert main(args + ["--json"]) == 0
    b = json.loads(capsys.readouterr().out)["time"]["breakdown"]
    assert b["experts_s"] > 0 and b["ep_comm_s"] > 0 and b["imbalance_s"] > 0


def test_experts_fold_onto_the_tensor_and_data_parallel_ranks():
    """Megatron-Core's MoE parallel folding: etp x ep x edp over the same tp x cp x dp ranks. EP may exceed dp
    when the experts' tensor parallelism (etp) is below tp; each rank then holds E / ep whole-width experts,
    reduces their gradients over edp ranks, and the ep group's neighbours are etp ranks apart."""
    from trainwise.cost.layout import check_layout, make_layout, placement
    from trainwise.cost.rank import is_expert, rank_params

    folded, plain = make_layout(16, tp=2, ep=8, etp=1), make_layout(16, tp=2, ep=4)
    assert (folded.expert_tp, folded.expert_dp, plain.expert_tp, plain.expert_dp) == (1, 2, 2, 2)
    check_layout(MOE, folded, 4096)
    with pytest.raises(TrainwiseError, match="--etp"):
        check_layout(MOE, make_layout(16, tp=2, ep=16), 4096)  # 16 x 2 does not divide tp x dp = 16

    def experts(lay):
        return sum(p.numel for p in rank_params(MOE, lay, 0) if is_expert(p.spec))

    width = 3 * MOE.d_model * MOE.expert_ffn_hidden  # gate, up and down of one expert, one layer
    assert experts(folded) == MOE.n_layers * MOE.n_experts // 8 * width
    assert experts(plain) == MOE.n_layers * MOE.n_experts // 4 * width // 2
    assert placement(folded, "ep", 8).stride == 1 and placement(plain, "ep", 8).stride == 2
    # the same expert FLOPs per rank either way (tokens x etp / tp, width / etp): the plans differ in the dispatch
    a, b = plan(), plan_run(run_of(MOE, tokens=1e9, seq_len=4096, micro_batch=1, grad_accum=8, gpus=16, tp=2, ep=8,
                                   etp=1, zero=1, precision="bf16-mixed", gpu="h100-sxm"))
    assert a.cluster.breakdown["experts_s"] > 0 and b.cluster.breakdown["experts_s"] > 0


def test_overlapped_dispatch_hides_under_the_micro_batch_work():
    """--ep-overlap: each micro-batch's all-to-alls run under the other micro-batch's work, so only what
    exceeds one micro-batch's operators is exposed; nothing else in the step moves. On a slow network (the
    dispatch longer than the work) the excess remains; on a fast one it is all hidden. (Routing balanced: the
    most loaded rank's extra would scale the dispatch left exposed.)"""
    for intra in (1e9, 900e9):
        plain, over = (plan(intra_node_bw=intra, moe_imbalance=1.0),
                       plan(intra_node_bw=intra, ep_overlap=True, moe_imbalance=1.0))
        b, o = plain.cluster.breakdown, over.cluster.breakdown
        m = plain.layout.micro_batches
        work = plain.cluster.stage_seconds[0] - b["ep_comm_s"] / m  # one micro-batch's operators (pp 1)
        assert o["ep_comm_s"] == pytest.approx(m * max(0.0, b["ep_comm_s"] / m - work))
        assert {k: v for k, v in o.items() if k != "ep_comm_s"} == pytest.approx(
            {k: v for k, v in b.items() if k != "ep_comm_s"})
    assert b["ep_comm_s"] > 0 and o["ep_comm_s"] == 0  # the fast network: all hidden
    slow = plan(intra_node_bw=1e9, ep_overlap=True).cluster.breakdown["ep_comm_s"]
    assert slow > 0


def test_a_fused_stack_moves_less_element_wise_traffic(capsys):
    """--fused prices a bf16-mixed run's element-wise work as Transformer Engine's kernels run it (the
    megatron and FP8 recipes and compiled runs are fused already): less compute, the same GEMMs and
    collectives; --no-fused prices an FP8 run eager. --explain says which."""
    eager, fused = plan(), plan(fused=True)
    assert fused.cluster.breakdown["compute_s"] < 0.9 * eager.cluster.breakdown["compute_s"]
    assert fused.cluster.breakdown["experts_s"] == pytest.approx(eager.cluster.breakdown["experts_s"])
    assert fused.cluster.breakdown["ep_comm_s"] == pytest.approx(eager.cluster.breakdown["ep_comm_s"])
    fp8 = plan_run(run_of(MOE, tokens=1e9, seq_len=4096, micro_batch=1, grad_accum=8, gpus=16, ep=8, zero=1,
                          precision="fp8", gpu="h100-sxm", fused=False))
    assert not fp8.cluster.fused and fused.cluster.fused
    args = ["plan", "--model", "qwen3-30b-a3b", "--gpu", "h100-sxm", "--gpus", "16", "--ep", "8", "--zero", "1",
            "--seq-len", "4096", "--micro-batch", "1", "--grad-accum", "4", "--precision", "bf16-mixed", "--explain"]
    for flag, word in (([], "element-wise work eager"), (["--fused"], "element-wise work fused")):
        assert main(args + flag) == 0
        assert word in capsys.readouterr().out


def test_the_most_loaded_rank_keeps_its_extra_routed_copies():
    """Memory under imbalance, worked by hand on MOE (4 MoE layers, top 2, H 1024, expert width 704, gated),
    bf16-mixed (c = 2), one micro-batch of 4096 tokens: at imbalance 1.5 a stage of the 4 layers keeps half a
    mean rank's routed copies more, 0.5 x 2 copies x 4096 tokens x 4 layers x (each copy's grouped input 2H and
    its expert's gate|up and product 3 x 2 x 704). Under trainwise's tp 2 the expert's width is split and its
    input is whole; Megatron-Core's folded experts (sequence parallel, etp 1) route T / tp positions a rank: both
    halve. A capacity factor caps the rank (model.dropless false); full checkpointing keeps no expert's copies;
    without expert parallelism every rank computes its own routing."""
    rec = get_recipe("bf16-mixed")

    def extra(layout, imbalance, megatron=False, model=MOE, checkpointing="none"):
        def saved(imb):
            run = Run(model, micro_batch=1, seq_len=4096, recipe=rec, layout=layout, moe_imbalance=imb,
                      checkpointing=checkpointing)
            return stage_activation_bytes(run, range(4), True, True, rec, False, megatron)
        return saved(imbalance) - saved(1.0)

    grouped, mlp, copies = 2 * 1024, 3 * 2 * 704, 0.5 * 2 * 4096 * 4
    assert extra(Layout(dp=2, ep=2), 1.5) == pytest.approx(copies * (grouped + mlp), abs=1)
    assert extra(Layout(dp=2, tp=2, ep=2), 1.5) == pytest.approx(copies * (grouped + mlp / 2), abs=1)
    folded = Layout(dp=2, tp=2, ep=2, etp=1, sequence_parallel=True)
    assert extra(folded, 1.5, megatron=True) == pytest.approx(copies * (grouped + mlp) / 2, abs=1)
    capped = replace(MOE, dropless=False, capacity_factor=1.25)
    assert extra(Layout(dp=2, ep=2), 2.0, model=capped) == pytest.approx(copies / 2 * (grouped + mlp), abs=1)
    assert extra(Layout(dp=2, ep=2), 1.5, checkpointing="full") == 0
    assert extra(Layout(dp=4), 1.5) == 0
    # the plan's activations and its step peak carry it, and --explain says so
    even, skewed = plan(moe_imbalance=1.0), plan(moe_imbalance=1.5)
    assert skewed.activations_bytes > even.activations_bytes and skewed.peak_bytes > even.peak_bytes


def test_per_rank_verify_plans_each_rank_at_the_copies_it_received():
    """verify's per-rank plan under expert parallelism evaluates each rank's memory at the routing the run
    measured: dp 2 = ep 2, rank 0 routed [40, 30, 50, 8] to experts 0-3 and rank 1 [20, 44, 36, 28]; rank 0
    holds experts 0 and 1 and received 40 + 30 + 20 + 44 = 134 of the group's 256 (mean 128: 1.046875), rank 1
    122 (0.953125); unmeasured, the planner's default."""
    run = Run(replace(MOE, n_experts=4), layout=Layout(dp=2, ep=2))
    tokens = ((40, 30, 50, 8), (20, 44, 36, 28))
    assert [received_routing(run, r, tokens).moe_imbalance for r in (0, 1)] == [134 / 128, 122 / 128]
    assert received_routing(run, 0, None).moe_imbalance == MOE_IMBALANCE
