"""Memory formulas: ZeRO-paper bytes per parameter, sharding, activations, tensor bytes, size parsing."""

import pytest

from trainwise.config import ModelConfig
from trainwise.cost.memory import activation_bytes, activation_bytes_per_token_layer, state_bytes, tensor_bytes
from trainwise.cost.recipe import get_recipe
from trainwise.errors import TrainwiseError
from trainwise.units import parse_bytes


def test_fp32_adamw_16_bytes():
    # docs/ARCHITECTURE.md, "The worked example"
    assert state_bytes(10**9, get_recipe("fp32"), "adamw").total == 16 * 10**9


def test_zero_paper_mixed_precision():
    # ZeRO paper (Rajbhandari et al. 2020) section 3.1: 7.5B params, Adam, mixed precision = 120 GB;
    # figure 1 with Nd = 64: stage 1 -> 31.4 GB, stage 2 -> 16.6 GB, stage 3 -> 1.88 GB.
    r, n = get_recipe("bf16"), 7.5e9
    assert state_bytes(n, r, "adamw").total == 120e9
    assert state_bytes(n, r, "adamw", zero=1, dp=64).total / 1e9 == pytest.approx(31.4, abs=0.05)
    assert state_bytes(n, r, "adamw", zero=2, dp=64).total / 1e9 == pytest.approx(16.6, abs=0.05)
    assert state_bytes(n, r, "adamw", zero=3, dp=64).total / 1e9 == pytest.approx(1.88, abs=0.01)


def test_other_recipes():
    n = 10**9
    assert state_bytes(n, get_recipe("bf16-pure"), "adamw").total == 8 * n
    assert state_bytes(n, get_recipe("fp32"), "sgd").total == 8 * n
    assert state_bytes(n, get_recipe("fp32"), "sgd-momentum").total == 12 * n
    assert state_bytes(n, get_recipe("fp32"), "adamw", model_parallel=8).total == 2 * n


def test_tensor_bytes_worked_example():
    t = tensor_bytes((8, 1024, 4096), "bf16")
    assert t.bytes == 67_108_864 and t.mib == 64 and round(t.mb, 1) == 67.1


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("1e9") == 10**9
    for bad in ("eighty", "-1GB", "0"):
        with pytest.raises(TrainwiseError):
            parse_bytes(bad)


def test_activation_per_layer_hand_worked():
    # H=256, nh=8, nkv=4, hd=32, q=256, kv=128, F=704, SwiGLU, RMSNorm, RoPE, fp32
    # (c = s = 4), the tensors autograd really saves (read with saved_tensors_hooks):
    # attention: RMSNorm 2*4H + 4, qkv input 4H, qkv output 4*(q+2kv), RoPE'd q,k 4*(q+kv), SDPA out
    #   4q (= o_proj input) + logsumexp 4*nh
    # MLP: RMSNorm 2*4H + 4, fc input 4H, gate|up output 2*4F and product 4F (act(gate) computed again in
    # backward: model.layers.GatedUnit)
    cfg = ModelConfig()
    norm = 2 * 4 * 256 + 4
    attn = norm + 4 * 256 + 4 * 512 + 4 * 384 + 4 * 256 + 32
    mlp = norm + 4 * 256 + 12 * 704
    cfg = ModelConfig(n_heads=8, n_kv_heads=4)
    assert activation_bytes_per_token_layer(cfg, get_recipe("fp32"), 0) == attn + mlp == 19_240
    # amp: the matmul inputs and outputs in bf16 (one cast of the fused qkv input, one of the fused
    # gate|up input), fp32 residual stream and norms
    amp = (norm + 2 * 256 + 2 * 512 + 2 * 384 + 2 * 256 + 32) + (norm + 2 * 256 + 6 * 704)
    assert activation_bytes_per_token_layer(cfg, get_recipe("amp"), 0) == amp == 11_688


