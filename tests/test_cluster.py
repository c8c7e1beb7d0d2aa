"""The cluster model (cost.layout, cost.comm's collectives, cost.gpu, cost.cluster, planner.cluster_step) with
numbers worked by hand: the pipeline's bubble and stages, each collective's time, where a group's ranks
sit, per-rank memory under TP, SP, PP and CP, the plan's JSON, the layouts that cannot work, `plan --fit`
over layouts, and a few published runs of the development set (benchmarks/cluster_model.py has all 18)."""

import json
import math
from dataclasses import replace

import pytest
from runs import run_of

import trainwise
from trainwise.cli import main
from trainwise.config import ModelConfig, ParallelConfig
from trainwise.cost import comm as C
from trainwise.cost import memory as M
from trainwise.cost.cluster import BREAKDOWN, IN_STEP, _tier
from trainwise.cost.gpu import (GEMM_K_OVERHEAD, GEMM_LAUNCH_S, attention_rate, copy_bandwidth, matmul_rate,
                                matmul_seconds)
from trainwise.cost.layout import Layout, make_layout, param_counts, placement
from trainwise.cost.ops import WEIGHT_CAST
from trainwise.cost.rank import StepShape, rank_comm, rank_params
from trainwise.cost.rank_memory import fsdp_block_backward, layer_bytes_per_token, rank_peak
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.cost.schedule import (bubble_fraction, chunk_layers, in_flight, rank_stages, schedule_seconds,
                                     stage_layers)
from trainwise.errors import TrainwiseError
from trainwise.hardware.table import ACCELERATORS, NODES, lookup_cuda_device
from trainwise.planner.derivation import explain_cluster, explain_plan, plan_table
from trainwise.planner.layouts import fit_run_layouts
from trainwise.planner.plan import plan_run

A100, DGX = ACCELERATORS["a100-80gb"], NODES["dgx-a100"]


def gpt(heads: int, hidden: int, layers: int, **kw) -> ModelConfig:
    """Megatron-LM's GPT: learned positions, LayerNorm, GELU, FFN 4h, biases, dropout 0.1, vocab 51,200."""
    return ModelConfig(**{**dict(name=f"gpt-h{hidden}", vocab_size=51200, d_model=hidden, n_layers=layers,
                                 n_heads=heads, n_kv_heads=heads, ffn_hidden=4 * hidden, activation="gelu",
                                 norm="layernorm", position="learned", bias=True, dropout=0.1, max_seq_len=2048,
                                 tie_embeddings=True), **kw})


def test_pipeline_bubble_stages_and_micro_batches_in_flight():
    assert bubble_fraction(8, 1, 32) == 7 / 32  # (p - 1) / m
    assert bubble_fraction(8, 3, 32) == 7 / 96  # (p - 1) / (v m)
    assert chunk_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B: one layer fewer on the first and last
    assert chunk_layers(10, 4) == [2, 3, 3, 2]
    def per_rank(n_layers: int, pp: int, vpp: int) -> list[int]:  # layers each pipeline rank holds
        lay = make_layout(pp, pp=pp, vpp=vpp)
        return [sum(len(stage_layers(n_layers, lay.stages, st)) for st in rank_stages(lay, r)) for r in range(pp)]

    assert per_rank(96, 8, 3) == [12] * 8 and per_rank(10, 2, 2) == [5, 5]
    def chunks_in_flight(pp: int, vpp: int, k: int) -> int:  # on the first rank, at its fullest
        lay = make_layout(pp, pp=pp, vpp=vpp, micro_batches=k)
        return max(len(live) for live, _ in in_flight(lay, 0, k))

    assert chunks_in_flight(8, 1, 64) == 8 and chunks_in_flight(8, 1, 3) == 3
    # interleaved: 8 (1 + 7/24) micro-batches of 3 chunks each (Korthikanti et al. 2022, section 4.2.3)
    assert chunks_in_flight(8, 3, 64) == 8 * 3 * (1 + 7 / 24)



@pytest.mark.parametrize("pp, vpp, m", [(2, 1, 4), (4, 1, 8), (8, 1, 32), (4, 2, 8), (8, 2, 32), (4, 4, 16)])
def test_the_schedules_orders_run_against_each_other_give_the_published_bubbles(pp, vpp, m):
    # each rank's forward 1 s and backward 2 s per micro-batch: the published (p - 1) / (v m) x m x 3 s comes
    # back from torch's own orders for 1F1B, GPipe and interleaved 1F1B
    for schedule in (("interleaved",) if vpp > 1 else ("1f1b", "gpipe")):
        lay = make_layout(pp, pp=pp, vpp=vpp, micro_batches=m, pp_schedule=schedule)
        assert schedule_seconds(lay, [1.0] * pp, [2.0] * pp) - 3 * m == pytest.approx(
            bubble_fraction(pp, vpp, m) * 3 * m)


def test_zero_bubble_schedules_leave_one_stage_forward_idle():
    # pp 2, two stages a rank, 4 micro-batches of 1 s forward and 2 s backward a rank: a stage's forward takes
    # 0.5 s, its input- and weight-gradient halves 0.5 s each. The second rank waits for the first stage's
    # first forward and is never idle after: 0.5 + 4 x 3 = 12.5 s, where 1F1B interleaved takes 13.5 s
    for schedule in ("interleaved_zb", "zbv", "dualpipev"):
        lay = make_layout(2, pp=2, vpp=2, micro_batches=4, pp_schedule=schedule)
        assert schedule_seconds(lay, [1.0, 1.0], [2.0, 2.0]) == pytest.approx(12.5)
    lay = make_layout(2, pp=2, vpp=2, micro_batches=4)
    assert schedule_seconds(lay, [1.0, 1.0], [2.0, 2.0]) == pytest.approx(12 + 1.5)
    # a slow rank: the step is at least its own work, and a zero-bubble order hides the fast rank's waiting
    lay = make_layout(4, pp=4, vpp=2, micro_batches=8, pp_schedule="zbv")
    assert schedule_seconds(lay, [2.0, 1, 1, 1], [4.0, 2, 2, 2]) >= 8 * 6


def test_a_zero_bubble_plan_prices_its_schedule_and_its_v(capsys):
    cfg = gpt(8, 256, 8, max_seq_len=256, dropout=0.0)  # tied: the V holds both ends on rank 0
    plans = {s: plan_run(run_of(cfg, tokens=1e9, seq_len=256, micro_batch=2, grad_accum=8, gpus=4, pp=4, vpp=2,
                                gpu="h100", pp_schedule=s)).to_json() for s in ("interleaved", "zbv", "dualpipev")}
    bubble = {s: j["time"]["breakdown"]["bubble_s"] for s, j in plans.items()}
    assert 0 <= bubble["zbv"] < bubble["interleaved"] and bubble["dualpipev"] < bubble["interleaved"]
    ops = {s: {o["op"] for o in j["time"]["ops"]} for s, j in plans.items()}
    assert "nccl all_reduce (tied embedding)" in ops["interleaved"] and "nccl all_reduce (tied embedding)" not in \
        ops["zbv"]
    assert plans["zbv"]["layout"]["pp_schedule"] == "zbv"
    # the slowest rank under a V is rank 0 (embedding, LM head and its layers), two sends each way per micro-batch
    assert plans["zbv"]["comm"]["send_recv"]["calls"] == 8 * 4
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--pp", "4", "--global-batch", "16",
            "--seq-len", "4096", "--tokens", "1e12", "--pp-schedule", "zbv"]
    assert main(argv) == 2
    assert "use --vpp 2" in capsys.readouterr().err
    assert main(argv + ["--vpp", "2", "--explain"]) == 0
    assert "the zbv schedule's orders run against each other" in capsys.readouterr().out


def test_v_schedules_take_micro_batches_that_pp_does_not_divide():
    """torch's zbv and dualpipev run any count of micro-batches (dualpipev at least 2 pp, zbv at least pp), where
    the interleaved schedules keep Megatron-LM's multiple of pp: DeepSeek-V3's 120 micro-batches on 16 stages."""
    cfg = gpt(8, 256, 8, max_seq_len=256, dropout=0.0)
    args = dict(tokens=1e9, seq_len=256, micro_batch=2, gpus=4, pp=4, vpp=2, gpu="h100")
    for schedule in ("zbv", "dualpipev"):
        ten, eight = (plan_run(run_of(cfg, grad_accum=k, pp_schedule=schedule, **args)) for k in (10, 8))
        j = ten.to_json()
        # a V whose passes take about as long as each other has next to no bubble (ZB-V's zero): >= 0, not > 0
        assert j["layout"]["micro_batches"] == 10 and j["time"]["breakdown"]["bubble_s"] >= 0
        assert ten.step_seconds > eight.step_seconds  # the two micro-batches more are run, not rounded away
    with pytest.raises(TrainwiseError, match="multiple of pp = 4"):
        plan_run(run_of(cfg, grad_accum=10, **args))
    with pytest.raises(TrainwiseError, match="zbv schedule needs at least as many micro-batches per step as"):
        plan_run(run_of(cfg, grad_accum=3, pp_schedule="zbv", **args))


