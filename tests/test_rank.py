"""trainwise.cost.rank: what one rank of trainwise's tensor-, pipeline- and data-parallel runs holds and
sends, against numbers worked by hand (the runs themselves are checked in tests/test_tp_pp.py)."""

from __future__ import annotations

import math

import pytest
from tp_pp_worker import config

from trainwise.config import ModelConfig
from trainwise.cost import rank as R
from trainwise.cost.comm import bytes_sent
from trainwise.cost.layout import Layout, param_counts
from trainwise.cost.params import params
from trainwise.cost.schedule import in_flight, rank_stages, stage_layers
from trainwise.runtime.step import build_model

TINY = dict(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def test_bytes_sent_by_a_ring():
    """cost.comm.bytes_sent of a collective's buffer S over w ranks, as the plan and the run's counter use it."""
    assert bytes_sent("all_reduce", 1000, 4) == 1500  # 2 x 3/4 x 1000
    assert bytes_sent("all_gather", 400, 4) == 300  # its 100-byte shard to 3 others
    assert bytes_sent("reduce_scatter", 400, 4) == 300  # 3 partial 100-byte shards out
    assert bytes_sent("all_to_all", 1000, 4) == 750
    assert bytes_sent("send_recv", 10, 2) == 10
    assert bytes_sent("all_reduce", 1000, 1) == 0


@pytest.mark.parametrize("extra", [
    {}, {"tie_embeddings": False, "n_kv_heads": 4},
    {"n_experts": 4, "top_k": 2, "n_shared_experts": 1, "first_dense_layers": 1},
    {"bias": True, "norm": "layernorm", "position": "learned", "activation": "gelu", "qk_norm": True},
    {"attention": "mla", "kv_lora_rank": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 16,
     "q_lora_rank": 24},
])
def test_the_split_model_has_the_models_parameters(extra):
    cfg = ModelConfig(**{**TINY, **extra})
    assert sum(math.prod(s.shape) for s in R.model_params(cfg)) == params(cfg).total


def test_chunks_cut_as_torch_chunk_does():
    assert [R.chunk(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    assert [R.chunk(5, 4, i) for i in range(4)] == [2, 2, 1, 0]


def held(cfg: ModelConfig, layout: Layout, rank: int) -> int:
    """Elements of parameters the rank holds."""
    return sum(p.numel for p in R.rank_params(cfg, layout, rank))


def test_a_tp_rank_holds_half_of_every_matrix_and_all_of_every_norm():
    """d_model 32, 4 heads of 8 (2 KV heads), F 128 (SwiGLU), vocab 300, tied. tp 2: embedding 150 x 32 = 4800;
    per block norm1 32 + q 16 x 32 + k 8 x 32 + v 8 x 32 + out 32 x 16 + norm2 32 + gate, up 64 x 32 + proj
    32 x 64 = 7744; final norm 32: 4800 + 2 x 7744 + 32 = 20320 elements, 81280 bytes; FSDP2 over 2 more
    ranks halves every tensor's first dimension: 40640 bytes."""
    cfg = ModelConfig(**TINY)
    assert held(cfg, Layout(tp=2), 1) == 20320
    assert held(cfg, Layout(dp=2, tp=2, zero=3), 3) == 10160


def test_pipeline_stages_hold_their_layers_the_embedding_and_the_head():
    """pp 2, untied: stage 0 the embedding (9600) and block 0 (15424), stage 1 block 1, the final norm (32) and
    the LM head (9600)."""
    cfg = ModelConfig(**{**TINY, "tie_embeddings": False})
    layout = Layout(pp=2)
    assert held(cfg, layout, 0) == 9600 + 15424
    assert held(cfg, layout, 1) == 15424 + 32 + 9600
    # cost.schedule.chunk_layers: the last stage holds the head
    assert [list(stage_layers(5, 2, s)) for s in (0, 1)] == [[0, 1, 2], [3, 4]]
    assert rank_stages(Layout(pp=2, vpp=2, pp_schedule="interleaved"), 1) == [1, 3]


def test_micro_batches_in_flight_per_schedule():
    """1F1B: rank r of pp holds pp - r micro-batches (PipeDream-Flush); GPipe all K; interleaved 1F1B
    (pp 2, vpp 2, K 4, 2 rounds of 2): rank 0 warms up with (2 - 1) x 2 + 2 x (2 - 1 - 0) = 4 forwards
    (chunks 0, 0, 1, 1) and runs a fifth before its first backward; rank 1 warms up with 2. in_flight
    lists the micro-batches in flight at each backward of the step; the most is the first."""
    def most(layout: Layout, rank: int, k: int) -> list[int]:
        return max((live for live, _ in in_flight(layout, rank, k)), key=len)

    assert [len(most(Layout(pp=4), r, 8)) for r in range(4)] == [4, 3, 2, 1]
    gpipe = in_flight(Layout(pp=2, pp_schedule="gpipe"), 1, 3)
    assert [len(live) for live, _ in gpipe] == [3, 2, 1]  # every forward first, then the backwards free them
    interleaved = Layout(pp=2, vpp=2, pp_schedule="interleaved")
    assert sorted(most(interleaved, 0, 4)) == [0, 0, 0, 1, 1]
    assert len(most(interleaved, 1, 4)) == 3


def test_data_parallel_collectives_of_a_step():
    """dp 2, tiny tied model, K 2. fsdp: per micro-batch the root (embedding + final norm: 9632 elements, a
    4816-element shard) and each block (15424: 7712) all-gathered before forward and again before backward:
    12 calls, (2 x 4816 + 4 x 7712) x 4 x 2 micro-batches = 323840 bytes; one reduce-scatter of each unit's
    fp32 gradients: 80960 bytes; the gradient norm's scalar: 4 bytes. DDP: one 161920-byte bucket, then the map of
    the tensors each rank used (find_unused_parameters: 14 int32, the embedding, each block's 2 norms, fused qkv,
    out, fused gate-up and down projections, the final norm: 56 bytes)."""
    cfg, shape = ModelConfig(**TINY), R.StepShape(2, 32, 2, 4, 4)
    assert R.rank_comm(cfg, Layout(dp=2, zero=3), 0, shape) == {
        "all_gather": {"calls": 12, "bytes": 323840}, "all_reduce": {"calls": 1, "bytes": 4},
        "reduce_scatter": {"calls": 3, "bytes": 80960}}
    assert R.rank_comm(cfg, Layout(dp=2, zero=0), 0, shape) == {"all_reduce": {"calls": 2, "bytes": 161920 + 56}}


DENSE_UNTIED = {**TINY, "tie_embeddings": False}
MOE = {**TINY, "n_experts": 4, "top_k": 2, "n_shared_experts": 1, "first_dense_layers": 1}


@pytest.mark.parametrize("model, layout", [
    (TINY, Layout(tp=2)), (MOE, Layout(tp=2)), (DENSE_UNTIED, Layout(pp=2)),
    ({**DENSE_UNTIED, "n_layers": 4}, Layout(pp=2, vpp=2, pp_schedule="interleaved")),
    (DENSE_UNTIED, Layout(tp=2, pp=2)), ({**MOE, "tie_embeddings": False}, Layout(tp=2, pp=2)),
    (TINY, Layout(dp=2, tp=2, zero=3)),
])
def test_the_planners_rank_is_the_trainers_rank(model, layout):
    """The cluster step's per-rank count (cost.layout.param_counts: dense layers, MoE layers and experts,
    embedding on the first pipeline rank, final norm and head on the last) equals cost.rank's, parameter by
    parameter as tensor parallelism and the pipeline place them, on every rank of the layouts trainwise
    trains (under FSDP before the dp shard)."""
    cfg = ModelConfig(**model)
    counts = param_counts(cfg, layout)
    for rank in range(layout.gpus):
        pp_rank = layout.coords(rank)[1]
        idx = [i for st in rank_stages(layout, pp_rank) for i in stage_layers(cfg.n_layers, layout.stages, st)]
        n_moe = sum(cfg.is_moe_layer(i) for i in idx)
        planned = ((len(idx) - n_moe) * counts.layer + n_moe * counts.moe_layer
                   + (counts.embedding if pp_rank == 0 else 0) + (counts.head if pp_rank == layout.pp - 1 else 0))
        assert planned == sum(p.tp_numel for p in R.rank_params(cfg, layout, rank)), rank


def test_ep_under_fsdp_messages_worked_by_hand():
    """FSDP2 beside ep shards, gathers and reduce-scatters the dense parameters only; the experts stay whole on
    their edp ranks, all-reduced over them as under DDP. "ep_fsdp" (dp 2 = ep 2, fsdp, K = 2, two MoE layers):
    40736 dense floats (the table 9600, two blocks of 15568) in three units, each gathered before each forward
    and backward of both micro-batches (12 calls; 4 x 40736 x 1/2 = 81472 B per round of three, x 4 = 325888 B),
    reduce-scattered once (3 calls, 81472 B); the experts (half of 98304 floats a rank) have no other rank (edp 1):
    all-reduces of the norm (4 B) and the two layers' loads (32 B). "dp_ep_zero2" (dp 4 = edp 2 x ep 2, zero2,
    K = 2, 40608 dense floats): 6 gathers (2 x 4 x 40608 x 3/4 = 243648 B), 3 reduce-scatters (121824 B); the
    rank's 24576 expert floats all-reduced over edp 2 (98304 B), the norm over 4 ranks (6 B), the load (24 B)."""
    fsdp = R.rank_comm(config("ep_fsdp").model, Layout(dp=2, ep=2, zero=3), 0, R.StepShape(2, 16, 2, 4, 4))
    assert (fsdp["all_gather"], fsdp["reduce_scatter"], fsdp["all_reduce"]) == (
        {"calls": 12, "bytes": 325888}, {"calls": 3, "bytes": 81472}, {"calls": 2, "bytes": 36})
    zero2 = R.rank_comm(config("dp_ep_zero2").model, Layout(dp=4, ep=2, zero=2), 3, R.StepShape(2, 16, 2, 4, 4))
    assert (zero2["all_gather"], zero2["reduce_scatter"], zero2["all_reduce"]) == (
        {"calls": 6, "bytes": 243648}, {"calls": 3, "bytes": 121824}, {"calls": 3, "bytes": 98304 + 6 + 24})
    params = [(name, p.numel()) for name, p in build_model(config("ep_fsdp").model).named_parameters()]
    assert sum(n for name, n in params if ".experts_" not in name) == 40736  # the dense floats above, counted
