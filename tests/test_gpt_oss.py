"""gpt-oss: the presets count what transformers builds, a checkpoint saved by transformers imports with its
logits and greedy continuations, export and re-import are exact, a step trains, and the planner records it
on fake tensors. The tiny model has every gpt-oss feature in play: sliding windows shorter than the
sequence, sinks and biases off zero, YaRN, and a clamp limit that about a fifth of the experts' inputs pass."""

import dataclasses
import json

import pytest
import torch

from test_export import compare_with_hf  # tests/ is on sys.path (rootdir conftest), as for `tiny`
from trainwise.cli import main
from trainwise.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from trainwise.errors import TrainwiseError
from trainwise.export.hf import load_hf_dir, load_into, save_hf, write_hf_tokenizer
from trainwise.hf_config import PUBLISHED, choose_family, from_hf_dict, to_hf_dict
from trainwise.measure.record import _minus, _record, block_ops
from trainwise.model import Transformer
from trainwise.model.layers import yarn_frequencies
from trainwise.presets import get_preset
from trainwise.runtime.mesh import check_layout
from trainwise.runtime.parallelize import use_compiled_attention, use_unfused_attention
from trainwise.runtime.step import build_model, build_step
from trainwise.tokenizer import Tokenizer

import transformers

# transformers' GptOssConfig for the tiny model: 4 layers (windowed, full, windowed, full), windows of 4 of
# the 16 tokens compared, swiglu_limit 1 so that the clamps act at initializer_range 0.1
TINY_HF = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, swiglu_limit=1.0,
               max_position_embeddings=64, initializer_range=0.1)
# the same model as trainwise describes it (what from_hf_dict reads from TINY_HF)
TINY = dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=32, n_experts=4, top_k=2,
            expert_ffn_hidden=32, activation="clamped_swiglu", swiglu_limit=1.0, bias=True, router_logit_bias=True,
            attention_sinks=True, sliding_window=4, full_attention_every=2, rope_theta=150000.0, rope_scaling="yarn",
            rope_factor=32.0, rope_original_max_seq_len=4096, yarn_truncate=False, max_seq_len=64, tie_embeddings=False)
# the totals transformers builds: the model card's 116.83B and 20.91B
TOTALS = {"gpt-oss-120b": 116_829_156_672, "gpt-oss-20b": 20_914_757_184}


@pytest.fixture(scope="module")
def tokenizer(corpus) -> Tokenizer:
    return Tokenizer.train([corpus.read_text(encoding="utf-8")], 300)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def hf_model(vocab_size: int) -> transformers.GptOssForCausalLM:
    """A random GptOssForCausalLM of TINY_HF: sinks N(0, 1), the other 1-D weights (biases, norm gains) moved
    0.1 off their init, so that a mis-mapped tensor shows in the logits."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**TINY_HF, vocab_size=vocab_size)
    hf = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) if name.endswith("sinks") else 0.1 * torch.randn_like(p))
    return hf


def tw_model(vocab_size: int) -> Transformer:
    """A random trainwise gpt-oss of TINY, its biases, gains and sinks off their init."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=vocab_size, init_std=0.1, **TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) if name.endswith("sinks") else 0.1 * torch.randn_like(p))
    return model


# ---------------------------------------------------------------------------------------------------
# The presets


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b"])
def test_preset_parameters_equal_transformers(name):
    """The model trainwise builds for the preset (on the meta device) has transformers' parameter count:
    sinks, router and expert biases included."""
    cfg = transformers.AutoConfig.for_model(**PUBLISHED[name])
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    model = build_model(get_preset(name), "meta")
    assert sum(p.numel() for p in model.parameters()) == hf.num_parameters() == TOTALS[name]


def test_presets_are_the_published_shapes():
    big, small = get_preset("gpt-oss-120b"), get_preset("gpt-oss-20b")
    assert (big.n_layers, big.n_experts, small.n_layers, small.n_experts) == (36, 128, 24, 32)
    for cfg in (big, small):
        assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.top_k, cfg.expert_ffn_hidden,
                cfg.vocab_size, cfg.tie_embeddings) == (2880, 64, 8, 64, 4, 2880, 201_088, False)
        assert (cfg.sliding_window, cfg.full_attention_every, cfg.rope_scaling, cfg.rope_factor) == (128, 2, "yarn", 32)
        assert [cfg.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]