def test_overlapped_pipeline_sends_leave_the_warm_up_and_cool_down_exposed(capsys):
    """--pp-overlap (Megatron-Core's overlap_p2p_comm): in the interleaved schedule a rank's sends run under the
    neighbouring chunks' work but in its warm-up forwards and cool-down backwards. The slowest rank here is the
    last (the LM head): (vpp - 1) x pp + 2 x (pp - 1 - 3) = 4 warm-up forwards of its 8 x 2 = 16, so a quarter
    of its sends are waited on. The bytes sent are the same; 1F1B has no overlap to take."""
    cfg = gpt(8, 256, 8, max_seq_len=256, dropout=0.0)

    def plan(**kw):
        return plan_run(run_of(cfg, tokens=1e9, seq_len=256, micro_batch=2, grad_accum=8, gpus=4, pp=4,
                               gpu="h100", **kw))

    plain, over = plan(vpp=2), plan(vpp=2, pp_overlap=True)
    b, o = plain.cluster.breakdown, over.cluster.breakdown
    assert b["pp_p2p_s"] > 0 and o["pp_p2p_s"] == pytest.approx(b["pp_p2p_s"] * 4 / 16)
    assert over.cluster.comm == plain.cluster.comm and over.to_json()["layout"]["pp_overlap"]
    assert {k: v for k, v in o.items() if k not in ("pp_p2p_s", "bubble_s")} == pytest.approx(
        {k: v for k, v in b.items() if k not in ("pp_p2p_s", "bubble_s")})
    assert o["bubble_s"] < b["bubble_s"]  # the mean rank's micro-batch is shorter too
    assert plan(pp_overlap=True).cluster.breakdown == plan().cluster.breakdown  # 1F1B: all exposed
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100", "--gpus", "8", "--pp", "4", "--vpp", "2",
            "--global-batch", "16", "--seq-len", "4096", "--tokens", "1e12", "--explain"]
    assert main(argv + ["--pp-overlap"]) == 0
    assert "the warm-up's and cool-down's only (--pp-overlap)" in capsys.readouterr().out

def test_hsdp_shards_within_a_group_and_all_reduces_each_shard_over_the_replicas(capsys):
    """--dp-shard (HSDP, FSDP2's replicate x shard): 16 GPUs on two 8-GPU nodes, shard groups of 8 (one node
    each, the gathers on NVLink), 2 replicas. Each rank holds what FSDP on 8 GPUs holds; its gathers and
    reduce-scatters are those of FSDP over 8; after each reduce-scatter its fp32 shard is all-reduced with the
    other node's (2 ranks: a ring all-reduce sends the buffer once): m x 4 bytes x params / 8 in all, each
    micro-batch's gradients reduce-scattered as torchtitan's FSDP2 does (--fsdp-grad-sync micro-batch)."""
    cfg = gpt(8, 256, 4, max_seq_len=256, dropout=0.0, tie_embeddings=False)
    lay = make_layout(16, zero=3, dp_shard=8)
    assert (lay.shard, lay.replicas, lay.to_json()["dp_shard"]) == (8, 2, 8)
    assert placement(lay, "dp_shard", 8) == placement(make_layout(8, zero=3), "dp", 8)  # one node, stride 1
    assert (placement(lay, "dp_replicate", 8).nodes, placement(lay, "dp_replicate", 8).stride) == (2, 8)

    def plan(gpus, **kw):
        return plan_run(run_of(cfg, tokens=1e9, seq_len=256, micro_batch=2, grad_accum=2, gpus=gpus, zero=3,
                               gpu="h100", precision="amp", fsdp_grad_sync="micro-batch", **kw)).to_json()

    hsdp, fsdp8, fsdp16 = plan(16, dp_shard=8), plan(8), plan(16)
    states = ("params_bytes", "grads_bytes", "optimizer_bytes")
    assert [hsdp["memory"][k] for k in states] == [fsdp8["memory"][k] for k in states]
    assert [2 * fsdp16["memory"][k] for k in states] == pytest.approx([hsdp["memory"][k] for k in states], rel=1e-3)
    for kind in ("all_gather", "reduce_scatter"):
        assert hsdp["comm"][kind] == fsdp8["comm"][kind]
    loss = fsdp16["comm"]["all_reduce"]  # the loss's scalar, as FSDP's
    extra = {k: hsdp["comm"]["all_reduce"][k] - loss[k] for k in ("calls", "bytes")}
    n = sum(p.numel for p in rank_params(cfg, make_layout(1), 0))
    assert extra["calls"] == 2 * (cfg.n_layers + 1)  # each block and the roots, each micro-batch
    assert extra["bytes"] == pytest.approx(2 * 4 * n / 8, rel=1e-6, abs=16)
    assert hsdp["time"]["breakdown"]["dp_comm_s"] >= fsdp8["time"]["breakdown"]["dp_comm_s"]
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100", "--gpus", "16", "--global-batch", "32", "--seq-len",
            "4096", "--tokens", "1e12", "--dp-shard", "8"]
    assert main(argv + ["--zero", "3", "--explain"]) == 0
    assert "HSDP: sharded over 8 x cp data-parallel ranks, 2 replicas" in capsys.readouterr().out
    for bad, hint in ((["--zero", "1"], "add --zero 3"), (["--zero", "3", "--dp-shard", "3"], "must divide the 16")):
        assert main(argv + bad) == 2
        assert hint in capsys.readouterr().err


def test_fsdp2_copies_each_gather_out_and_each_reduce_scatter_in_on_the_compute_stream():
    """ZeRO-3 as FSDP2 runs it: per micro-batch each block's gathered parameters copied out twice (forward and
    backward's gathers) and its gradients copied into the reduce-scatter's input once, the roots' once each;
    worked by hand under amp (gathered in bf16: read and write 2 bytes; gradients read in bf16, written in
    fp32), at the copy bandwidth (memory-bound: no IN_STEP). Layout.fsdp_copies off (FSDP1, Megatron-FSDP)
    prices none."""
    cfg = gpt(8, 256, 4, max_seq_len=256, dropout=0.0, tie_embeddings=False)
    run = run_of(cfg, tokens=1e9, seq_len=256, micro_batch=2, grad_accum=2, gpus=8, zero=3, gpu="h100",
                 precision="amp")
    on, off = plan_run(run), plan_run(replace(run, layout=replace(run.layout, fsdp_copies=False)))
    rp = param_counts(cfg, run.layout)
    rate = copy_bandwidth(ACCELERATORS["h100-sxm"])
    ops = {o["op"]: o for o in on.cluster.ops}
    m, blocks, root = 2, cfg.n_layers, rp.embedding + rp.head
    assert ops["FSDP2 all-gather copy-out"]["calls"] == m * (2 * blocks + 1)
    assert ops["FSDP2 all-gather copy-out"]["seconds"] == pytest.approx(m * (2 * blocks * rp.layer + root) * 4 / rate)
    assert ops["FSDP2 reduce-scatter copy-in"]["calls"] == m * (blocks + 1)
    assert ops["FSDP2 reduce-scatter copy-in"]["seconds"] == pytest.approx(m * (blocks * rp.layer + root) * 6 / rate)
    copies = ops["FSDP2 all-gather copy-out"]["seconds"] + ops["FSDP2 reduce-scatter copy-in"]["seconds"]
    assert not any(o["op"].startswith("FSDP2") for o in off.cluster.ops)
    # the copies lengthen the blocks the collectives hide under: the step grows by at most the copies
    grown = on.cluster.breakdown["dp_comm_s"] - off.cluster.breakdown["dp_comm_s"]
    assert 0 < grown <= copies * (1 + 1e-9)
    assert "FSDP2's copies out of each gather" in explain_cluster(on)
    assert "FSDP2's copies" not in explain_cluster(off)
    # experts over as many expert-parallel ranks as data-parallel ones (ep 8 = dp 8): each rank's experts whole
    # on it, never gathered, so none copied: the copy-out is the dense part's and the roots' alone
    moe = replace(cfg, n_experts=8, top_k=2, expert_ffn_hidden=256)
    ep = plan_run(replace(run, model=moe, layout=replace(run.layout, ep=8)))
    rp = param_counts(moe, ep.run.layout)
    out = next(o for o in ep.cluster.ops if o["op"] == "FSDP2 all-gather copy-out")
    dense = rp.moe_layer - rp.moe_experts
    assert out["seconds"] == pytest.approx(m * (2 * blocks * dense + rp.embedding + rp.head) * 4 / rate)


