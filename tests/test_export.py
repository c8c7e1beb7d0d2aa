"""Hugging Face export and import: logits and greedy generations equal transformers', the inverse is exact,
what no HF family can represent is refused, and `--init-from` an exported run keeps its validation loss."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from trainwise.cli import main
from trainwise.config import DataConfig, ModelConfig, RunConfig, apply_overrides
from trainwise.errors import TrainwiseError
from trainwise.export.hf import choose_family, load_hf_dir, load_into, save_hf, write_hf_tokenizer
from trainwise.hf_config import from_hf_dict, to_hf_dict
from trainwise.model import Transformer
from trainwise.tokenizer import Tokenizer

import transformers

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=32",
        "train.seq_len=32", "train.micro_batch=4", "tokenizer.vocab_size=300", "train.eval_every=5",
        "train.eval_steps=2", "train.log_every=1", "train.warmup_steps=2", "train.sample_tokens=10",
        "train.precision=fp32", "train.checkpoint_every=100", "train.max_steps=10"]
PROMPT = "The for statement is used to iterate over the elements of a sequence"

# DeepSeek-V3's latent attention and MoE, shrunk (tests/test_mla.py)
MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8)
V3_MOE = dict(n_experts=8, top_k=2, expert_ffn_hidden=16, n_shared_experts=1, first_dense_layers=1,
              router_gating="sigmoid", router_bias=True, routed_scaling_factor=2.5, router_groups=4,
              router_group_top_k=2)

# name -> (ModelConfig overrides, expected HF class)
CASES = {
    "llama": (dict(n_kv_heads=2), "LlamaForCausalLM"),
    "llama-bias-untied": (dict(n_kv_heads=2, bias=True, tie_embeddings=False), "LlamaForCausalLM"),
    "llama-qkv-bias-geglu": (dict(n_kv_heads=1, qkv_bias=True, activation="geglu"), "LlamaForCausalLM"),
    "qwen3-qk-norm": (dict(n_kv_heads=2, qk_norm=True), "Qwen3ForCausalLM"),
    "gpt2": (dict(n_kv_heads=4, norm="layernorm", position="learned", activation="gelu_tanh", bias=True),
             "GPT2LMHeadModel"),
    "gpt2-exact-gelu": (dict(n_kv_heads=4, norm="layernorm", position="learned", activation="gelu", bias=True),
                        "GPT2LMHeadModel"),
    "gpt2-nobias-relu-untied": (dict(n_kv_heads=4, norm="layernorm", position="learned", activation="relu",
                                     tie_embeddings=False), "GPT2LMHeadModel"),
    "mixtral": (dict(n_kv_heads=2, n_experts=4, top_k=2), "MixtralForCausalLM"),
    "deepseek_v3": (dict(**MLA, **V3_MOE, tie_embeddings=False), "DeepseekV3ForCausalLM"),
    "deepseek_v3-dense-no-q-lora": (dict(MLA, q_lora_rank=0), "DeepseekV3ForCausalLM"),
}


@pytest.fixture(scope="module")
def tokenizer(corpus) -> Tokenizer:
    return Tokenizer.train([corpus.read_text(encoding="utf-8")], 300)


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything loads from the local directory


def random_model(tokenizer: Tokenizer, **overrides) -> Transformer:
    """Weights far from init (norm gains, biases), so that a mis-mapped tensor shows in the logits."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                      init_std=0.2, **overrides)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # DeepSeek-V3's choice bias: it changes which experts are chosen
                b.normal_(0.0, 0.1)
    return model


def until_eot(ids: list[int], eot: int) -> list[int]:
    return ids[: ids.index(eot) + 1] if eot in ids else ids