def test_yarn_tables_equal_transformers():
    """The presets' RoPE frequencies and attention factor are those transformers derives from the Hub's
    rope_scaling (4.x's name), and with truncate (its default) as well."""
    published = PUBLISHED["gpt-oss-20b"]
    for change in ({}, {"truncate": True}):
        d = dict(published, rope_scaling={**published["rope_scaling"], **change})
        rotary = transformers.GptOssForCausalLM(transformers.AutoConfig.for_model(
            **{**d, "num_hidden_layers": 1, "num_local_experts": 1, "num_experts_per_tok": 1, "hidden_size": 64,
               "intermediate_size": 8, "vocab_size": 8})).model.rotary_emb
        inv_freq, scale = yarn_frequencies(from_hf_dict(d))
        assert torch.equal(inv_freq, rotary.inv_freq) and scale == rotary.attention_scaling


# ---------------------------------------------------------------------------------------------------
# Import (--init-from) and export


def test_a_checkpoint_saved_by_transformers_imports_with_its_logits(tokenizer, tmp_path):
    """GptOssForCausalLM saved by transformers -> trainwise's --init-from reader -> the same logits (fp32,
    within 1e-5) and the same greedy continuation with the KV cache; each gpt-oss feature turned off
    changes the logits a hundred thousand times more than that, so the comparison sees every one."""
    hf = hf_model(tokenizer.vocab_size)
    hf.save_pretrained(tmp_path / "hf")
    write_hf_tokenizer(tokenizer, tmp_path / "hf", 64)
    cfg, state, _ = load_hf_dir(tmp_path / "hf")
    assert cfg == ModelConfig(name="hf", vocab_size=tokenizer.vocab_size, **TINY)
    model = Transformer(cfg).eval()
    load_into(model, state)
    ids = torch.randint(0, tokenizer.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
        diff = (logits - hf(ids).logits).abs().max().item()
        print(f"gpt_oss: max |logit diff| vs transformers = {diff:.2e}")
        assert diff < 1e-5
        ours = model.generate(ids[:1], 12, temperature=0)
        assert torch.equal(ours, hf.generate(ids[:1], max_new_tokens=12, do_sample=False))
        for change in (dict(attention_sinks=False), dict(sliding_window=0), dict(rope_scaling="none"),
                       dict(swiglu_limit=1e9), dict(router_logit_bias=False)):
            other = Transformer(dataclasses.replace(cfg, **change)).eval()
            other.load_state_dict(state, strict=False)
            assert (other(ids) - logits).abs().max() > 1e5 * 1e-5, change


def test_export_and_reimport_are_exact(tokenizer, tmp_path):
    """A trainwise gpt-oss exported as GptOssForCausalLM: transformers loads it with the same logits and
    greedy continuation, and --init-from reads back every tensor and the config bit for bit."""
    model = tw_model(tokenizer.vocab_size)
    summary = save_hf(model, tokenizer, tmp_path / "hf")
    assert summary["architecture"] == "GptOssForCausalLM"
    assert summary["params"] == sum(p.numel() for p in model.parameters())
    assert compare_with_hf(model, tokenizer, tmp_path / "hf") < 1e-5
    cfg, state, _ = load_hf_dir(tmp_path / "hf")
    assert cfg == dataclasses.replace(model.cfg, name="hf", init_std=0.02)  # a training setting, not read back
    back = Transformer(cfg).eval()
    load_into(back, state)
    want = model.state_dict()
    assert sorted(back.state_dict()) == sorted(want)
    assert all(torch.equal(t, want[k]) for k, t in back.state_dict().items())
    ids = torch.tensor([tokenizer.encode("The for statement is used to iterate")])
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_config_json_round_trip_and_layouts():
    cfg = ModelConfig(vocab_size=300, **TINY)
    d = json.loads(json.dumps(to_hf_dict(cfg, choose_family(cfg), eos_id=0)))
    assert d["layer_types"] == ["sliding_attention", "full_attention"] * 2 and d["sliding_window"] == 4
    assert from_hf_dict(d, name=cfg.name) == from_hf_dict(d, name=cfg.name, build=True) == cfg
    base = dict(PUBLISHED["gpt-oss-20b"], num_hidden_layers=6)
    full, sliding = "full_attention", "sliding_attention"
    for types, window, every in [([sliding] * 5 + [full], 128, 6), ([sliding] * 6, 128, 0), ([full] * 6, 0, 0)]:
        got = from_hf_dict(dict(base, layer_types=types))
        assert (got.sliding_window, got.full_attention_every) == (window, every)
        assert [t == sliding for t in types] == [got.is_sliding_layer(i) for i in range(6)]
    assert from_hf_dict(dict(base, sliding_window=None)).sliding_window == 0
    renamed = {("num_experts" if k == "num_local_experts" else k): v for k, v in base.items()}
    assert from_hf_dict(renamed) == from_hf_dict(base)  # transformers' attribute_map name
    base.pop("rope_theta")  # transformers 5 writes it into rope_parameters
    plain = from_hf_dict(dict(base, rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    assert plain.rope_scaling == "none" and plain.rope_theta == 1e4


@pytest.mark.parametrize("change, reason", [
    (dict(layer_types=["full_attention", "sliding_attention"] * 3), "not 'every n-th layer'"),
    (dict(layer_types=["sliding_attention"] * 5), "for each of its 6 layers"),
    (dict(attention_bias=False), "attention_bias = false"),
    (dict(quantization_config={"quant_method": "mxfp4"}), "quantized"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                        "attention_factor": 1.0}), "attention_factor"),
])
def test_what_trainwise_does_not_build_is_refused(change, reason):
    with pytest.raises(TrainwiseError, match=reason):
        from_hf_dict(dict(PUBLISHED["gpt-oss-20b"], num_hidden_layers=6, **change), build=True)


@pytest.mark.parametrize("change, reason", [
    (dict(n_experts=0, top_k=0), "every gpt-oss layer is MoE"),
    (dict(activation="swiglu"), "clamped_swiglu"),
    (dict(attention_sinks=False), "attention sinks"),
    (dict(router_gating="sigmoid"), "softmax over its top-k"),
    (dict(expert_ffn_hidden=48), "expert_ffn_hidden must equal ffn_hidden"),
])
def test_export_refuses_what_gpt_oss_cannot_represent(change, reason):
    with pytest.raises(TrainwiseError, match=reason):
        choose_family(ModelConfig(vocab_size=300, **{**TINY, **change}))


# ---------------------------------------------------------------------------------------------------
# Training, and the planner's fake-tensor records


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_a_training_step_runs_and_trains_every_gpt_oss_parameter(checkpointing):
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=97, **TINY))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    step = build_step(model, TrainConfig(lr=1e-2, warmup_steps=0, activation_checkpointing=checkpointing),
                      torch.device("cpu"), "fp32")
    ids = torch.randint(0, 97, (2, 17))
    result = step([(ids[:, :-1], ids[:, 1:])])
    assert torch.isfinite(result.loss) and torch.isfinite(result.grad_norm)
    for name in ("blocks.0.attn.sinks", "blocks.1.mlp.router.bias", "blocks.0.mlp.experts_fc.bias",
                 "blocks.1.attn.out.bias"):
        assert not torch.equal(dict(model.named_parameters())[name], before[name]), name