def test_fsdp_grad_sync_reduces_once_or_each_micro_batch_in_time_memory_and_messages():
    """Layout.fsdp_grad_sync, read alike by the cluster step, the rank memory model and the per-rank messages:
    "step" reduce-scatters once, after the last of K micro-batches, holding their unsharded fp32 gradients until
    then; "micro-batch" reduce-scatters each one's into the rank's shard. Left to the stack (None), a run
    trainwise trains is planned as its trainer runs it (step), another stack's recipe as FSDP2 and Megatron-FSDP
    run it (micro-batch)."""
    cfg = gpt(8, 256, 4, max_seq_len=256, dropout=0.0, tie_embeddings=False)
    K, blocks, gpus = 4, cfg.n_layers, 8
    run = run_of(cfg, tokens=1e9, seq_len=256, micro_batch=2, grad_accum=K, gpus=gpus, zero=3, gpu="h100",
                 precision="amp")
    assert run.layout.fsdp_grad_sync is None
    assert plan_run(run).run.layout.fsdp_grad_sync == "step"
    assert plan_run(replace(run, recipe=get_recipe("bf16"))).run.layout.fsdp_grad_sync == "micro-batch"
    plans = {s: plan_run(replace(run, layout=replace(run.layout, fsdp_grad_sync=s))) for s in ("step", "micro-batch")}
    scatters = {s: next(o["calls"] for o in p.cluster.ops if o["op"] == "nccl reduce_scatter (dp)")
                for s, p in plans.items()}
    assert scatters == {"step": blocks + 1, "micro-batch": K * (blocks + 1)}  # the blocks and the roots
    assert plans["step"].cluster.breakdown["dp_comm_s"] < plans["micro-batch"].cluster.breakdown["dp_comm_s"]
    # memory: K > 1 micro-batches' unsharded fp32 gradients (4 N) in place of the rank's fp32 shard of them (4 N / dp)
    n = sum(p.tp_numel for p in rank_params(cfg, run.layout, 0))  # unsharded
    assert plans["step"].peak_bytes - plans["micro-batch"].peak_bytes == 4 * n - 4 * n // gpus
    # and in the memory per device `fits` and --fit hold to, beside the states (what the step ends with)
    assert plans["step"].states == plans["micro-batch"].states
    assert (plans["step"].held_grad_sums, plans["micro-batch"].held_grad_sums) == (4 * n, 0)
    assert plans["step"].per_device_bytes - plans["micro-batch"].per_device_bytes == 4 * n
    # the messages each rank sends (cost.rank.rank_comm, what the trainer's comm counter is held to)
    shape = StepShape(micro_batch=2, seq_len=256, grad_accum=K, compute_bytes=2, residual_bytes=2, param_bytes=2)
    calls = {s: rank_comm(cfg, p.run.layout, 0, shape)["reduce_scatter"]["calls"] for s, p in plans.items()}
    assert calls["micro-batch"] == K * calls["step"]
    assert "reduce-scattered once (--fsdp-grad-sync step)" in explain_cluster(plans["step"])
    assert "held sums  = N x 4 B, the micro-batches' unsharded fp32 gradients" in explain_plan(plans["step"])
    assert "held sums" not in explain_plan(plans["micro-batch"]) and "held grad sums" in plan_table(plans["step"])
    assert "reduce-scattered each micro-batch" in explain_cluster(plans["micro-batch"])
    for bad in (dict(zero=1), dict(zero=3, pp=2)):
        with pytest.raises(TrainwiseError, match="fsdp-grad-sync micro-batch"):
            make_layout(gpus, fsdp_grad_sync="micro-batch", **bad)
    with pytest.raises(TrainwiseError, match="parallel.fsdp_grad_sync = micro-batch .* parallel.strategy=fsdp"):
        ParallelConfig(strategy="ddp", fsdp_grad_sync="micro-batch").validate()


def test_fsdp2s_policy_is_planned_on_16_bit_activations_with_the_recipes_states():
    """FSDP2's mixed precision (zero2, fsdp) gathers the weights in the compute dtype, so the forward runs on
    16-bit weights and inputs: residual stream and norms in bf16, as cost.rank_memory prices its activations;
    the step is recorded so (Recipe.record_precision) while the update still moves amp's fp32 states."""
    amp = get_recipe("amp")
    assert (amp.record_precision(), amp.record_precision(gathered=True)) == ("bf16", "bf16-pure")
    assert get_recipe("fp32").record_precision(gathered=True) == "fp32"
    assert get_recipe("megatron").record_precision() == "fp16-pure"
    cfg = gpt(8, 256, 4, max_seq_len=256, dropout=0.0)

    def plan(zero):
        return plan_run(run_of(cfg, tokens=1e9, seq_len=256, micro_batch=2, gpus=8, zero=zero, gpu="h100",
                               precision="amp")).cluster.breakdown

    sharded, zero1 = plan(3), plan(1)
    assert sharded["compute_s"] < zero1["compute_s"]  # the fp32 residual stream and its casts are gone
    assert sharded["optimizer_s"] == pytest.approx(zero1["optimizer_s"], rel=1e-4)  # both update 1/8 in fp32


def test_each_collective_by_the_nccl_tests_formulas():
    nvlink = C.Tier("nvlink", ring_busbw=235e9, alltoall_busbw=210e9, p2p_bytes_per_s=0.65 * 300e9)
    gib = 2**30
    # all-reduce of 1 GiB over 8 GPUs: 86 us + 2 x 7/8 x 1 GiB / (0.923 x 235 GB/s) = 8.749 ms
    # (nccl-tests' published sweep: 8.204 ms)
    assert C.collective_seconds("all_reduce", gib, 8, nvlink) == pytest.approx(86e-6 + 1.75 * gib / (0.923 * 235e9))
    assert C.collective_seconds("all_reduce", gib, 8, nvlink) == pytest.approx(8.749e-3, rel=1e-3)
    assert C.collective_seconds("all_gather", gib, 8, nvlink) == pytest.approx(86e-6 + 0.875 * gib / (0.923 * 235e9))
    assert C.collective_seconds("reduce_scatter", gib, 4, nvlink) == pytest.approx(86e-6 + 0.75 * gib / (0.923 * 235e9))
    assert C.collective_seconds("all_to_all", gib, 8, nvlink) == pytest.approx(86e-6 + 0.875 * gib / (0.923 * 210e9))
    assert C.collective_seconds("send_recv", gib, 2, nvlink) == pytest.approx(10e-6 + gib / (0.923 * 195e9))
    assert C.collective_seconds("all_reduce", gib, 1, nvlink) == 0
    assert C.bytes_sent("all_reduce", 1000, 8) == 1750 and C.bytes_sent("all_gather", 1000, 4) == 750
    # across nodes a ring's slowest hop is the network: one GPU per node -> its NIC's share of the node's busbw
    dgx = NODES["dgx-a100"]
    net = C.group_tier(1, 4, dgx)
    assert net.name == "network" and net.ring_busbw == 24e9 and net.alltoall_busbw == 24e9
    assert C.group_tier(4, 2, dgx).ring_busbw == 96e9
    assert C.group_tier(2, 1, dgx, bridged_pair=True).ring_busbw == 235e9  # no bridge on a DGX: NVLink


def test_a_bridged_pair_reaches_its_bridge_and_larger_groups_cross_pcie():
    """H100 PCIe cards joined in pairs by NVLink bridges: tp 2 over a pair's two cards runs at the bridge's
    measured 116 GB/s, tp 4 over PCIe Gen5 x16 (0.82 x 63 GB/s); a dp pair two cards apart has no bridge."""
    node = NODES["pcie-h100"]
    assert placement(make_layout(8, tp=2), "tp", 8).stride == 1
    assert _tier(make_layout(8, tp=2), "tp", node).name == "bridge"
    assert _tier(make_layout(8, tp=2), "tp", node).ring_busbw == 116e9
    four = _tier(make_layout(8, tp=4), "tp", node)
    assert four.name == "pcie" and four.ring_busbw == pytest.approx(0.82 * 63e9)
    assert _tier(make_layout(4, tp=2), "dp", node).name == "pcie"  # ranks 0 and 2: different pairs
    assert _tier(make_layout(16, tp=8), "dp", node).name == "network"


def test_groups_sit_in_megatrons_order_tp_innermost():
    lay = make_layout(64, tp=8, pp=2)  # dp = 4
    assert placement(lay, "tp", 8).nodes == 1
    assert (placement(lay, "dp", 8).per_node, placement(lay, "dp", 8).nodes) == (1, 4)  # stride 8
    assert (placement(lay, "pp", 8).per_node, placement(lay, "pp", 8).nodes) == (1, 2)  # stride 32
    small = make_layout(8, tp=2)  # dp = 4 at stride 2: inside one node
    assert placement(small, "dp", 8).nodes == 1 and placement(small, "dp", 8).per_node == 4
    assert (make_layout(16, tp=2).sequence_parallel
            and not make_layout(16, tp=2, sequence_parallel=False).sequence_parallel)


def test_gemm_waves_follow_nvidias_cublas_curve():
    """m = n = k bf16 matmuls on an A100 (NVIDIA, "CUDA 11 Features Revealed" Fig. 6, read off the plot):
    the tile-wave model at MAMF within 20%."""
    for size, published_tflops in ((1024, 88), (2048, 195), (4096, 258), (8192, 291)):
        tflops = 2 * size**3 / matmul_seconds(1, size, size, size, A100, "bf16") / 1e12
        assert tflops == pytest.approx(published_tflops, rel=0.20), size
    # 1024^3 fills 64 of the 108 SMs with 128 x 128 tiles in one wave, each tile's K lengthened by its
    # prologue and epilogue, plus the call's fixed cost
    assert matmul_seconds(1, 1024, 1024, 1024, A100, "bf16") == pytest.approx(
        2 * 128 * 128 * (1024 + GEMM_K_OVERHEAD) / (271.2e12 / 108) + GEMM_LAUNCH_S)