def compare_with_hf(model: Transformer, tokenizer: Tokenizer, hf_dir: Path, new_tokens: int = 16) -> float:
    """Max |logit difference| trainwise vs transformers; asserts greedy continuations are identical."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    ids = torch.tensor([tokenizer.encode(PROMPT)[:16]])
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
        ours = model.generate(ids, new_tokens, temperature=0)[0].tolist()
        theirs = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0].tolist()
    assert until_eot(ours, tokenizer.eot_id) == until_eot(theirs, tokenizer.eot_id)
    return diff


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip(name, tokenizer, tmp_path):
    overrides, architecture = CASES[name]
    model = random_model(tokenizer, **overrides)
    summary = save_hf(model, tokenizer, tmp_path / "hf")
    assert summary["architecture"] == architecture
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [architecture]

    diff = compare_with_hf(model, tokenizer, tmp_path / "hf")
    print(f"{name}: max |logit diff| = {diff:.2e}")
    assert diff < 1e-4

    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert hf_tok.encode(PROMPT) == tokenizer.encode(PROMPT)
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == tokenizer.eot_id

    # the inverse (used by --init-from) is exact
    cfg, state, tok = load_hf_dir(tmp_path / "hf")
    back = Transformer(cfg).eval()
    load_into(back, state)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    assert tok.fingerprint() == tokenizer.fingerprint()


@pytest.mark.parametrize("overrides, reason", [
    (dict(norm="layernorm", position="rope", activation="gelu"), "GPT-2 uses learned positions"),
    (dict(activation="gelu"), "not gated"),
    (dict(position="learned"), "GPT-2 uses LayerNorm"),
    (dict(norm="layernorm", position="learned", activation="gelu", n_kv_heads=2), "grouped-query"),
    (dict(norm="layernorm", position="learned", activation="swiglu", n_kv_heads=0), "gated"),
    (dict(qk_norm=True, bias=True), "Qwen3"),
    (dict(n_experts=4, top_k=2, n_shared_experts=1), "shared experts"),
    (dict(n_experts=4, top_k=2, router_gating="sigmoid"), "softmax"),
    (dict(n_experts=4, top_k=2, first_dense_layers=1), "every Mixtral layer"),
    (dict(n_experts=4, top_k=2, dropless=False), "dropless"),
    (dict(MLA, n_experts=4, top_k=2, n_shared_experts=1), "sigmoid gating"),
    (dict(MLA, n_experts=4, top_k=2, router_gating="sigmoid"), "shared experts"),
    (dict(MLA, qk_norm=True), "no qk_norm"),
])
def test_unrepresentable_configs_are_refused_with_the_reason(overrides, reason):
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, **{"n_kv_heads": 2, **overrides})
    with pytest.raises(TrainwiseError, match=reason):
        choose_family(cfg)


@pytest.mark.parametrize("name", list(CASES))
def test_config_json_round_trip(name):
    """ModelConfig -> config.json -> ModelConfig through the one translator gives the model back, to
    --init-from (build=True) and to the planner alike (except llama's q/k/v-only biases, whose zero o_proj
    bias the planner cannot count). The training settings export writes (init_std, dropout, aux_loss_coef)
    are not read back: these models keep their defaults. A bias-free GPT-2 comes back with its biases, which
    it exports as zeros; latent attention with n_kv_heads = n_heads, a field it does not use."""
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, **CASES[name][0])
    family = choose_family(cfg)
    d = json.loads(json.dumps(to_hf_dict(cfg, family, eos_id=0)))
    want = dataclasses.replace(cfg, bias=cfg.bias or family == "gpt2",
                               n_kv_heads=cfg.n_heads if cfg.attention == "mla" else cfg.n_kv_heads)
    assert from_hf_dict(d, name=cfg.name, build=True) == want
    if cfg.qkv_bias:
        with pytest.raises(TrainwiseError, match="o_proj"):
            from_hf_dict(d)
    else:
        assert from_hf_dict(d, name=cfg.name) == want


def hf_checkpoint(config, tokenizer: Tokenizer, out: Path):
    """A transformers model of `config` with norm gains and biases moved off their init, saved to `out`
    as transformers saves it, with trainwise's tokenizer."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if t.dim() == 1 and "rotary" not in name:
                t.add_(0.1 * torch.randn_like(t))
    hf.save_pretrained(out)
    write_hf_tokenizer(tokenizer, out, 64)
    return hf


SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, initializer_range=0.2)
# families --init-from reads that export does not write (it writes them as llama or mixtral)
READ_ONLY = {
    "mistral": dict(model_type="mistral", sliding_window=None),
    "mistral-window-past-the-longest-sequence": dict(model_type="mistral", sliding_window=4096),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=8, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=16, mlp_only_layers=[0], norm_topk_prob=False),
    "qwen3_moe-renormalised": dict(model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=16, norm_topk_prob=True),
}


@pytest.mark.parametrize("name", list(READ_ONLY))
def test_init_from_reads_the_planner_families_with_transformers_logits(name, tokenizer, tmp_path):
    config = transformers.AutoConfig.for_model(**READ_ONLY[name], **SMALL, vocab_size=tokenizer.vocab_size)
    hf = hf_checkpoint(config, tokenizer, tmp_path / "hf")
    cfg, state, _ = load_hf_dir(tmp_path / "hf")
    assert cfg == from_hf_dict(config.to_dict(), name="hf")  # as the planner reads it
    model = Transformer(cfg).eval()
    load_into(model, state)
    ids = torch.tensor([tokenizer.encode(PROMPT)[:16]])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4


def test_init_from_loads_q_k_v_biases_and_refuses_a_non_zero_o_proj_bias(tokenizer, tmp_path):
    """Qwen3 with attention_bias = true biases o_proj too, which trainwise does not have: loaded when that
    bias is zero (as export writes it), refused otherwise. The planner cannot count it either way."""
    config = transformers.Qwen3Config(**SMALL, head_dim=8, attention_bias=True, vocab_size=tokenizer.vocab_size)
    hf = hf_checkpoint(config, tokenizer, tmp_path / "nonzero")
    with pytest.raises(TrainwiseError, match="non-zero o_proj bias"):
        load_hf_dir(tmp_path / "nonzero")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    hf.save_pretrained(tmp_path / "zero")
    write_hf_tokenizer(tokenizer, tmp_path / "zero", 64)
    cfg, state, _ = load_hf_dir(tmp_path / "zero")
    assert cfg.qkv_bias and not cfg.bias
    model = Transformer(cfg).eval()
    load_into(model, state)
    ids = torch.tensor([tokenizer.encode(PROMPT)[:16]])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4
    with pytest.raises(TrainwiseError, match="o_proj"):
        from_hf_dict(config.to_dict())


@pytest.mark.parametrize("change, reason", [
    (dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
     "rope_type 'llama3'"),
    (dict(model_type="qwen2", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
     "rope_type 'yarn'"),
    (dict(model_type="mistral", sliding_window=16), "sliding_window = 16 < max_position_embeddings = 64"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=16), "sliding_window = 16"),
    (dict(model_type="llama", hidden_act="gelu"), "exact GELU"),
    (dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, scale_attn_by_inverse_layer_idx=True),
     "attention scaling"),
    (dict(model_type="bert"), "model_type 'bert', which is not supported"),
    (dict(model_type="llama", hidden_size=None), "no 'hidden_size' field"),
])
def test_init_from_refuses_what_trainwise_does_not_build_naming_the_file(change, reason, tmp_path):
    """A config.json trainwise plans but does not build (or does not read at all) is refused by --init-from
    before any weight is read, in one message that names the file and what to change."""
    (tmp_path / "hf").mkdir()
    sizes = {} if change["model_type"] == "gpt2" else SMALL  # GPT-2's own names are in `change`
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**sizes, "vocab_size": 300, **change}))
    with pytest.raises(TrainwiseError, match=reason) as err:
        load_hf_dir(tmp_path / "hf")
    assert str(err.value).startswith(str(tmp_path / "hf" / "config.json") + ": ")
    if change["model_type"] != "bert" and "hidden_size" not in change:
        from_hf_dict(json.loads((tmp_path / "hf" / "config.json").read_text()))  # the planner counts it


