"""Every preset's parameter count equals transformers' num_parameters() for its published config.json."""

import tracemalloc
from collections import OrderedDict

import pytest
import torch
import transformers

from trainwise.cost.layout import make_layout
from trainwise.cost.params import params
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.errors import TrainwiseError
from trainwise.hf_config import PUBLISHED
from trainwise.measure import record
from trainwise.planner.plan import plan_run
from trainwise.presets import PRESETS, get_preset

REQUIRED = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-2-7b", "llama-3-8b", "llama-3-70b",
            "llama-3.1-405b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "deepseek-v3", "qwen3-30b-a3b",
            "qwen3-235b-a22b", "gpt-oss-120b", "gpt-oss-20b",
            "trainwise-small"]
# Published totals (model cards / HF Hub "Safetensors: model size"), for a second, independent check.
PUBLISHED_TOTALS = {"gpt2": 124_439_808, "llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248,
                    "llama-3-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800, "mistral-7b": 7_241_732_096,
                    "mixtral-8x7b": 46_702_792_704, "qwen2.5-7b": 7_615_616_512, "qwen3-30b-a3b": 30_532_122_624}
SLOW = {"llama-3.1-405b", "deepseek-v3", "llama-3-70b", "gpt2-xl", "gpt2-large", "qwen3-235b-a22b"}
MARKS = {n: pytest.mark.slow for n in SLOW}


def test_required_presets_exist():
    assert set(REQUIRED) <= set(PRESETS)


def hf_count(name):
    cfg = transformers.AutoConfig.for_model(**PUBLISHED[name])
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg).num_parameters()


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS[n]) if n in MARKS else n for n in PUBLISHED])
def test_preset_matches_transformers(name):
    assert params(get_preset(name)).total == hf_count(name)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_preset_matches_published_total(name):
    assert params(get_preset(name)).total == PUBLISHED_TOTALS[name]


def test_moe_active_below_total():
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"):
        c = params(get_preset(name))
        assert c.active < c.total
    c = params(get_preset("qwen3-235b-a22b"))  # its model card: 235B in total, 22B activated
    assert round(c.total / 1e9) == 235 and round(c.active / 1e9) == 22
    # DeepSeek-V3 report: 671B total, 37B activated (without the 14B MTP module, which HF does not build)
    c = params(get_preset("deepseek-v3"))
    assert round(c.total / 1e9) == 671 and round(c.active / 1e9) in (37, 38)


@pytest.mark.parametrize("mfu, python_bytes", [(0.4, 5e6), (None, 1e8)])
def test_405b_plan_is_tensor_free_and_records_two_layers_at_most(mfu, python_bytes, monkeypatch):
    """The what-if (an assumed MFU) is arithmetic: it records no operators. The cluster model records the
    operators of one block on fake tensors, recorded one and two blocks deep and differenced (measure.record
    .block_ops), never the whole model: neither allocates a 405B tensor (one would be ~1.6 TB)."""
    depths, run = [], record._run
    monkeypatch.setattr(record, "_run", lambda cfg, *a, **k: depths.append(cfg.n_layers) or run(cfg, *a, **k))
    # a record memoised by an earlier test would leave nothing to count
    monkeypatch.setattr("trainwise.planner.cluster_step._CACHE", {})
    monkeypatch.setattr(record, "_RECORDED", OrderedDict())
    tracemalloc.start()
    layout = make_layout(16384, tp=8, pp=16, zero=1, micro_batches=16)
    plan = plan_run(Run(get_preset("llama-3.1-405b"), seq_len=8192, grad_accum=16, recipe=get_recipe("bf16"),
                        checkpointing="full", layout=layout, tokens=15e12, machine=Machine(gpu="h100")), mfu=mfu)
    plan.to_json(), plan.explain()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < python_bytes  # bytes of Python objects
    if mfu is not None:
        assert depths == []
    else:
        assert depths and max(depths) <= 2, depths


def test_unknown_preset_suggests():
    with pytest.raises(TrainwiseError, match="llama-3-8b"):
        get_preset("lama-3-8b")