# XLA's sm_90 bf16 matmul table (openxla/xla, gpu/model/matmul_interpolator_data.h): (batch, M, N, K, TFLOP/s)
# measured on an H100 SXM; with NVIDIA's A100 curve above, the set GEMM_K_OVERHEAD and GEMM_LAUNCH_S were fitted on
XLA_SM90_BF16 = [
    (1, 4096, 4096, 256, 392.2), (1, 4096, 4096, 512, 543.1), (1, 4096, 4096, 2048, 738.7),
    (1, 4096, 4096, 4096, 783.3), (2, 4096, 4096, 256, 464.0), (2, 4096, 4096, 512, 607.7),
    (2, 4096, 4096, 1024, 693.0), (2, 4096, 4096, 2048, 763.0), (2, 4096, 4096, 4096, 807.7),
    (4, 4096, 4096, 256, 503.9), (4, 4096, 4096, 512, 619.9), (4, 4096, 4096, 2048, 764.6),
    (4, 4096, 4096, 4096, 793.1), (1, 4096, 2048, 256, 304.0), (1, 4096, 2048, 512, 447.0),
    (1, 4096, 2048, 4096, 758.4), (2, 4096, 2048, 256, 394.5), (2, 4096, 2048, 512, 546.4),
    (2, 4096, 2048, 1024, 680.9), (2, 4096, 2048, 4096, 783.2), (4, 4096, 2048, 256, 458.5),
    (4, 4096, 2048, 512, 607.5), (4, 4096, 2048, 2048, 759.3), (4, 4096, 2048, 4096, 808.7),
    (4, 2048, 4096, 1024, 688.6), (4, 2048, 4096, 4096, 801.9), (4, 2048, 4096, 256, 458.9),
    (1, 2048, 4096, 1024, 594.2), (1, 2048, 4096, 512, 450.4), (2, 2048, 4096, 2048, 729.1),
    (1, 2048, 2048, 1024, 493.9), (1, 2048, 2048, 2048, 632.0), (2, 2048, 2048, 256, 299.6),
    (2, 2048, 2048, 1024, 600.2), (2, 2048, 2048, 2048, 717.7), (2, 2048, 2048, 4096, 756.7),
    (4, 2048, 2048, 512, 542.3), (4, 2048, 2048, 1024, 674.0), (4, 2048, 2048, 2048, 725.7),
    (1, 4096, 1024, 4096, 738.5), (1, 1024, 4096, 4096, 738.5), (1, 4096, 512, 4096, 650.0),
    (4, 4096, 512, 4096, 728.6), (4, 4096, 1024, 4096, 777.6), (1, 4096, 1024, 1024, 488.1),
    (4, 4096, 1024, 1024, 673.8), (2, 4096, 1024, 1024, 598.2), (1, 1024, 4096, 1024, 490.3),
]


