"""`trainwise explain` topics of the guide's sections on tokenizers, activations, einops and mixed precision:
their numbers against hand-worked values, their options, their user errors, and the README's tour."""

import json
import math
from pathlib import Path

import pytest
import torch

from trainwise.cli import main as cli_main
from trainwise.explain import topics
from trainwise.explain.tokens import DEFAULT_TEXT, merge_counts


def main(argv: list[str]) -> int:
    """`trainwise explain ...`."""
    return cli_main(["explain", *argv])


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- tokenizer ---------------------------------------------------------------------------------------------


def test_tokenizer_default_text_by_hand(capsys):
    v = run_json(capsys, "tokenizer")
    assert v["text"] == DEFAULT_TEXT == "the cat sat on the mat; the cat ate the rat."
    # "at" stands side by side 6 times (cat x2, sat, mat, ate, rat): more than any other pair ("th", "he": 4)
    first = v["merges"][0]
    assert first["pair"] == ["a", "t"] and first["token"] == "at" and first["count"] == 6 and first["id"] == 257
    assert [m["token"] for m in v["merges"]] == ["at", "he", "the", "Ġthe", "cat", "Ġcat"]
    assert [m["count"] for m in v["merges"]] == [6, 4, 4, 3, 2, 2]
    assert v["vocab_size"] == 256 + 1 + 6 == 256 + 1 + v["n_merges"]
    assert v["alphabet_size"] == 256 and v["text_alphabet"][" "] == "Ġ"
    # the words after those merges, by hand: "sat", "on", "mat", "ate", "rat" were never merged whole
    assert v["tokens"] == ["the", "Ġcat", "Ġ", "s", "at", "Ġ", "o", "n", "Ġthe", "Ġ", "m", "at", ";", "Ġthe",
                           "Ġcat", "Ġ", "at", "e", "Ġthe", "Ġ", "r", "at", "."]
    assert v["roundtrip"] and v["decoded"] == DEFAULT_TEXT
    assert v["characters"] == v["bytes"] == 44
    assert v["tokens_per_character"] == pytest.approx(23 / 44)


def test_tokenizer_multibyte_text_and_file(capsys, tmp_path):
    text = "低碳 low lower lowest 低碳"
    v = run_json(capsys, "tokenizer", "--text", text)
    assert v["bytes"] == len(text) + 2 * 4  # 4 CJK characters of 3 UTF-8 bytes each
    assert len(v["text_alphabet"]["低"]) == 3  # e4 bd 8e: three byte symbols
    assert v["merges"][0]["token"] == "lo" and v["merges"][0]["count"] == 3
    assert v["roundtrip"]
    f = tmp_path / "text.txt"
    f.write_text(text, encoding="utf-8")
    assert run_json(capsys, "tokenizer", "--file", str(f))["ids"] == v["ids"]


def test_tokenizer_of_a_run(capsys, tmp_path):
    from trainwise.tokenizer import Tokenizer

    Tokenizer.train(["low lower lowest newer newest wider widest " * 3], 280).save(tmp_path / "tokenizer.json")
    v = run_json(capsys, "tokenizer", "--run", str(tmp_path), "--text", "the lowest and the newest")
    assert v["source"] == "run" and v["vocab_size"] == Tokenizer.load(tmp_path / "tokenizer.json").vocab_size
    assert v["roundtrip"] and v["n_merges"] == v["vocab_size"] - 257


def test_merge_counts_count_every_position():
    # "aaa" holds the pair (a, a) twice, as BPE trainers count it; after the merge "aa" + "a" remain
    assert merge_counts(["aaa", "aaa", "ab"], [("a", "a"), ("aa", "a"), ("a", "b")]) == [4, 2, 1]


