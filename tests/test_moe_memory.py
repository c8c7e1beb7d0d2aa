"""Planner memory vs tracked memory of real CPU steps of a MoE model (trainwise-moe-small's shape,
shrunk): states within 1%, peak within 10%, the same bars as the dense models in test_memtrack.py.
And the planner's per-token MoE term against what autograd actually saves in one MoE block."""

import contextlib
import dataclasses

import pytest
import torch
from test_memtrack import check, track_vs_plan  # tests/ is on sys.path (rootdir conftest), as for `tiny`

from trainwise.cost.memory import moe_saved_bytes
from trainwise.cost.recipe import get_recipe
from trainwise.model.moe import MoE, pad_multiple
from trainwise.presets import get_preset

CPU = torch.device("cpu")


def moe_cfg(**kw):
    """trainwise-moe-small (8 SwiGLU experts of half the dense width, top-2, RMSNorm, RoPE, GQA) with a
    smaller d_model, depth and vocabulary so that a step takes well under a second on one core."""
    shape = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=256,
                 ffn_hidden=176, expert_ffn_hidden=88)
    shape.update(kw)
    return dataclasses.replace(get_preset("trainwise-moe-small"), **shape)


def measure(precision: str, checkpointing: str, micro_batch: int = 4, seq_len: int = 256):
    return track_vs_plan(moe_cfg(max_seq_len=seq_len), precision, checkpointing, micro_batch, seq_len)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_moe_memory_tracked_vs_planned(precision, checkpointing):
    assert moe_cfg().is_moe_layer(0)
    check(*measure(precision, checkpointing))


def saved_bytes(block: MoE, x: torch.Tensor, precision: str) -> int:
    """Sum of the unique storages autograd saves in one forward, parameters excluded."""
    param_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        block(x)
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("grouped_mm", [None, False])
def test_moe_saved_bytes_per_token(precision, grouped_mm):
    """The per-token slope of what one MoE block saves (two token counts, so the per-parameter weight
    copies and O(E) terms cancel) equals moe_saved_bytes exactly, on both dispatch paths."""
    cfg = moe_cfg()
    torch.manual_seed(0)
    block = MoE(cfg)
    block.grouped_mm, block.pad_groups = grouped_mm, False  # the groups as routed, which the planner counts
    xs = [torch.randn(1, n, cfg.d_model, requires_grad=True) for n in (128, 256)]
    measured = [saved_bytes(block, x, precision) for x in xs]
    recipe = get_recipe("fp32" if precision == "fp32" else "amp")
    c = recipe.compute_bytes
    expected = moe_saved_bytes(cfg, recipe, 3 * c * cfg.expert_ffn_hidden)  # a GatedUnit per assignment
    assert (measured[1] - measured[0]) / 128 == expected
    if grouped_mm is None and precision == "bf16":  # a CPU's padded groups (moe.GROUP_SIZES) save a little more:
        block.pad_groups = True  # the padding buffer whole (E x multiple rows more), the padded rows of the
        # experts' saved activations (H, 2F and F wide), the rows' index (8 bytes a row), and the cast
        # input as well as the buffer (index_copy keeps its source for its backward's shape)
        for x, routed in zip(xs, measured):
            S, multiple = x.shape[1] * cfg.top_k, pad_multiple(x.shape[1] * cfg.top_k)
            bound = cfg.n_experts * multiple * c * (cfg.d_model + 3 * cfg.expert_ffn_hidden) + S * (8 + c * cfg.d_model)
            assert routed < saved_bytes(block, x, precision) <= routed + bound
