"""Byte-level BPE: exact round trips, determinism, the end-of-text token, HF compatibility (its speed:
benchmarks/data_scale.py, on a machine with nothing else running)."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trainwise.errors import TrainwiseError
from trainwise.tokenizer import EOT, Tokenizer, sanitize


def builtin_texts():
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(builtin_texts(), 1024)


# Every code point, surrogates included (hypothesis leaves them out of st.text() by default).
any_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=200)


@settings(max_examples=300, deadline=None)
@given(text=any_text)
@example("")
@example("中文字符和English混合, 日本語のテキスト, 한국어")
@example("emoji 😀👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢")
@example("control \x00\x01\x07\x1b[31m\x7f\x85 tabs\t\r\n\r\n  spaces   ")
@example("combining e\u0301 and RTL \u05e9\u05dc\u05d5\u05dd \u202e reversed \ufeff BOM \ufffd")
@example("a literal <|endoftext|> in a document")
@example("lone \ud800 and \udfff surrogates, and a pair \ud83d\ude00")
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == sanitize(text)
    if not any("\ud800" <= ch <= "\udfff" for ch in text):
        assert sanitize(text) == text
        assert tok.decode(tok.encode(text)) == text


surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, codec=None, exclude_categories=())
surrogate_heavy_text = st.text(alphabet=st.one_of(surrogate, st.characters(codec=None, exclude_categories=())),
                               max_size=50)


@settings(max_examples=200, deadline=None)
@given(text=surrogate_heavy_text)
def test_strings_with_surrogates_never_crash(tok, text):
    decoded = tok.decode(tok.encode(text))
    assert decoded == sanitize(text)
    assert not any("\ud800" <= ch <= "\udfff" for ch in decoded)
    decoded.encode("utf-8")  # valid text


def test_sanitize_joins_pairs_and_replaces_lone_surrogates():
    assert sanitize("a\ud83d\ude00b") == "a😀b"
    assert sanitize("a\ud800b\udc00") == "a\ufffdb\ufffd"
    assert sanitize("plain") == "plain"


def test_encode_batch_matches_encode_and_survives_surrogates(tok):
    texts = ["hello world", "中文 😀", "", "bad \ud800 one"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.decode(tok.encode_batch(texts)[3]) == "bad \ufffd one"


def test_training_is_deterministic(tmp_path):
    a = Tokenizer.train(builtin_texts(), 700)
    b = Tokenizer.train(builtin_texts(), 700)
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a.fingerprint() == b.fingerprint()


def test_special_token(tok):
    assert tok.eot_id == tok._hf.token_to_id(EOT)
    assert tok.decode([tok.eot_id]) == EOT
    # A document cannot forge a document boundary: the literal string is encoded as plain bytes.
    assert tok.eot_id not in tok.encode(f"one{EOT}two")
    assert tok.decode(tok.encode("one") + [tok.eot_id]) == f"one{EOT}"


def test_tiny_corpus_gives_a_working_smaller_vocab():
    small = Tokenizer.train(["hi there", "hi"], 4096)
    assert 257 <= small.vocab_size < 4096
    assert small.decode(small.encode("unseen text 😀")) == "unseen text 😀"
    empty = Tokenizer.train([], 4096)
    assert empty.vocab_size == 257
    assert empty.decode(empty.encode("x y")) == "x y"


def test_vocab_size_is_the_actual_size_and_bpe_compresses(tok):
    assert tok.vocab_size == 1024
    text = builtin_texts()[0]
    assert max(max(ids) for ids in tok.encode_batch(builtin_texts())) < tok.vocab_size
    assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2


def test_save_load_and_transformers_fast_tokenizer(tok, tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "tokenizer.json"
    tok.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.fingerprint() == tok.fingerprint()
    assert (loaded.vocab_size, loaded.eot_id) == (tok.vocab_size, tok.eot_id)

    hf = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOT)
    text = "def f(x):\n    return x ** 2  # 中文 😀"
    ids = hf.encode(text, add_special_tokens=False)
    assert ids == tok.encode(text)
    assert hf.decode(ids) == text
    assert hf.eos_token_id == tok.eot_id
    assert len(hf) == tok.vocab_size


def test_bad_inputs_raise_trainwise_error(tmp_path):
    with pytest.raises(TrainwiseError, match="vocab_size = 100"):
        Tokenizer.train(["abc"], 100)
    missing = tmp_path / "nope.json"
    with pytest.raises(TrainwiseError, match="nope.json' does not exist"):
        Tokenizer.load(missing)
    with pytest.raises(TrainwiseError, match="is a folder, not a file; pass the tokenizer.json of a run"):
        Tokenizer.load(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(TrainwiseError, match="broken.json"):
        Tokenizer.load(broken)


def test_decode_command_refuses_ids_outside_the_vocabulary(tok, tmp_path, capsys):
    from trainwise.cli import main

    path = tmp_path / "tokenizer.json"
    tok.save(path)
    assert main(["tokenizer", "decode", "--tokenizer", str(path), "--", "5", str(tok.vocab_size), "-1"]) == 2
    assert f"token ids {tok.vocab_size}, -1 outside" in capsys.readouterr().err
    assert main(["tokenizer", "decode", "--tokenizer", str(path), *map(str, tok.encode("def f"))]) == 0
    assert capsys.readouterr().out == "def f\n"