def test_attention_replacements_leave_windows_and_sinks_alone():
    """The compiled CPU step's explicit attention and the planner's unfused one compute plain causal
    attention; a gpt-oss block keeps its own core under both."""
    model = tw_model(97)
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        want = model(ids)
        use_compiled_attention(model, only_when_compiling=False)
        use_unfused_attention(model)
        assert torch.equal(model(ids), want)


def test_block_ops_on_fake_tensors_and_every_layer_alike():
    """The planner's operator records run on fake tensors, and a windowed block records the same operators as
    a full one (the recorder times one block for all of them)."""
    cfg = ModelConfig(vocab_size=300, **TINY)
    ops = block_ops(cfg, micro_batch=2, seq_len=16)
    assert ops["layer"] and ops["moe_layer"] and ops["ends"]
    one, two, three = (_record(dataclasses.replace(cfg, n_layers=n), 2, 16, "fp32", "none", False, "adamw")
                       for n in (1, 2, 3))
    full, windowed = _minus(two, one), _minus(three, two)  # layer 1 (full attention), layer 2 (windowed)
    assert {k: v for k, v in full.items() if k[1] != "optimizer"} == \
        {k: v for k, v in windowed.items() if k[1] != "optimizer"}


def test_plan_runs_for_the_20b_preset(capsys):
    assert main(["plan", "--model", "gpt-oss-20b", "--gpu", "h100-sxm", "--gpus", "8"]) == 0
    assert "gpt-oss-20b" in capsys.readouterr().out


def test_config_checks():
    with pytest.raises(TrainwiseError, match="rope_original_max_seq_len"):
        ModelConfig(rope_scaling="yarn")
    with pytest.raises(TrainwiseError, match="model.sliding_window"):
        ModelConfig(attention="mla", kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, sliding_window=4)
    with pytest.raises(TrainwiseError, match="model.swiglu_limit"):
        ModelConfig(swiglu_limit=0.0)
    with pytest.raises(TrainwiseError, match="model.attention_sinks"):  # tensor parallelism does not split sinks
        check_layout(RunConfig(model=ModelConfig(vocab_size=300, **TINY), parallel=ParallelConfig(tp=2)))