def test_activation_checkpointing_orders_and_logits():
    cfg = ModelConfig()
    r = get_recipe("amp")
    none, sel, full = (activation_bytes(cfg, r, 8, 256, c) for c in ("none", "selective", "full"))
    assert full < sel < none
    per_layer = activation_bytes_per_token_layer(cfg, r, 0)
    head = 16 + (2 * 4 * 256 + 4) + 2 * 256 + 4 * 4096  # ids+targets, final norm, LM head in, fp32 log-probs
    block_weights = 256 * 512 + 256 * 256 + 3 * 256 * 704  # qkv, out, fc (2F), proj
    weights = 2 * (4 * block_weights + 4096 * 256)  # autocast's bf16 weight copies, LM head included
    assert none == 8 * 256 * (4 * per_layer + head) + weights
    assert full == 8 * 256 * (4 * 4 * 256 + head) + 2 * 4096 * 256  # block inputs; recompute is in peak_bytes
    # no T^2 term (SDPA): the per-token part doubles with T
    fp32 = get_recipe("fp32")
    assert activation_bytes(cfg, fp32, 8, 128, "none") * 2 == activation_bytes(cfg, fp32, 8, 256, "none")


def test_fsdp2_zero2_layout_is_a_gathered_compute_copy_over_fp32_shards():
    from trainwise.cost.memory import state_bytes
    from trainwise.cost.recipe import fsdp2_zero2_recipe, get_recipe

    n = 1_000_000  # amp (bf16 autocast): bf16 copy replicated; fp32 grads, moments and master sharded
    s = state_bytes(n, fsdp2_zero2_recipe(get_recipe("amp")), "adamw", zero=2, dp=4)
    assert (s.params, s.grads, s.optimizer, s.master) == (2 * n, n, 2 * n, n)
    s = state_bytes(n, fsdp2_zero2_recipe(get_recipe("fp32")), "sgd", zero=2, dp=2)  # fp32: the gathered copy is fp32
    assert (s.params, s.grads, s.optimizer, s.master) == (4 * n, 2 * n, 0, 2 * n)


def test_zero1_partition_is_whole_tensor_greedy_per_group():
    from trainwise.cost.memory import zero1_partition

    # group 1, largest first: 6 -> rank 0, 4 -> rank 1, 3 -> rank 1 (4 < 6); group 2: 5 -> rank 0 (6 < 7)
    assert zero1_partition([[3, 6, 4], [5]], 2) == [11, 7]
    assert zero1_partition([[2, 2, 2, 2]], 2) == [4, 4]
    assert zero1_partition([[10], [1, 1]], 3) == [10, 1, 1]
    assert sum(zero1_partition([[7, 1, 9], [3]], 4)) == 20


def test_rank_peak_terms_per_strategy():
    """Per-rank peaks order as the strategies shard: replicated DDP >= ZeRO-1 > FSDP (ZeRO-3); DDP's buckets
    hold the gradients at the start of backward even at K = 1; FSDP gathers two blocks + the root."""
    from trainwise.config import ZERO_STAGE
    from trainwise.cost.layout import Layout, make_layout
    from trainwise.cost.rank_memory import rank_peak
    from trainwise.cost.run import Run

    cfg, r = ModelConfig(n_heads=8, n_kv_heads=4), get_recipe("fp32")

    def layout(strategy: str) -> Layout:
        return Layout() if strategy == "none" else make_layout(4, zero=ZERO_STAGE[strategy])

    peak = {s: rank_peak(Run(cfg, 8, 256, recipe=r, layout=layout(s))).peak
            for s in ("none", "ddp", "zero1", "zero2", "fsdp")}
    assert peak["ddp"] >= peak["none"] and peak["ddp"] > peak["zero1"] > peak["fsdp"]
    assert peak["zero2"] > peak["fsdp"]  # zero2 keeps every gathered block until backward
    from trainwise.cost.params import params

    assert peak["ddp"] - peak["none"] == state_bytes(params(cfg).total, r, "adamw").grads
