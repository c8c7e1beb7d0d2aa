"""HF config.json -> ModelConfig: parameter counts equal transformers' num_parameters() on the meta device."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from trainwise.cost.params import params
from trainwise.errors import TrainwiseError
from trainwise.hf_config import ALIASES, PUBLISHED, config_name, from_hf_dict, load_hf_config


def hf_count(d: dict, exclude_embeddings: bool = False) -> int:
    cfg = d if isinstance(d, transformers.PreTrainedConfig) else transformers.AutoConfig.for_model(**d)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.num_parameters(exclude_embeddings=exclude_embeddings)


def tiny(family: str) -> dict:
    """Small configs of each family, exercising the structural options (biases, GQA, MoE layout, MLA)."""
    base = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    return {
        "llama": dict(model_type="llama", **base, tie_word_embeddings=True),
        "llama-bias": dict(model_type="llama", **base, attention_bias=True, mlp_bias=True),
        "mistral": dict(model_type="mistral", **base),
        "mixtral": dict(model_type="mixtral", **base, num_local_experts=4, num_experts_per_tok=2),
        "qwen2": dict(model_type="qwen2", **base),
        "qwen3": dict(model_type="qwen3", **base, head_dim=16),
        "qwen3_moe": dict(model_type="qwen3_moe", **base, head_dim=16, num_experts=6, num_experts_per_tok=2,
                          moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[]),
        "gpt2": dict(model_type="gpt2", vocab_size=1000, n_embd=64, n_layer=3, n_head=4, n_positions=96),
        "deepseek_v3": dict(model_type="deepseek_v3", **{**base, "num_key_value_heads": 8}, moe_intermediate_size=32,
                            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, n_group=2, topk_group=1),
        "deepseek_v3-no-qlora": dict(model_type="deepseek_v3", **{**base, "num_key_value_heads": 8},
                                     moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                     n_shared_experts=2, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1),
        "gpt_oss": dict(model_type="gpt_oss", **base, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
    }[family]


FAMILIES = ["llama", "llama-bias", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt2", "deepseek_v3",
            "deepseek_v3-no-qlora"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_matches_transformers(family):
    d = tiny(family)
    count = params(from_hf_dict(d))
    assert count.total == hf_count(d)
    assert count.non_embedding == hf_count(d, exclude_embeddings=True)


def test_load_file_and_missing_field(tmp_path):
    d = dict(PUBLISHED["llama-3-8b"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    assert params(load_hf_config(path)).total == 8_030_261_248  # Meta's published 8.03B
    del d["hidden_size"]
    path.write_text(json.dumps(d))
    with pytest.raises(TrainwiseError, match="hidden_size"):
        load_hf_config(path)


def test_a_folder_holding_a_config_json_is_the_model_it_describes(tmp_path):
    from trainwise.planner.spec import load_model

    checkout = tmp_path / "Meta-Llama-3-8B"
    checkout.mkdir()
    (checkout / "config.json").write_text(json.dumps(PUBLISHED["llama-3-8b"]))
    model, run = load_model(str(checkout))
    assert (model.name, params(model).total, run) == ("Meta-Llama-3-8B", 8_030_261_248, None)
    with pytest.raises(TrainwiseError, match="is a folder without config.toml .* or config.json"):
        load_model(str(tmp_path / "Meta-Llama-3-8B" / ".."))


def test_unsupported_and_malformed(tmp_path):
    with pytest.raises(TrainwiseError, match="not supported"):
        from_hf_dict({"model_type": "bert"})
    with pytest.raises(TrainwiseError, match="model_type"):
        from_hf_dict({"hidden_size": 8})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(TrainwiseError, match="JSON"):
        load_hf_config(bad)
    with pytest.raises(TrainwiseError, match="divide"):
        from_hf_dict(dict(tiny("llama"), hidden_size=60, num_attention_heads=8, head_dim=None))
    # a size that is no whole number of at least 1: an error naming the field and its value, not a traceback
    for key, value in (("num_attention_heads", 0), ("hidden_size", "big"), ("num_hidden_layers", 32.0),
                       ("vocab_size", True), ("intermediate_size", -1)):
        with pytest.raises(TrainwiseError, match=f"'{key}' = {re.escape(json.dumps(value))}, which sizes the model"):
            from_hf_dict(dict(tiny("llama"), **{key: value}))


# ---------------------------------------------------------------------------------------------------
# The same model under the field names of transformers 4.x, of transformers 5.x, and of attribute_map

SAVED_BY_4 = json.loads((Path(__file__).parent / "data" / "hf_configs_transformers_4.json").read_text())
SAVED_FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gpt2", "deepseek_v3"]


def count_file(path: Path) -> int:
    return params(load_hf_config(path)).total


@pytest.mark.parametrize("family", SAVED_FAMILIES)
def test_saved_by_transformers_4_and_5_plan_alike(family, tmp_path):
    """A config.json written by transformers 4.57 (the Hub's names) and the same config re-saved by the
    installed transformers 5 (its names: rope_parameters, num_local_experts, ...) both count exactly as
    transformers builds them."""
    old = tmp_path / "v4" / "config.json"
    old.parent.mkdir()
    old.write_text(json.dumps(SAVED_BY_4[family]))
    cfg = transformers.AutoConfig.from_pretrained(old.parent)
    cfg.save_pretrained(tmp_path / "v5")
    new = tmp_path / "v5" / "config.json"
    saved = json.loads(new.read_text())
    want = hf_count(cfg)
    assert count_file(old) == count_file(new) == want
    assert hf_count(transformers.AutoConfig.from_pretrained(new.parent)) == want
    if family == "qwen3_moe":  # the renaming this test is about
        assert "num_experts" in SAVED_BY_4[family] and "num_local_experts" in saved and "num_experts" not in saved
    if family != "gpt2":  # 5.x moves rope_theta into rope_parameters, and trainwise follows it there
        assert "rope_theta" not in saved and load_hf_config(new).rope_theta == 5e4 == load_hf_config(old).rope_theta


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen3-30b-a3b",
                                  "deepseek-v3"])
def test_published_config_resaved_by_transformers_5_plans_like_the_hub_file(name, tmp_path):
    """The Hub's config.json of each preset, saved again by the installed transformers: the same plan
    (parameters, FLOPs, memory), not only the same total. No model is built, so the big ones run too."""
    from trainwise.cost.recipe import get_recipe
    from trainwise.cost.run import Run
    from trainwise.planner.plan import plan_run
    from trainwise.presets import get_preset

    transformers.AutoConfig.for_model(**PUBLISHED[name]).save_pretrained(tmp_path / name)

    def planned(model):
        j = plan_run(Run(model, micro_batch=2, seq_len=1024, recipe=get_recipe("bf16"), checkpointing="selective",
                         tokens=1e9)).to_json()
        return j["model"] | {"name": None}, j["flops"], j["memory"]

    assert planned(load_hf_config(tmp_path / name / "config.json")) == planned(get_preset(name))


@pytest.mark.parametrize("family", sorted(ALIASES))
def test_attribute_map_names(family):
    """Each name a config class's attribute_map accepts, used instead of the Hub's, counts the same."""
    d = dict(tiny(family))
    for alias, name in ALIASES[family].items():
        if name in d:
            d[alias] = d.pop(name)
    assert not set(ALIASES[family].values()) & set(d)
    assert params(from_hf_dict(d)).total == hf_count(d) == hf_count(tiny(family))


def test_aliases_cover_the_installed_transformers():
    """Every attribute_map of the supported families' config classes is known (either direction), so
    that a name a newer transformers adds fails here rather than planning a different model."""
    for family in SAVED_FAMILIES:
        cls = type(transformers.AutoConfig.for_model(model_type=family))
        known = {frozenset(pair) for pair in ALIASES.get(family, {}).items()}
        for pair in cls.attribute_map.items():
            assert frozenset(pair) in known, f"{family}: attribute_map {pair} not in trainwise.hf_config.ALIASES"


def _required_only(family: str) -> dict:
    keep = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "n_embd", "n_layer", "n_head", "n_positions", "num_local_experts",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}
    return {k: v for k, v in tiny(family).items() if k in keep}


@pytest.mark.parametrize("family", SAVED_FAMILIES)
def test_absent_fields_take_the_class_defaults(family):
    """Without the optional fields (kv heads, head_dim, tied embeddings, dense layers, q LoRA rank, ...)
    the count is that of transformers' class defaults, e.g. Qwen3's head_dim 128 and DeepSeek-V3's three
    dense layers and one shared expert."""
    d = _required_only(family)
    if family != "gpt2":
        d["num_attention_heads"] = 32  # Qwen2/Qwen3 default to 32 key/value heads
    if family == "deepseek_v3":
        d["num_hidden_layers"] = 5  # past first_k_dense_replace = 3
    assert params(from_hf_dict(d)).total == hf_count(d)


def test_name_comes_from_the_file(tmp_path, monkeypatch):
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny("qwen3")))
    (folder / "gpt2.json").write_text(json.dumps(tiny("gpt2")))
    assert load_hf_config(folder / "gpt2.json").name == "gpt2"
    assert load_hf_config(folder / "config.json").name == "Qwen3-0.6B"
    monkeypatch.chdir(folder)
    assert config_name(Path("config.json")) == "Qwen3-0.6B"


def test_two_names_for_one_field_must_agree():
    d = dict(tiny("qwen3_moe"), num_local_experts=6)  # same value as num_experts: fine
    assert params(from_hf_dict(d)).total == hf_count(tiny("qwen3_moe"))
    with pytest.raises(TrainwiseError, match="num_local_experts"):
        from_hf_dict(dict(tiny("qwen3_moe"), num_local_experts=7))


@pytest.mark.parametrize("dense, step", [([0], 1), ([0, 1], 1), ([], 3), ([0], 2)])
def test_qwen3_moe_layouts(dense, step):
    """mlp_only_layers and decoder_sparse_step, where they give 'dense first, then every n-th layer MoE'."""
    d = dict(tiny("qwen3_moe"), num_hidden_layers=5, mlp_only_layers=dense, decoder_sparse_step=step)
    assert params(from_hf_dict(d)).total == hf_count(d)


def test_qwen3_moe_layout_not_representable():
    with pytest.raises(TrainwiseError, match="mlp_only_layers"):
        from_hf_dict(dict(tiny("qwen3_moe"), num_hidden_layers=5, mlp_only_layers=[2], decoder_sparse_step=1))


@pytest.mark.slow
@pytest.mark.parametrize("family", SAVED_FAMILIES)
def test_every_field_of_the_config_class(family):
    """Change each integer/boolean field (and attribute_map name) of the family's transformers config
    class in turn: trainwise counts what transformers builds, or refuses with a TrainwiseError; it
    never plans a different model. (~3 s per family: one meta-device build per change.)"""
    d0 = tiny(family)
    cls = type(transformers.AutoConfig.for_model(**d0))
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    names = [f.name for f in dataclasses.fields(cls) if f.name not in base]
    names += [n for pair in cls.attribute_map.items() for n in pair]
    checked = 0
    for name in names:
        value = getattr(transformers.AutoConfig.for_model(**d0), name, None)
        if isinstance(value, bool):
            changes = [not value]
        elif isinstance(value, int):
            changes = [value * 2, value + 1] if value else [1, 2]
        else:
            changes = [2, 4] if value is None else (["gelu"] if name in ("hidden_act", "activation_function") else [])
        for change in changes:
            d = dict(d0, **{name: change})
            for a, b in cls.attribute_map.items():  # one name per field, as a saved file has
                if name in (a, b):
                    d.pop(b if name == a else a, None)
            try:
                want = hf_count(d)
            except Exception:  # noqa: BLE001 - transformers itself refuses this value
                continue
            try:
                got = params(from_hf_dict(d)).total
            except TrainwiseError:
                continue
            assert got == want, f"{family}: {name} = {change}"
            checked += 1
    assert checked >= 10


# ---------------------------------------------------------------------------------------------------
# One translator for `trainwise plan` and `trainwise train --init-from` (build=True)

REAL = {**{f"tiny:{f}": tiny(f) for f in FAMILIES}, **{f"saved:{f}": SAVED_BY_4[f] for f in SAVED_FAMILIES},
        **{f"published:{n}": d for n, d in PUBLISHED.items()}}


@pytest.mark.parametrize("name", sorted(REAL))
def test_plan_and_init_from_read_a_config_alike(name):
    """--init-from builds the model the planner counts, or refuses what trainwise does not build
    (Mistral-7B's 4096-token sliding window, shorter than its 32768 positions)."""
    planned = from_hf_dict(REAL[name])
    if name == "published:mistral-7b":
        with pytest.raises(TrainwiseError, match="sliding_window = 4096 < max_position_embeddings = 32768"):
            from_hf_dict(REAL[name], build=True)
    else:
        assert from_hf_dict(REAL[name], build=True) == planned


def test_gated_activations():
    """Every hidden_act name of a gated MLP either reader knew: trainwise's geglu is the tanh GELU, so the
    exact one ("gelu") is planned (same parameters and FLOPs) but not built."""
    for act, ours in [("silu", "swiglu"), ("swish", "swiglu"), ("gelu_pytorch_tanh", "geglu"), ("gelu_new", "geglu")]:
        d = dict(tiny("llama"), hidden_act=act)
        assert from_hf_dict(d).activation == from_hf_dict(d, build=True).activation == ours
    assert from_hf_dict(dict(tiny("llama"), hidden_act="gelu")).activation == "geglu"
    with pytest.raises(TrainwiseError, match="exact GELU"):
        from_hf_dict(dict(tiny("llama"), hidden_act="gelu"), build=True)


def test_no_moe_layer_reads_as_a_dense_model():
    for d in (dict(tiny("qwen3_moe"), mlp_only_layers=[0, 1, 2]), dict(tiny("deepseek_v3"), first_k_dense_replace=3)):
        cfg = from_hf_dict(d)
        assert not cfg.is_moe and cfg == from_hf_dict(d, build=True)
        assert params(cfg).total == hf_count(d)