def test_tokenizer_errors(capsys, tmp_path):
    assert main(["tokenizer", "--text", "x", "--file", "y"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["tokenizer", "--run", str(tmp_path)]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert main(["tokenizer", "--vocab-size", "100"]) == 2
    assert "257" in capsys.readouterr().err


# --- activation ----------------------------------------------------------------------------------------------


def test_activation_values_by_hand(capsys):
    v = run_json(capsys, "activation")
    assert v["inputs"] == [-2, -1, 0, 1, 2]
    c = v["curves"]
    assert c["relu"]["values"] == [0, 0, 0, 1, 2] and c["relu"]["grads"][3:] == [1, 1]
    assert c["gelu"]["values"][3] == pytest.approx(0.8413, abs=1e-4) == v["gelu_1_exact"]  # 1 x Phi(1)
    assert c["gelu"]["values"][1] == pytest.approx(-0.1587, abs=1e-4)  # -1 x Phi(-1)
    assert c["gelu_tanh"]["values"][3] == pytest.approx(0.8412, abs=1e-4) == v["gelu_1_tanh"]
    assert c["silu"]["values"][3] == pytest.approx(0.7311, abs=1e-4)  # sigmoid(1)
    # derivatives: GELU' = Phi(x) + x phi(x); SiLU' = s(x) (1 + x (1 - s(x)))
    assert c["gelu"]["grads"][3] == pytest.approx(0.8413 + math.exp(-0.5) / math.sqrt(2 * math.pi), abs=1e-4)
    s = 1 / (1 + math.exp(-1))
    assert c["silu"]["grads"][3] == pytest.approx(s * (1 + (1 - s)))
    assert all(c[n]["grads"][2] == pytest.approx(0.5) for n in ("gelu", "gelu_tanh", "silu"))
    sw = v["swiglu"]  # SiLU(1) x 2
    assert sw["value"] == pytest.approx(2 * s) and sw["d_up"] == pytest.approx(s)
    assert sw["d_gate"] == pytest.approx(2 * c["silu"]["grads"][3])


def test_activation_swiglu_width_as_the_model_rounds(capsys):
    v = run_json(capsys, "activation")
    # H = 256: 8H/3 = 682.67 -> 64 x ceil(10.67) = 704
    assert v["ffn_hidden_plain"] == 1024 and v["ffn_hidden_swiglu_exact"] == pytest.approx(682.667, abs=1e-3)
    assert v["ffn_hidden_swiglu"] == 704
    assert v["params_plain"] == 2 * 256 * 1024 and v["params_swiglu"] == 3 * 256 * 704
    assert v["flops_per_token_swiglu"] == 2 * v["params_swiglu"]
    assert v["train_flops_per_token_swiglu"] == 3 * v["flops_per_token_swiglu"]
    # H = 4096 (Llama-7B's width; Llama itself rounds to 256 and gets 11008): 8H/3 = 10922.67 -> 64 x 171
    v = run_json(capsys, "activation", "--d-model", "4096")
    assert v["ffn_hidden_swiglu"] == 10944 and v["params_swiglu"] == 3 * 4096 * 10944


# --- einops ---------------------------------------------------------------------------------------------------


def test_einops_shapes_views_and_copies(capsys):
    v = run_json(capsys, "einops")
    assert v["shape"] == [2, 4, 8] and v["head_dim"] == 4
    split, merge, flat, mean = v["examples"]
    assert split["shape_after"] == [2, 2, 4, 4] and split["strides_after"] == [32, 4, 8, 1] and split["view"]
    assert merge["shape_before"] == [2, 2, 4, 4] and merge["shape_after"] == [2, 4, 8] and not merge["view"]
    assert flat["shape_after"] == [8, 8] and flat["strides_after"] == [8, 1] and flat["view"]
    assert mean["shape_after"] == [2, 8] and not mean["view"]
    assert all(e["equal_to_torch"] for e in v["examples"])
    v = run_json(capsys, "einops", "--shape", "1,3,12", "--heads", "3")
    assert v["examples"][0]["shape_after"] == [1, 3, 3, 4]


def test_einops_errors(capsys):
    assert main(["einops", "--heads", "3"]) == 2
    assert "divide" in capsys.readouterr().err
    assert main(["einops", "--shape", "2,4"]) == 2
    assert "B,T,H" in capsys.readouterr().err


# --- amp ---------------------------------------------------------------------------------------------------


def test_amp_dtypes_measured(capsys):
    v = run_json(capsys, "amp")
    dt = v["autocast_dtype"]
    assert dt in ("bf16", "fp16")
    d = v["dtypes"]
    assert d["linear"] == {"input": "fp32", "output": dt}  # autocast casts matmul inputs
    assert d["cross_entropy"]["output"] == "fp32"  # losses run in fp32 on every device
    assert d["weight"]["output"] == "fp32" and d["weight_grad"]["output"] == "fp32"
    # softmax is on CUDA's fp32 list, not on the CPU's
    assert d["softmax"]["output"] == ("fp32" if v["device"].startswith("cuda") else dt)


def test_amp_fp16_underflow_and_grad_scaler(capsys):
    u = run_json(capsys, "amp")["underflow"]
    assert u["fp16_smallest_subnormal"] == 2**-24
    assert u["fp16_no_scaler"] == 0  # 1e-8 < 2^-25: rounds to 0 in fp16
    assert u["bf16_no_scaler"] == pytest.approx(1e-8, rel=1e-2)  # bf16 has fp32's range
    # 1e-8 x 2^16 = 6.5536e-4 = 1.34218 x 2^-11; fp16 keeps 10 mantissa bits: 1374 x 2^-21, / 2^16 = 1374 x 2^-37
    assert u["scale"] == 65536 and u["fp16_scaled"] == 1374 * 2**-21
    assert u["fp16_unscaled"] == 1374 * 2**-37 == pytest.approx(1e-8, rel=1e-3)
    assert u["fp16_unscaled"] == pytest.approx(torch.tensor(1e-8 * 65536).half().item() / 65536)
    u = run_json(capsys, "amp", "--grad", "1e-4", "--scale", "1")["underflow"]
    assert u["fp16_no_scaler"] == pytest.approx(1e-4, rel=1e-3)  # large enough for fp16 alone


def test_amp_recipes_from_the_planner(capsys):
    r = run_json(capsys, "amp")["recipes"]
    assert [r[n]["total"] for n in ("fp32", "amp", "bf16-mixed", "bf16-pure")] == [16, 16, 16, 8]
    assert (r["bf16-mixed"]["params"], r["bf16-mixed"]["grads"], r["bf16-mixed"]["master"]) == (2, 2, 4)
    assert r["amp"]["activation_bytes"] < r["fp32"]["activation_bytes"]


def test_amp_errors(capsys):
    assert main(["amp", "--scale", "0"]) == 2
    assert "--scale" in capsys.readouterr().err


# --- listing and README ------------------------------------------------------------------------------------


def test_guide_topics_listed_and_in_the_readme_tour(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in ("tokenizer", "activation", "einops", "amp"):
        assert f"  {name} " in out
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| `trainwise explain"))
    assert all(f"`{name}`" in row for name in topics())


def test_chinese_lines_keep_code_words_whole():
    from trainwise.explain.render import width, wrap

    text = "在你的训练中，" * 5 + "model.ffn_hidden = 0 表示上面推导出的宽度。"
    lines = wrap(text, 40, indent="  ")
    assert all(width(line) <= 40 for line in lines)
    assert any("model.ffn_hidden" in line for line in lines)  # not cut as "mo" / "del.ffn_hidden"
    assert "".join(line.strip() for line in lines).replace(" ", "") == text.replace(" ", "")
    assert wrap("中文" * 30, 20) == ["中文" * 5] * 6