def test_gemm_efficiency_by_shape_follows_xlas_h100_table():
    """Short K runs far below MAMF (4096 x 4096 x 256 at half the 4096^3 rate): every shape of XLA's table
    within 10%, the median within 5%."""
    h100 = ACCELERATORS["h100-sxm"]
    errors = [2 * b * m * n * k / matmul_seconds(b, m, k, n, h100, "bf16") / 1e12 / tflops - 1
              for b, m, n, k, tflops in XLA_SM90_BF16]
    assert max(map(abs, errors)) < 0.10
    assert sorted(map(abs, errors))[len(errors) // 2] < 0.05


def test_attention_at_flashattention2s_published_rate():
    assert attention_rate(A100, 2048, 128)[0] == 155e12
    w = math.log(3000 / 2048) / math.log(2)
    assert attention_rate(A100, 3000, 128)[0] == pytest.approx((155 * (1 - w) + 173 * w) * 1e12)
    assert attention_rate(A100, 100_000, 64)[0] == 171e12  # held at the ends
    l40s_rate, how = attention_rate(ACCELERATORS["l40s"], 2048, 128)  # none published: the A100's x MAMF ratio
    assert l40s_rate == pytest.approx(155e12 * matmul_rate(ACCELERATORS["l40s"], "bf16") / 271.2e12)
    assert "no published rate" in how


def test_the_b200_runs_its_kernels_measured_rates_cudnn_by_default():
    """The B200: cuDNN's and FlashAttention-2's forward and backward rates as NVIDIA's cudnn-frontend measured them
    (8,192 tokens: cuDNN 1,171 / 943, FlashAttention-2 400 / 318 TFLOP/s), forward+backward at 1 : 2.5 FLOPs;
    cuDNN's is the default kernel (flash), FlashAttention-3 is refused."""
    b200 = ACCELERATORS["b200"]
    cudnn, how = attention_rate(b200, 8192, 128, "cudnn")
    assert cudnn == pytest.approx(3.5e12 / (1 / 1171 + 2.5 / 943)) and "cudnn-frontend" in how
    assert attention_rate(b200, 8192, 128)[0] == cudnn
    assert attention_rate(b200, 8192, 128, "flash2")[0] == pytest.approx(3.5e12 / (1 / 400 + 2.5 / 318))
    with pytest.raises(TrainwiseError, match="FlashAttention-3 runs on Hopper GPUs only"):
        attention_rate(b200, 8192, 128, "flash3")


def test_the_gb200_plans_in_its_nvl72_domain_and_a_ring_is_held_to_its_nodes_fabric(capsys):
    """The GB200: its own MAMF, the B200's measured attention rates (cuDNN by default), MX formats; its node an
    NVLink domain of 72, a ring inside it at the 680 GB/s measured there. A ring across nodes also runs through
    each node's fabric: over two H800 nodes at their NVLink's 160 GB/s (the DeepSeek-V3 report's figure), not the
    NICs' 400; over two GB200 domains at most the domain's 680, whatever 72 NICs would carry."""
    gb200, b200 = ACCELERATORS["gb200"], ACCELERATORS["b200"]
    assert matmul_rate(gb200, "bf16") == 1822e12 and gb200.mx and gb200.memory_bytes == 186e9
    rate, how = attention_rate(gb200, 8192, 128)
    assert rate == attention_rate(b200, 8192, 128, "cudnn")[0] and "B200, taken for the GB200" in how
    nvl = NODES[gb200.node]
    assert nvl.gpus == 72 and C.group_tier(72, 1, nvl).ring_busbw == 680e9
    assert C.group_tier(72, 2, nvl).ring_busbw == 680e9
    assert C.group_tier(8, 2, nvl).ring_busbw == pytest.approx(0.96 * 8 * 50e9)  # eight GPUs' NICs
    assert C.group_tier(8, 2, NODES["hgx-h800"]).ring_busbw == 160e9
    assert C.group_tier(8, 2, NODES["dgx-h100"]).ring_busbw == 370e9  # NVLink and NICs alike: unchanged
    assert lookup_cuda_device("NVIDIA GB200") is gb200 and lookup_cuda_device("NVIDIA B200") is b200
    assert [lookup_cuda_device(f"NVIDIA {n}").name for n in ("GB300", "B300")] == ["GB300", "B300"]
    # the Blackwell Ultra nodes have no NCCL figure: derived from their line rates, their rings held the same way
    for name, gpus in (("dgx-b300", 8), ("gb300-nvl72", 72)):
        node = NODES[name]
        assert node.gpus == gpus and node.allreduce_busbw_intra == pytest.approx(0.82 * 900e9)
        assert C.group_tier(gpus, 2, node).ring_busbw == node.allreduce_busbw_intra  # the NICs would carry more
    args = ["plan", "--model", "llama-3-70b", "--gpu", "gb200", "--gpus", "144", "--tp", "8", "--seq-len", "8192",
            "--micro-batch", "1", "--global-batch", "1152", "--tokens", "1e12"]
    for precision in ("fp8", "mxfp8"):
        assert main(args + ["--precision", precision, "--json"]) == 0
        j = json.loads(capsys.readouterr().out)
        assert j["time"]["step_seconds"] > 0 and j["memory"]["peak_bytes"] > 0
    assert main(args + ["--precision", "fp8", "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GB200 NVL72" in out and "none published on the GB200" in out


def test_a_gpu_held_under_its_power_runs_its_tensor_core_kernels_at_its_clock_share():
    """clock_share 0.9 (a power limit below the TDP): matmuls at 0.9 of MAMF (large ones take 1/0.9 as long),
    FP8 too, attention at 0.9 of its published rate; memory-bound work is the HBM's and does not move."""
    h100 = ACCELERATORS["h100-sxm"]
    held = replace(h100, clock_share=0.9)
    for dtype in ("bf16", "fp8"):
        assert matmul_rate(held, dtype) == pytest.approx(0.9 * matmul_rate(h100, dtype))
    big = (1, 16384, 8192, 16384)
    assert matmul_seconds(*big, held, "bf16") == pytest.approx(
        (matmul_seconds(*big, h100, "bf16") - GEMM_LAUNCH_S) / 0.9 + GEMM_LAUNCH_S)
    rate, how = attention_rate(held, 8192, 128, "cudnn")
    assert rate == pytest.approx(0.9 * attention_rate(h100, 8192, 128, "cudnn")[0]) and "clock share 0.900" in how


def test_the_in_step_factor_lengthens_the_tensor_core_kernels_alone(monkeypatch):
    """IN_STEP (one value fitted across the development sets) times every matmul and attention kernel of a
    step; the memory-bound ones (norms, activations, casts, adds) run at the copy bandwidth, unchanged: twice
    the factor, twice the former, the same latter."""
    run = run_of(gpt(8, 1024, 4, max_seq_len=1024), tokens=1e9, seq_len=1024, micro_batch=4, gpus=8, gpu="h100",
                 precision="amp")
    ops = {}
    for factor in (IN_STEP, 2 * IN_STEP):
        monkeypatch.setattr("trainwise.cost.cluster.IN_STEP", factor)
        ops[factor] = {o["op"]: o["seconds"] for o in plan_run(run).cluster.ops}
    assert f"matmul and attention x {2 * IN_STEP}" in explain_cluster(plan_run(run))  # the factor in use, said
    base, doubled = ops[IN_STEP], ops[2 * IN_STEP]
    kernels = [name for name in base if name.startswith("aten.")]
    tensor_core = [name for name in kernels if name in ("aten.mm", "aten.addmm", "aten.bmm") or "attention" in name]
    memory_bound = [name for name in kernels if name not in tensor_core]
    assert tensor_core and {"aten.native_layer_norm", "aten.gelu", "aten.add"} <= set(memory_bound)
    for name in tensor_core:
        assert doubled[name] == pytest.approx(2 * base[name]), name
    for name in memory_bound:
        assert doubled[name] == pytest.approx(base[name]), name


def test_cli_plan_of_a_power_limited_gpu(capsys):
    """--clock-share holds a table GPU's kernel rates (a cluster at a power limit below the TDP): the compute of the
    same step takes 1/share as long, the explanation says so; a share outside (0, 1] or a device not priced from
    published kernels is a one-paragraph error."""
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--zero", "3", "--seq-len", "8192",
            "--global-batch", "16", "--tokens", "1e9", "--checkpointing", "full"]
    steps = {}
    for share in (None, "0.8"):
        assert main(argv + ["--json"] + (["--clock-share", share] if share else [])) == 0
        steps[share] = json.loads(capsys.readouterr().out)["time"]["breakdown"]
    assert steps["0.8"]["compute_s"] > 1.15 * steps[None]["compute_s"]
    assert main(argv + ["--clock-share", "0.8", "--explain"]) == 0
    assert "0.800 of its published rate" in capsys.readouterr().out
    for bad in (["--clock-share", "1.5"], ["--clock-share", "0.9", "--peak-flops", "1e15"]):
        assert main(argv + bad) == 2
        err = capsys.readouterr().err
        assert "--clock-share" in err and "Traceback" not in err


def test_per_rank_activation_memory_under_tp_sp_selective_and_full():
    """Korthikanti et al. 2022 Table 2 for a GPT layer in 16-bit (their 22B: h 6144, a 64, s 2048, t 8):
    TP sbh(10 + 24/t + 5as/(ht)), TP+SP sbh(34/t + 5as/(ht)), TP+SP+selective 34 sbh/t, full 2 sbh/t;
    trainwise's count of its own layer adds a few bytes per token (layer-norm statistics). Their sequence
    parallelism gathers the column-parallel inputs again in backward; trainwise's keeps them (2 x 2h)."""
    cfg, rec, h, a, s, t = gpt(64, 6144, 48), get_recipe("megatron"), 6144, 64, 2048, 8
    tp = make_layout(8, tp=8, sequence_parallel=False, attention_impl="unfused")
    sp = make_layout(8, tp=8, attention_impl="unfused")
    assert layer_bytes_per_token(cfg, rec, 0, tp, s, "none") == pytest.approx(h * (10 + 24 / t + 5 * a * s / (h * t)),
                                                                            rel=0.01)
    assert layer_bytes_per_token(cfg, rec, 0, sp, s, "none", regather=True) == pytest.approx(
        h * (34 / t + 5 * a * s / (h * t)), rel=0.01)
    assert layer_bytes_per_token(cfg, rec, 0, sp, s, "selective", regather=True) == pytest.approx(34 * h / t, rel=0.01)
    assert layer_bytes_per_token(cfg, rec, 0, sp, s, "selective") == pytest.approx(
        layer_bytes_per_token(cfg, rec, 0, sp, s, "selective", regather=True) + 4 * h * (1 - 1 / t))
    assert layer_bytes_per_token(cfg, rec, 0, sp, s, "full") == 2 * h / t


def test_per_rank_memory_under_pp_and_cp():
    """A layout trainwise only plans (Megatron's recipe), priced as Megatron-LM runs it by the one per-rank
    model (cost.rank_memory.rank_peak)."""
    cfg, rec = gpt(32, 2048, 16, max_seq_len=8192), get_recipe("megatron")

    def peak(rank: int = 0, **layout) -> object:
        lay = make_layout(layout.pop("gpus"), micro_batches=8, **layout)
        return rank_peak(Run(cfg, micro_batch=1, seq_len=8192, grad_accum=8, recipe=rec, layout=lay), rank)

    one, pp, cp = peak(gpus=8, tp=8), peak(gpus=32, tp=8, pp=4), peak(gpus=16, tp=8, cp=2)
    per_layer = layer_bytes_per_token(cfg, rec, 0, make_layout(8, tp=8), 8192, "none", regather=True)
    # 1F1B: the first of 4 stages holds 4 micro-batches of its 4 layers (the 16 layers' total), each with the
    # token ids and the embedding's masked ids and mask (8 + 9 bytes per token)
    assert pp.activations == pytest.approx(4 * 8192 * (4 * per_layer + 17), rel=1e-9)
    assert cp.activations == pytest.approx(one.activations / 2, rel=0.01)  # T / cp tokens per rank
    # states: 18 bytes per parameter of the rank's 1/8 of the layers and the vocabulary (the tied head is
    # the embedding's table), positions whole; the first of 4 stages holds 4 layers and the embedding
    layers = 16 * 12 * 2048**2  # + biases and norms: within 1%

    def states(p) -> int:
        return p.params + p.grads + p.optimizer + p.master

    assert states(one) == pytest.approx(18 * ((layers + 51200 * 2048) / 8 + 8192 * 2048), rel=0.01)
    assert states(pp) == pytest.approx(18 * ((layers / 4 + 51200 * 2048) / 8 + 8192 * 2048), rel=0.01)
    # the last stage holds its own copy of the tied table as the LM head
    assert states(peak(24, gpus=32, tp=8, pp=4)) == pytest.approx(18 * (layers / 4 + 51200 * 2048) / 8, rel=0.01)
    zero = peak(gpus=32, tp=8, zero=1)
    assert zero.optimizer + zero.master == pytest.approx((one.optimizer + one.master) / 4, rel=1e-6)  # dp = 4
    zero_cp = peak(gpus=32, tp=8, cp=2, zero=1)  # the distributed optimizer shards over dp x cp = 4
    assert zero_cp.optimizer == pytest.approx(one.optimizer / 4, rel=1e-6)


def test_megatron_fsdp_accumulates_into_its_gradient_shard_where_fsdp2_keeps_unsharded_gradients():
    """ZeRO-3 over 8 ranks, K = 1 against K = 4 micro-batches: trainwise's FSDP2 keeps each micro-batch's unsharded
    fp32 gradients until the last one's reduce-scatter (4 bytes x every parameter of the model, on every rank);
    Megatron-FSDP reduce-scatters each micro-batch's into the rank's gradient shard (its 1/8 of 4-byte main
    gradients), which the second micro-batch's backward finds."""
    cfg = gpt(4, 512, 8, max_seq_len=1024)
    whole = sum(p.numel for p in rank_params(cfg, make_layout(1), 0))

    def backward(recipe: str, k: int) -> int:
        lay = make_layout(8, micro_batches=k, zero=3)
        return rank_peak(Run(cfg, micro_batch=1, seq_len=1024, grad_accum=k, recipe=get_recipe(recipe),
                             layout=lay)).backward

    assert backward("amp", 4) - backward("amp", 1) == pytest.approx(4 * whole, rel=0.01)
    assert backward("megatron", 4) - backward("megatron", 1) == pytest.approx(4 * whole / 8, rel=0.01)


def test_the_plans_json_holds_layout_breakdown_ops_and_comm():
    cfg = gpt(8, 256, 4, max_seq_len=256, dropout=0.0)
    p = plan_run(run_of(cfg, tokens=1e9, seq_len=256, micro_batch=2, grad_accum=4, gpus=16, tp=2, pp=2,
                        gpu="a100-80gb", sequence_parallel=False))
    j = p.to_json()
    assert j["layout"] == {"dp": 4, "tp": 2, "pp": 2, "vpp": 1, "cp": 1, "ep": 1, "sequence_parallel": False,
                           "zero": 0, "micro_batches": 4, "dp_overlap": True, "attention_impl": "flash",
                           "cp_impl": "ring", "ep_dispatch": "alltoall", "etp": 2, "ep_overlap": False,
                           "pp_schedule": "1f1b",
                           "tp_overlap": None, "pp_overlap": False, "dp_shard": 4, "fsdp_copies": True,
                           "fsdp_grad_sync": "step", "fsdp_prefetch": "pre"}
    assert (j["hardware"]["gpus_per_node"], j["hardware"]["intra_node_bytes_per_s"],
            j["hardware"]["inter_node_bytes_per_s"]) == (8, 300e9, 25e9)
    t = j["time"]
    assert set(t["breakdown"]) == set(BREAKDOWN) and sum(t["breakdown"].values()) == pytest.approx(t["step_seconds"])
    assert t["source"] == "published microbenchmarks" and "assumed" not in t["source"]
    assert all(set(o) == {"op", "calls", "seconds"} for o in t["ops"]) and t["breakdown"]["bubble_s"] > 0
    # per rank and step, hand-worked: 2 layers on a rank, each 2 all-reduces forward and 2 backward, + the LM
    # head's (last rank), over 2 ranks (2(n-1)/n = 1): calls 4 micro-batches x (2 x 2 x 2 + 1) = 36, each
    # B x T x H x 2 bytes = 2 x 256 x 256 x 2
    # once per step: the gradients over dp, the tied table's gradient between the two stages, the gradient
    # norm's and the loss's scalars
    ar = j["comm"]["all_reduce"]
    tp_calls = 4 * (2 * 2 * 2 + 1)
    step_calls = 1 + 3
    assert ar["calls"] == tp_calls + step_calls
    ops = {o["op"]: o for o in t["ops"]}
    tied = ops["nccl all_reduce (tied embedding)"]
    assert tied["calls"] == 1 and tied["seconds"] > ops["nccl all_reduce (gradient norm)"]["seconds"]
    assert j["comm"]["send_recv"]["calls"] == 4 * 2  # an activation and a gradient per micro-batch
    assert ar["bytes"] >= tp_calls * 2 * 256 * 256 * 2


def test_main_gradients_in_bf16_halve_their_bytes_and_the_data_parallel_reduction(capsys):
    """--grad-dtype bf16 (Megatron-Core's --grad-reduce-in-bf16): the main gradients accumulate and are reduce-scattered
    in 2 bytes a parameter instead of 4; the parameters' all-gather stays 16-bit. A recipe whose gradients are its
    parameters' own (amp's fp32) refuses it."""
    args = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "16", "--zero", "1", "--seq-len", "4096",
            "--micro-batch", "1", "--global-batch", "32", "--tokens", "1e11", "--json"]
    plans = {}
    for precision, dtype in (("fp8", "fp32"), ("fp8", "bf16"), ("bf16-mixed", None), ("bf16-mixed", "fp32")):
        assert main(args + ["--precision", precision] + (["--grad-dtype", dtype] if dtype else [])) == 0
        plans[precision, dtype] = json.loads(capsys.readouterr().out)
    fp32, bf16 = plans["fp8", "fp32"], plans["fp8", "bf16"]
    assert (fp32["memory"]["grad_bytes_per_param"], bf16["memory"]["grad_bytes_per_param"]) == (4, 2)
    assert bf16["memory"]["grads_bytes"] * 2 == fp32["memory"]["grads_bytes"]
    assert fp32["memory"]["peak_bytes"] - bf16["memory"]["peak_bytes"] == bf16["memory"]["grads_bytes"]
    assert bf16["comm"]["reduce_scatter"]["bytes"] * 2 == fp32["comm"]["reduce_scatter"]["bytes"]
    assert bf16["comm"]["all_gather"] == fp32["comm"]["all_gather"]
    api = trainwise.plan("llama-3-8b", tokens=1e11, gpu="h100-sxm", gpus=16, zero=1, seq_len=4096, micro_batch=1,
                         grad_accum=2, precision="fp8", grad_dtype="bf16").to_json()
    assert api["memory"] == bf16["memory"] and api["comm"] == bf16["comm"]
    mixed, mixed32 = plans["bf16-mixed", None], plans["bf16-mixed", "fp32"]
    assert mixed32["memory"]["grads_bytes"] == 2 * mixed["memory"]["grads_bytes"] == fp32["memory"]["grads_bytes"]
    assert main(args + ["--precision", "amp", "--grad-dtype", "bf16"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "--grad-dtype bf16" in err and "fp32 master" in err and "Traceback" not in err


@pytest.mark.parametrize("kw, text", [
    (dict(tp=3, gpus=24), "tp values that work: 1, 2, 4, 8"),
    (dict(gpus=12, tp=8), "not a multiple of tp x pp x cp"),
    (dict(pp=8, vpp=2, gpus=16), "pipeline chunks but the model has only 4 layers"),
    (dict(pp=2, vpp=2, gpus=2, grad_accum=3), "multiple of pp = 2"),
    (dict(pp=2, gpus=2, grad_accum=1), "at least 2 micro-batches"),
    (dict(cp=3, gpus=3), "seq_len 256 does not divide"),
    (dict(ep=2, gpus=2), "has no experts"),
])
def test_a_layout_that_cannot_work_is_a_clear_error(kw, text):
    args = dict(tokens=1e9, seq_len=256, gpu="a100-80gb", **{"gpus": 8, "grad_accum": 4, **kw})
    with pytest.raises(TrainwiseError, match=text):
        plan_run(run_of(gpt(8, 256, 4, max_seq_len=256), **args))


def test_expert_parallel_layouts_of_a_moe():
    moe = ModelConfig(vocab_size=1024, d_model=256, n_layers=2, n_heads=8, n_kv_heads=8, max_seq_len=512,
                      n_experts=8, top_k=2, expert_ffn_hidden=256)
    with pytest.raises(TrainwiseError, match="ep values that work"):
        plan_run(run_of(moe, tokens=1e9, seq_len=512, gpus=12, ep=3, gpu="h100-sxm"))
    with pytest.raises(TrainwiseError, match="must divide tp x cp x dp"):
        plan_run(run_of(moe, tokens=1e9, seq_len=512, gpus=4, tp=2, ep=4, gpu="h100-sxm"))
    p = plan_run(run_of(moe, tokens=1e9, seq_len=512, gpus=16, ep=8, gpu="h100-sxm"))
    assert p.cluster.breakdown["ep_comm_s"] > 0 and p.to_json()["comm"]["all_to_all"]["calls"] == 2 * 2 * 2


def test_experts_and_few_key_value_heads_as_megatron_places_them():
    """Under ep each rank holds n_experts / ep of every MoE layer's routed experts, and ZeRO-1 shards their
    optimizer states over dp / ep (the expert-data-parallel ranks); key-value heads fewer than tp are
    replicated, one whole head per rank. The plan's states are the per-rank model's."""
    moe = ModelConfig(vocab_size=1024, d_model=256, n_layers=2, n_heads=8, n_kv_heads=2, max_seq_len=512,
                      n_experts=8, top_k=2, expert_ffn_hidden=256)
    experts = 2 * 3 * 8 * 256 * 256  # two MoE layers, gate, up and down, 8 experts of 256 x 256

    def peak(**layout):
        lay = make_layout(layout.pop("gpus"), **layout)
        return rank_peak(Run(moe, seq_len=512, recipe=get_recipe("bf16"), layout=lay))

    whole, split = peak(gpus=8, zero=1), peak(gpus=8, zero=1, ep=4)
    assert whole.params - split.params == 2 * experts * 3 // 4  # bf16 weights: 2 bytes each
    assert split.optimizer == pytest.approx(8 * ((whole.params / 2 - experts) / 8 + experts / 4 / 2))
    # k and v: 2 heads of 32 over tp 4, one whole head on every rank (not half of one)
    held = {p.spec.name: p.numel for p in rank_params(moe, make_layout(4, tp=4), 3, megatron=True)}
    assert held["blocks.1.attn.qkv.k.weight"] == held["blocks.1.attn.qkv.v.weight"] == 32 * 256
    assert held["blocks.1.attn.qkv.q.weight"] == 2 * 32 * 256
    p = plan_run(run_of(moe, tokens=1e9, seq_len=512, gpus=8, ep=4, zero=1, precision="bf16", gpu="h100-sxm"))
    assert p.states.optimizer == split.optimizer and p.peak_rank[1] == split
    # folded experts (etp 1) under sequence parallelism: each tp rank routes and dispatches its own T / tp positions,
    # so all of a MoE layer's saved bytes are the rank's share; with etp = tp the routing is whole on every rank
    folded, sharded = make_layout(8, tp=2, ep=4, etp=1), make_layout(8, tp=2, ep=2)
    bf16 = get_recipe("bf16")
    total = M.activation_bytes_per_token_layer(moe, bf16, 1)
    # Megatron-Core's block (another stack's run: regather) keeps fewer bytes per token than trainwise's: its two
    # fused RMSNorms no x * rsqrt (2 x 2H), and its MoE layer, which weights the routed copies inside the experts'
    # activation, no expert outputs (top_k x 2H) and a bf16 router input, not an fp32 copy (2H)
    norms, moe_lean, act = M.megatron_lean_bytes(moe, bf16, 1)
    assert moe.norm == "rmsnorm" and (norms, moe_lean, act) == (2 * 2 * 256, 2 * 2 * 256 + 2 * 256, 0)
    assert M.megatron_lean_bytes(replace(moe, norm="layernorm"), bf16, 1)[0] == 0
    # gpt-oss's clamped SwiGLU under Megatron-Core's fused weighted activation: its input kept, act(gate) not,
    # top_k x c x F per token (F the expert width), outside the routing (the experts' width is 1/tp where split)
    clamped = replace(moe, activation="clamped_swiglu")
    assert M.megatron_lean_bytes(clamped, bf16, 1)[2] == moe.top_k * 2 * moe.expert_ffn_hidden
    # and per routed copy, as the most loaded rank's extra copies keep it: 3 cF where trainwise's keeps 4 cF
    assert [M.expert_saved_bytes(clamped, bf16, megatron)[1] for megatron in (False, True)] == [
        4 * 2 * moe.expert_ffn_hidden, 3 * 2 * moe.expert_ffn_hidden]
    assert layer_bytes_per_token(clamped, bf16, 1, make_layout(8), 512, "none", True) == (
        M.activation_bytes_per_token_layer(clamped, bf16, 1) - norms - moe_lean - moe.top_k * 2 * moe.expert_ffn_hidden)
    lean = norms + moe_lean
    assert layer_bytes_per_token(moe, bf16, 1, make_layout(8), 512, "none", True) == total - lean
    assert layer_bytes_per_token(moe, bf16, 1, make_layout(8), 512, "none", False) == total
    assert layer_bytes_per_token(moe, bf16, 1, folded, 512, "none", True) == (total - lean) / 2
    assert layer_bytes_per_token(moe, bf16, 1, sharded, 512, "none", True) > (total - lean) / 2


def test_fit_over_layouts_lists_the_fastest_that_fit():
    """The search over layouts keeps the run's settings (here --tp-overlap async and FSDP1's in-place gathers,
    Layout.fsdp_copies off), lists the candidates that fit
    fastest first, each priced as plan_run prices that layout (re-planned: the same step, and the same one with
    its tp collectives exposed takes longer), and says why the others are set aside."""
    cfg = gpt(16, 1024, 8)
    run = Run(cfg, seq_len=2048, recipe=get_recipe("megatron"), tokens=1.0,
              layout=make_layout(4, attention_impl="unfused", tp_overlap="async", fsdp_copies=False),
              machine=Machine(gpu="a100-40gb"))
    good, bad = fit_run_layouts(run, global_batch=32, memory_budget=8 * 2**30)
    assert good and bad and all(c.fits for c in good)
    assert all(c.layout["tp_overlap"] == "async" and not c.layout["fsdp_copies"] for c in good)
    assert [c.step_seconds for c in good] == sorted(c.step_seconds for c in good)
    assert any("GiB per GPU" in c.reason for c in bad)
    with_tp = [c for c in good if c.layout["tp"] > 1][:4]
    assert with_tp
    for c in with_tp:
        layout = Layout(**c.layout)
        again = replace(run, layout=layout, micro_batch=c.micro_batch, grad_accum=layout.micro_batches,
                        checkpointing=c.checkpointing)
        assert plan_run(again).step_seconds == pytest.approx(c.step_seconds, rel=1e-12)
        exposed = plan_run(replace(again, layout=replace(layout, tp_overlap=None))).cluster.breakdown
        assert c.breakdown["tp_comm_s"] < exposed["tp_comm_s"]


def test_async_tp_hides_the_forwards_collectives_and_te_every_passs():
    """tp 4 with sequence parallelism, 8 layers, no recompute, one stage, 2 micro-batches: per micro-batch
    4 L + 2 = 34 reduce-scatters and 6 L + 2 = 50 all-gathers of B x T x H (2 per layer and pass, the backward's
    all-gathers again for the weight gradients, the embedding's and the LM head's). AsyncTP hides the forward's,
    2 L + 1 = 17 of each (the layers', the embedding's output, the LM head's input), under GEMMs that take longer;
    Transformer Engine's overlap all of them."""
    cfg = gpt(64, 8192, 8, max_seq_len=2048, dropout=0.0)

    def plan(kind):
        return plan_run(run_of(cfg, tokens=1e9, seq_len=2048, micro_batch=1, grad_accum=2, gpus=4, tp=4,
                               gpu="h100-sxm", precision="bf16", tp_overlap=kind))

    exposed = plan(None).to_json()["time"]
    calls = {o["op"]: (o["calls"], o["seconds"]) for o in exposed["ops"]}
    (ag_calls, ag), (rs_calls, rs) = calls["nccl all_gather (tp)"], calls["nccl reduce_scatter (tp)"]
    assert (ag_calls, rs_calls) == (2 * 50, 2 * 34) and exposed["breakdown"]["tp_comm_s"] == pytest.approx(ag + rs)
    forward = 2 * 17 * (ag / ag_calls + rs / rs_calls)
    async_tp = plan("async")
    assert async_tp.to_json()["time"]["breakdown"]["tp_comm_s"] == pytest.approx(ag + rs - forward, rel=1e-9)
    assert plan("te").to_json()["time"]["breakdown"]["tp_comm_s"] == 0
    assert "exposed, the forward's under its work (--tp-overlap async)" in explain_cluster(async_tp)


def test_published_runs_are_reproduced():
    """Three of benchmarks/cluster_model.py's 18 runs, the extremes: Narayanan et al. 2021's 1.7B (data
    parallel only) and 1T (TP 8 x PP 64), Korthikanti et al. 2022's 175B with selective recompute +
    sequence parallelism. Inputs as the dev set gives them; published iteration times within 20%."""
    def run(cfg, gpus, published, **kw):
        p = plan_run(run_of(cfg, tokens=1e9, seq_len=2048, precision="megatron", gpu="a100-80gb", gpus=gpus,
                            attention_impl="unfused", **kw))
        assert p.step_seconds == pytest.approx(published, rel=0.20)

    run(gpt(24, 2304, 24), 32, 3.53, micro_batch=16, checkpointing="full")
    run(gpt(160, 25600, 128), 3072, 102.63, tp=8, pp=64, micro_batch=1, grad_accum=512, checkpointing="full",
        sequence_parallel=False, dp_overlap=False)
    run(gpt(96, 12288, 96), 64, 13.75, tp=8, pp=8, vpp=3, micro_batch=1, grad_accum=64, checkpointing="selective",
        dp_overlap=False)


def test_cli_plan_with_a_layout_and_its_explanation(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100", "--gpus", "64", "--tp", "4", "--pp", "2",
            "--global-batch", "128", "--seq-len", "4096", "--tokens", "1e12"]
    assert main(argv + ["--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["layout"]["dp"] == 8 and j["layout"]["micro_batches"] == 16 and j["run"]["grad_accum"] == 16
    assert main(argv + ["--explain"]) == 0
    text = capsys.readouterr().out
    assert "bubble" in text and "tp comm" in text and "nccl all_reduce (dp)" in text
    assert main(argv + ["--grad-accum", "3"]) == 2
    assert "drop one of them" in " ".join(capsys.readouterr().err.split())


def test_fsdp_gathers_and_scatters_per_block_as_it_runs():
    """ZeRO-3 as FSDP2 runs it: per micro-batch each block all-gathered before forward and again before
    backward and reduce-scattered after it, the roots (embedding, head) gathered once and scattered once;
    a block's collectives hide under its neighbours' compute, so the exposed time lies between the
    collectives no block can hide (first gathers, last scatter, roots) and all of them, and shrinks as the
    blocks' compute grows."""
    cfg = gpt(16, 2048, 8, max_seq_len=8192, dropout=0.0)

    def step(seq_len: int):
        return plan_run(run_of(cfg, tokens=1e9, seq_len=seq_len, micro_batch=1, grad_accum=2, gpus=16, zero=3,
                               precision="bf16", gpu="h100-sxm"))

    p = step(1024)
    comm = p.to_json()["comm"]
    assert comm["all_gather"]["calls"] == 2 * (2 * 8 + 1)  # K = 2 micro-batches x (2 per block + the roots)
    assert comm["reduce_scatter"]["calls"] == 2 * (8 + 1)
    ops = {o["op"]: o["seconds"] for o in p.cluster.ops}
    everything = ops["nccl all_gather (dp)"] + ops["nccl reduce_scatter (dp)"]
    assert 0 < p.cluster.breakdown["dp_comm_s"] <= everything
    assert step(8192).cluster.breakdown["dp_comm_s"] <= p.cluster.breakdown["dp_comm_s"]


def test_fsdp1s_backward_post_waits_for_each_backward_gather_and_holds_one_block():
    """Layout.fsdp_prefetch "post" (FSDP1's BACKWARD_POST): a block's backward gather is issued only once the block
    after it has run back, so each one is exposed in full, where "pre" hides it under that block's backward. Worked
    by hand where every block's collectives fit under its backward (a long sequence): the step grows by K x blocks
    x one block's gather, nothing else moves; a block's backward starts with one gathered block less; --explain
    says so; a name not in FSDP_PREFETCHES is refused."""
    cfg = gpt(16, 2048, 8, max_seq_len=8192, dropout=0.0, tie_embeddings=False)
    K, blocks, gpus = 2, cfg.n_layers, 16
    run = run_of(cfg, tokens=1e9, seq_len=8192, micro_batch=1, grad_accum=K, gpus=gpus, zero=3, gpu="h100-sxm",
                 precision="bf16", checkpointing="none")
    lay = replace(run.layout, fsdp_copies=False, fsdp_grad_sync="micro-batch")
    pre, post = (plan_run(replace(run, layout=replace(lay, fsdp_prefetch=f))) for f in ("pre", "post"))
    n_block = param_counts(cfg, lay).layer
    gather = C.collective_seconds("all_gather", n_block * 2, gpus, _tier(lay, "dp", NODES["dgx-h100"]))
    grown = {k: post.cluster.breakdown[k] - pre.cluster.breakdown[k] for k in pre.cluster.breakdown}
    assert grown["dp_comm_s"] == pytest.approx(K * blocks * gather, rel=1e-9)
    assert all(v == 0 for k, v in grown.items() if k != "dp_comm_s")
    assert pre.to_json()["comm"] == post.to_json()["comm"]  # the same collectives, run later
    # where a block's reduce-scatter alone outlasts its backward (32 tokens), the link is the bound either way:
    # gather + reduce-scatter - backward exposed per block, the same step
    short = [plan_run(replace(run, seq_len=32, layout=replace(lay, fsdp_prefetch=f))) for f in ("pre", "post")]
    assert short[0].cluster.breakdown["dp_comm_s"] == pytest.approx(short[1].cluster.breakdown["dp_comm_s"],
                                                                     rel=1e-12)
    # the backward's high point: a block starts back with its activations, without the next block (2 bytes a
    # parameter) beside it; the step's peak is the loss's here, before any block runs back
    backward = {p.run.layout.fsdp_prefetch: fsdp_block_backward(p.run, 0, p.run.recipe, False,
                                                                rank_params(cfg, p.run.layout, 0))[0]
                for p in (pre, post)}
    assert backward["pre"] - backward["post"] == 2 * n_block
    assert pre.peak_bytes == post.peak_bytes
    assert "--fsdp-prefetch post" in explain_cluster(post) and "--fsdp-prefetch" not in explain_cluster(pre)
    # BACKWARD_POST is FSDP1's: a layout that names it gathers into flat parameters, without FSDP2's copies
    assert not make_layout(gpus, zero=3, fsdp_prefetch="post").fsdp_copies and make_layout(gpus, zero=3).fsdp_copies
    with pytest.raises(TrainwiseError, match="fsdp-prefetch 'later' must be one of pre, post"):
        make_layout(gpus, zero=3, fsdp_prefetch="later")


def test_zero2_under_torchs_pipeline_reduces_after_each_stages_last_backward():
    """FSDP2's ZeRO-2 under torch's pipeline schedules (trainwise's trainer, torchtitan) reduce-scatters a stage's
    gradients after its last backward, not under it: the whole reduce-scatter is exposed, and the parameters'
    gather runs under the next step's first forward. ZeRO-1 on the same layout (Megatron's distributed optimizer)
    reduces in buckets under the last backward, which hides it here."""
    cfg = gpt(16, 2048, 8, max_seq_len=2048, dropout=0.0, tie_embeddings=False)
    plans = {z: plan_run(run_of(cfg, tokens=1e9, seq_len=2048, micro_batch=1, grad_accum=4, gpus=16, pp=2, zero=z,
                                gpu="h100-sxm", precision="amp")) for z in (1, 2)}
    ops = {z: {o["op"]: o["seconds"] for o in p.cluster.ops} for z, p in plans.items()}
    step = {z: sum(s for name, s in o.items() if name.startswith("nccl all_reduce")) for z, o in ops.items()}
    assert ops[2]["nccl reduce_scatter (dp)"] > 0 and ops[2]["nccl all_gather (dp)"] > 0
    assert plans[2].cluster.breakdown["dp_comm_s"] == pytest.approx(ops[2]["nccl reduce_scatter (dp)"] + step[2])
    assert plans[1].cluster.breakdown["dp_comm_s"] == pytest.approx(step[1])
    assert "each stage's reduce-scatter after its last backward" in explain_cluster(plans[2])


def test_fsdp2s_mixed_precision_gathers_the_weights_in_the_compute_dtype():
    """Under autocast over fp32 weights (amp), FSDP2's policy gathers each block in bf16 and reduce-scatters in
    fp32, and autocast finds the weights cast already: zero 3's plan has no weight casts where zero 1's (fp32
    weights, all-gathered in fp32 once after the update) casts every weight it multiplies. Nor does it cast
    activations: on bf16 weights the residual stream is bf16 too (Recipe.record_precision); what is left is the
    loss's fp32 logits (the gradients reach FSDP2's fp32 reduce-scatter buffer in its own copy)."""
    cfg = gpt(16, 2048, 8, max_seq_len=8192, dropout=0.0)
    n_layer, n_root, n = 50_358_272, 121_634_816 + 4096, 16  # a block's parameters; the embedding's and the norm's
    plans = {zero: plan_run(run_of(cfg, tokens=1e9, seq_len=1024, micro_batch=1, grad_accum=2, gpus=n, zero=zero,
                                   precision="amp", gpu="h100-sxm")) for zero in (1, 3)}
    total = 8 * n_layer + n_root
    casts = {zero: {o["op"]: o["calls"] for o in p.cluster.ops if "_to_copy" in o["op"]} for zero, p in plans.items()}
    assert casts[1][WEIGHT_CAST] > 0 and WEIGHT_CAST not in casts[3]
    assert casts[3] == {"aten._to_copy": 2 * 2}  # 2 micro-batches: the logits up, their gradient down
    comm = {zero: p.to_json()["comm"] for zero, p in plans.items()}
    assert comm[1]["all_gather"]["bytes"] == total * 4 * (n - 1) // n
    # K = 2 micro-batches, each block gathered for forward and for backward, the roots once: 2 bytes each
    assert comm[3]["all_gather"]["bytes"] == 2 * (2 * 8 * n_layer + n_root) * 2 * (n - 1) // n
    # reduce-scattered once, after the last micro-batch, as trainwise's trainer runs amp (Layout.fsdp_grad_sync)
    assert comm[3]["reduce_scatter"]["bytes"] == total * 4 * (n - 1) // n
    assert plans[3].cluster.breakdown["compute_s"] < plans[1].cluster.breakdown["compute_s"]


def test_attention_kernels_by_implementation():
    """flash (PyTorch SDPA's kernel) and flash2 are FlashAttention-2's published rates; on Hopper flash3 and
    cudnn are those rates times each kernel's forward+backward speed-up over FlashAttention-2 in the
    FlashAttention-3 paper's panels (backward 2.5x the forward's FLOPs); both are refused off Hopper."""
    h100 = ACCELERATORS["h100-sxm"]
    fa2 = attention_rate(h100, 4096, 128)[0]
    assert attention_rate(h100, 4096, 128, "flash2")[0] == fa2 == 294e12

    def both(fwd: float, bwd: float) -> float:
        return 3.5 / (1 / fwd + 2.5 / bwd)

    assert attention_rate(h100, 4096, 128, "flash3")[0] == pytest.approx(fa2 * both(638, 542) / both(368, 310))
    assert attention_rate(h100, 4096, 128, "cudnn")[0] == pytest.approx(fa2 * both(609, 499) / both(368, 310))
    cfg = gpt(16, 2048, 4, max_seq_len=8192, dropout=0.0)

    def step(impl: str, gpu: str = "h100-sxm") -> float:
        return plan_run(run_of(cfg, tokens=1e9, seq_len=8192, gpus=8, gpu=gpu, attention_impl=impl)).step_seconds

    assert step("flash3") < step("cudnn") < step("flash") == step("flash2") < step("unfused")
    for impl in ("flash3", "cudnn"):
        with pytest.raises(TrainwiseError, match=f"--attention-impl {impl}.*A100 80GB"):
            step(impl, "a100-80gb")


def test_context_parallelism_by_implementation():
    """cp = 4 on one node, per layer: ring sends cp - 1 KV chunks forward and twice that backward under the
    attention kernels; allgather gathers all cp chunks before forward and again before backward and
    reduce-scatters their gradients, exposed; Ulysses (a2a) trades positions for heads with all-to-alls of
    q, k, v and the output each pass, and needs cp to divide the heads."""
    cfg = gpt(16, 2048, 4, max_seq_len=32768, dropout=0.0)

    def plan(impl: str, **kw):
        return plan_run(run_of(cfg, tokens=1e9, seq_len=32768, gpus=4, cp=4, gpu="h100-sxm", cp_impl=impl, **kw))

    ring, gather, ulysses = plan("ring"), plan("allgather"), plan("a2a")
    comm = {name: p.to_json()["comm"] for name, p in (("ring", ring), ("gather", gather), ("a2a", ulysses))}
    assert comm["ring"]["send_recv"]["calls"] == 3 * 3 * 4  # 3 (cp - 1) per layer, 4 layers
    assert comm["gather"]["all_gather"]["calls"] == 2 * 4 and comm["gather"]["reduce_scatter"]["calls"] >= 4
    assert comm["a2a"]["all_to_all"]["calls"] == 2 * 4
    assert ring.cluster.breakdown["cp_comm_s"] <= gather.cluster.breakdown["cp_comm_s"]
    assert ulysses.cluster.breakdown["cp_comm_s"] > 0 and ulysses.to_json()["layout"]["cp_impl"] == "a2a"
    with pytest.raises(TrainwiseError, match="cp must divide both"):
        plan_run(run_of(gpt(12, 1536, 4, max_seq_len=32768), tokens=1e9, seq_len=32768, gpus=8, cp=8,
                        gpu="h100-sxm", cp_impl="a2a"))


def test_fsdps_gradient_shards_are_reserved_beside_the_compute_streams_high_point():
    """FSDP's reduce-scatter allocates the sharded gradients on its own stream, and the caching allocator lends a
    freed block only to the stream that made it: the least it reserves (Plan.reserved_bytes, what torchtitan logs
    as memory) is the compute stream's high point, a backward's start with none of them, plus all of them. Worked
    where the loss's backward is the step's high point (a large vocabulary, one micro-batch): reserved - peak =
    the rank's gradients. DDP's buckets (made once, on the compute stream) and FSDP under a pipeline (the shards
    already in the plan's backward there) reserve their peak; the plan table and --json say it."""
    cfg = ModelConfig(vocab_size=65536, d_model=512, n_layers=2, n_heads=8, n_kv_heads=8, max_seq_len=4096)
    kw = dict(tokens=1e9, seq_len=4096, micro_batch=1, grad_accum=1, gpu="h100-sxm", precision="bf16",
              checkpointing="none")
    fsdp = plan_run(run_of(cfg, gpus=8, zero=3, **kw))
    rp = fsdp.peak_rank[1]
    assert rp.backward > rp.step and rp.grads > 0
    assert fsdp.reserved_bytes == fsdp.peak_bytes + rp.grads
    assert fsdp.to_json()["memory"]["reserved_bytes"] == fsdp.reserved_bytes
    assert "reserved / device" in plan_table(fsdp)
    piped = {**kw, "grad_accum": 2}
    for other in (plan_run(run_of(cfg, gpus=8, zero=0, **kw)), plan_run(run_of(cfg, gpus=8, pp=2, zero=3, **piped))):
        assert other.reserved_bytes == other.peak_bytes
        assert "reserved / device" not in plan_table(other)