def test_cli_export_and_init_from_keep_the_validation_loss(corpus, tmp_path, capsys):
    from trainwise.data import corpus as data_mod
    from trainwise.trainer.loop import evaluate, train

    cfg = apply_overrides(RunConfig(), TINY + [f"data.paths=['{corpus}']"])
    run = train(cfg, out=tmp_path / "run", quiet=True)

    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == "LlamaForCausalLM"
    from trainwise.api import load

    loaded = load(tmp_path / "run", device="cpu")
    assert compare_with_hf(loaded.model, loaded.tokenizer, tmp_path / "hf", new_tokens=8) < 1e-4

    # the exported model, loaded back as trainwise's --init-from does, has the run's validation loss
    model_cfg, state, tokenizer = load_hf_dir(tmp_path / "hf")
    model = Transformer(model_cfg)
    load_into(model, state)
    cfg_b = apply_overrides(RunConfig(), TINY + [f"data.paths=['{corpus}']"])
    tokens = data_mod.prepare_data(cfg_b.data, tokenizer, cfg_b.train.seq_len)
    val = evaluate(model, tokens.val, cfg_b, torch.device("cpu"), "fp32")
    assert abs(val - run.val_loss) < 1e-4

    # and `trainwise train --init-from` continues from it: config, tokenizer and weights come from HF_DIR
    assert main(["train", "--init-from", str(tmp_path / "hf"), "--data", str(corpus), "--out", str(tmp_path / "b"),
                 "--quiet", "--max-steps", "2",
                 *[a for s in TINY for a in ("--set", s) if not s.startswith("model.")]]) == 0
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    fresh = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] < fresh[0]["loss"] - 0.3  # starts trained, not from scratch
    assert (tmp_path / "b" / "tokenizer.json").read_text() == (tmp_path / "run" / "tokenizer.json").read_text()


def test_export_refuses_a_non_empty_out(tokenizer, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("x")
    with pytest.raises(TrainwiseError, match="not empty"):
        save_hf(random_model(tokenizer), tokenizer, tmp_path / "hf")


# ---------------------------------------------------------------------------------------------------
# tokenizers from elsewhere: --init-from keeps the checkpoint's own end-of-sequence token


def llama2_style_tokenizer(text: str):
    """Llama 2 / Mistral style: SentencePiece-like BPE (Metaspace, byte fallback) with <unk> <s> </s> and
    no <|endoftext|>, as transformers' LlamaTokenizer builds it from a vocabulary and merges."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    hf.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                       show_progress=False))
    learned = json.loads(hf.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    return transformers.LlamaTokenizer(vocab=vocab, merges=merges)


def llama3_style_tokenizer(text: str):
    """Llama 3 style: byte-level BPE with <|begin_of_text|> and <|end_of_text|> after the learned tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<|begin_of_text|>",
                                                eos_token="<|end_of_text|>")


@pytest.mark.parametrize("style, eos", [("llama2", "</s>"), ("llama3", "<|end_of_text|>")])
def test_init_from_a_llama_checkpoint_uses_its_eos_and_exports_the_same_tokenizer(style, eos, corpus, tmp_path):
    from trainwise.data import corpus as data_mod

    text = corpus.read_text(encoding="utf-8")
    hf_tok = (llama2_style_tokenizer if style == "llama2" else llama3_style_tokenizer)(text)
    assert hf_tok.eos_token == eos and "<|endoftext|>" not in hf_tok.get_vocab()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                                      tie_word_embeddings=False)
    source = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(source)
    hf_tok.save_pretrained(source)

    run = tmp_path / "run"
    train_sets = [a for s in TINY if not s.startswith(("model.", "tokenizer.")) for a in ("--set", s)]
    assert main(["train", "--init-from", str(source), "--data", str(corpus), "--out", str(run), "--quiet",
                 "--max-steps", "3", *train_sets]) == 0
    tok = Tokenizer.load(run / "tokenizer.json")
    assert tok.eot_token == eos and tok.eot_id == hf_tok.eos_token_id
    assert tok.decode(tok.encode(PROMPT)) == PROMPT
    # documents in the token stream end with the checkpoint's own end-of-sequence token
    tokens = data_mod.prepare_data(DataConfig(paths=[str(corpus)]), tok, 32)
    assert tokens.eot_id == hf_tok.eos_token_id and tokens.val[-1] == hf_tok.eos_token_id

    if style == "llama2":  # killed before its first checkpoint, the same command starts over from HF_DIR's weights
        first = (run / "metrics.jsonl").read_text()
        shutil.rmtree(run / "checkpoints")
        (run / "metrics.jsonl").write_text(first.splitlines(keepends=True)[0])
        assert main(["train", "--init-from", str(source), "--data", str(corpus), "--out", str(run), "--quiet",
                     "--max-steps", "3", *train_sets]) == 0
        assert (run / "metrics.jsonl").read_text().count("\n") == 3
        assert [json.loads(r)["loss"] for r in (run / "metrics.jsonl").read_text().splitlines()] == \
            [json.loads(r)["loss"] for r in first.splitlines()]

    out = tmp_path / "exported"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads((source / "tokenizer.json").read_text())
    assert (out / "tokenizer_config.json").read_text() == (source / "tokenizer_config.json").read_text()
    back = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert back.get_vocab() == hf_tok.get_vocab()
    assert (back.bos_token, back.eos_token, back.unk_token) == (hf_tok.bos_token, hf_tok.eos_token, hf_tok.unk_token)
    assert back.encode(PROMPT) == hf_tok.encode(PROMPT)
    exported = json.loads((out / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (config.bos_token_id, config.eos_token_id)
    transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


def test_the_document_separator_is_the_declared_eos_else_a_known_one_else_a_clear_error(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    def save(special: list[str], declared: str | None) -> Path:
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.train_from_iterator([PROMPT], trainers.BpeTrainer(vocab_size=280, special_tokens=special,
                                                             show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        folder = tmp_path / f"tok{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        hf.save(str(folder / "tokenizer.json"))
        if declared:
            (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": declared}}))
        return folder / "tokenizer.json"

    # Qwen chat models declare <|im_end|> though they also have <|endoftext|>: the declaration wins
    tok = Tokenizer.load(save(["<|endoftext|>", "<|im_end|>"], "<|im_end|>"))
    assert tok.eot_token == "<|im_end|>" and tok.eot_id == 1
    assert Tokenizer.load(save(["<unk>", "<eos>"], None)).eot_token == "<eos>"  # Gemma's name, undeclared
    with pytest.raises(TrainwiseError, match="no end-of-sequence token"):
        Tokenizer.load(save(["<pad>"], None))


def test_init_from_a_deepseek_v3_saved_by_transformers_trains_and_exports_back(corpus, tokenizer, tmp_path):
    """A small DeepSeek-V3 as transformers saves it (interleaved rotary rows, its own expert layout):
    --init-from reads it with transformers' logits, trains, and exports a directory transformers loads
    with the trained model's logits."""
    from trainwise.api import load

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64, initializer_range=0.2,
        bos_token_id=tokenizer.eot_id, eos_token_id=tokenizer.eot_id)
    assert config.rope_interleave  # transformers' default, as in the Hub's DeepSeek-V3 files
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if t.dim() == 1 and "rotary" not in name:
                t.add_(0.1 * torch.randn_like(t))
    source = tmp_path / "hf"
    hf.save_pretrained(source)
    write_hf_tokenizer(tokenizer, source, 64)

    cfg, state, _ = load_hf_dir(source)
    model = Transformer(cfg).eval()
    load_into(model, state)
    ids = torch.tensor([tokenizer.encode(PROMPT)[:16]])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4

    run = tmp_path / "run"
    train_sets = [a for s in TINY if not s.startswith(("model.", "tokenizer.")) for a in ("--set", s)]
    assert main(["train", "--init-from", str(source), "--data", str(corpus), "--out", str(run), "--quiet",
                 "--max-steps", "3", *train_sets]) == 0
    out = tmp_path / "exported"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    trained = load(run, device="cpu")
    assert compare_with_hf(trained.model, trained.tokenizer, out, new_tokens=8) < 1e-4
    back = json.loads((out / "config.json").read_text())
    assert back["architectures"] == ["DeepseekV3ForCausalLM"] and back["rope_interleave"] is False
