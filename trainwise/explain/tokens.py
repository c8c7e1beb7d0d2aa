"""Topic of the text pipeline: a byte-level BPE tokenizer trained on a text you give (trainwise.tokenizer)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from trainwise import rundir
from trainwise.errors import TrainwiseError
from trainwise.files import not_a_file
from trainwise.explain.render import Doc
from trainwise.explain.topic import Arg, Topic
from trainwise.tokenizer import EOT, MIN_VOCAB_SIZE, Tokenizer

DEFAULT_TEXT = "the cat sat on the mat; the cat ate the rat."
SHOWN = 12  # merges, alphabet rows and ids printed; --json holds them all (merges: the first 100)

TOK = {
    "en": dict(title="Byte-level BPE: text -> bytes -> merged tokens -> ids", trained="tokenizer",
               trained_here="trained here on the text (min pair count 2, vocab_size <= {v})",
               from_run="the run's own: {p}", alphabet="byte-level alphabet", vocab="vocabulary",
               alphabet_head="Each UTF-8 byte of the text is one symbol of a 256-symbol alphabet (GPT-2's byte->"
                             "character table, so a space is shown as Ġ):",
               cols_alpha=["char", "UTF-8 bytes", "symbols"],
               merges_head="The first merges, in the order the trainer learned them; count = how often the pair "
                           "stands side by side in the text, just before it is merged:",
               cols_merge=["#", "pair", "-> token", "count", "id"], none="(no pair occurs twice: no merges)",
               ids="ids", tokens="tokens", roundtrip="round trip", chars="characters",
               nbytes="UTF-8 bytes", per_char="tokens per character", per_byte="bytes per token",
               why="BPE starts from the bytes and repeatedly merges the most frequent adjacent pair into a new token, "
                   "so frequent words become one id and rare ones fall back to pieces or bytes; any text can be "
                   "encoded because every byte is in the vocabulary.",
               run=["`trainwise train` trains this tokenizer on your corpus (tokenizer.vocab_size, default 4096) "
                    "and writes DIR/tokenizer.json; `trainwise explain tokenizer --run DIR` shows its merges.",
                    "Tokens per character set how many tokens (and so FLOPs, 6ND) a corpus of a given size costs; "
                    "`trainwise tokenizer encode` gives the ids of any text."]),
    "zh": dict(title="字节级 BPE 分词器：文本 -> 字节 -> 合并后的 token -> id", trained="分词器",
               trained_here="在这段文本上现场训练（合并阈值：出现至少 2 次，vocab_size <= {v}）",
               from_run="训练目录中的分词器：{p}", alphabet="字节级字母表", vocab="词表大小",
               alphabet_head="文本的每个 UTF-8 字节都是 256 个符号的字母表中的一个符号（GPT-2 的字节->字符表，"
                             "所以空格显示为 Ġ）：",
               cols_alpha=["字符", "UTF-8 字节", "符号"],
               merges_head="最先学到的合并规则（按训练顺序）；次数 = 合并前这一对在文本中相邻出现的次数：",
               cols_merge=["#", "符号对", "-> token", "次数", "id"], none="（没有出现两次的符号对：没有合并）",
               ids="token id", tokens="token", roundtrip="往返解码", chars="字符数",
               nbytes="UTF-8 字节数", per_char="每个字符的 token 数", per_byte="每个 token 的字节数",
               why="BPE 从字节出发，反复把出现最多的相邻符号对合并成新 token：常见的词变成一个 id，少见的词退回到"
                   "片段或字节；因为每个字节都在词表中，任何文本都能编码。",
               run=["`trainwise train` 在你的语料上训练这个分词器（tokenizer.vocab_size，默认 4096），写入 "
                    "DIR/tokenizer.json；`trainwise explain tokenizer --run DIR` 显示它的合并规则。",
                    "每个字符的 token 数决定一份语料要多少 token（也就决定 6ND 的计算量）；"
                    "`trainwise tokenizer encode` 给出任意文本的 id。"]),
}


def read_text(text: str | None, file: str | None) -> str:
    if text is not None and file is not None:
        raise TrainwiseError("give the text either with --text or with --file, not both.")
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise TrainwiseError(f"--file '{file}' {not_a_file(path)}; pass a UTF-8 text file, "
                                 "or the text itself with --text.")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TrainwiseError(f"--file '{file}' is not UTF-8 text; "
                                 "convert it (e.g. iconv -t utf-8) or use --text.") from None
    text = DEFAULT_TEXT if text is None else text
    if not text:
        raise TrainwiseError("the text is empty; pass one with --text \"...\" or --file PATH.")
    return text


def merge_counts(words: list[str], merges: list[tuple[str, str]]) -> list[int]:
    """Replay BPE merges on pre-tokenized words (byte-level strings): for each merge, how often its pair
    stands side by side in the current segmentation, counted as the trainer counts (every position,
    weighted by how often the word occurs), before the merge is applied."""
    segs = {w: list(w) for w in set(words)}
    freq = Counter(words)
    counts = []
    for a, b in merges:
        n = 0
        for w, seg in segs.items():
            n += freq[w] * sum(seg[i] == a and seg[i + 1] == b for i in range(len(seg) - 1))
            out, i = [], 0
            while i < len(seg):  # apply the merge left to right, as BPE does
                if i + 1 < len(seg) and seg[i] == a and seg[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seg[i])
                    i += 1
            segs[w] = out
        counts.append(n)
    return counts


def _hf(tok: Tokenizer):
    """The HF tokenizer behind a trainwise Tokenizer, rebuilt from its tokenizer.json (public API only)."""
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_str(tok.to_json())


def load_or_train(text: str, vocab_size: int, run: str | None) -> tuple[Tokenizer, Path | None]:
    """The run's tokenizer.json with --run, else a tokenizer trained on the text: (tokenizer, its path)."""
    if run is not None:
        path = Path(run) / rundir.TOKENIZER
        if not path.is_file():
            raise TrainwiseError(f"--run '{run}' has no tokenizer.json; pass a run directory that `trainwise train` "
                                 "wrote, or leave --run out to train a tiny tokenizer on the text.")
        return Tokenizer.load(path), path
    if vocab_size < MIN_VOCAB_SIZE:
        raise TrainwiseError(f"--vocab-size {vocab_size} is too small: 256 byte tokens + '{EOT}' need at least "
                             f"{MIN_VOCAB_SIZE}; try 300.")
    return Tokenizer.train([text], vocab_size), None


def tokenizer(text: str | None = None, file: str | None = None, vocab_size: int = 300, run: str | None = None,
              lang: str = "en") -> Doc:
    t = TOK[lang]
    text = read_text(text, file)
    tok, path = load_or_train(text, vocab_size, run)
    source = t["from_run"].format(p=path) if path else t["trained_here"].format(v=vocab_size)
    hf = _hf(tok)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in json.loads(tok.to_json())["model"]["merges"]]
    words = [w for w, _ in hf.pre_tokenizer.pre_tokenize_str(text)]
    shown_merges = merges[:SHOWN]
    counts = merge_counts(words, merges[:100])
    ids = tok.encode(text)
    pieces = [hf.id_to_token(i) for i in ids]
    decoded = tok.decode(ids)
    n_bytes = len(text.encode("utf-8"))
    alphabet = _alphabet_rows(hf, text)

    d = Doc(t["title"], lang)
    d.text(f"{t['trained']}: {source}")
    d.step(t["vocab"], "256 bytes + 1 special + merges", f"256 + 1 + {len(merges):,}", f"{tok.vocab_size:,}")
    d.text()
    d.text(t["alphabet_head"])
    d.table(t["cols_alpha"], [[repr(c), " ".join(f"{b:02x}" for b in c.encode("utf-8")), s]
                              for c, s in alphabet[:SHOWN]] + ([["...", "", ""]] if len(alphabet) > SHOWN else []))
    d.text()
    d.text(t["merges_head"])
    if shown_merges:
        d.table(t["cols_merge"], [[i + 1, f"{a} + {b}", a + b, counts[i], hf.token_to_id(a + b)]
                                  for i, (a, b) in enumerate(shown_merges)])
    else:
        d.text(t["none"])
    d.text()
    more = " ..." if len(ids) > 2 * SHOWN else ""
    d.text(f"{t['tokens']} ({len(pieces):,}): " + " ".join(pieces[:2 * SHOWN]) + more)
    d.text(f"{t['ids']} ({len(ids):,}): " + " ".join(map(str, ids[:2 * SHOWN])) + more)
    d.step(t["roundtrip"], "decode(encode(text)) == text", "", str(decoded == text))
    d.step(t["chars"], "len(text)", "", f"{len(text):,}")
    d.step(t["nbytes"], "len(text.encode())", "", f"{n_bytes:,}")
    d.step(t["per_char"], "tokens / characters", f"{len(ids):,} / {len(text):,}", f"{len(ids) / len(text):.3f}")
    d.step(t["per_byte"], "bytes / tokens", f"{n_bytes:,} / {len(ids):,}", f"{n_bytes / len(ids):.3f}")
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(text=text, source="run" if path else "trained", tokenizer_path=str(path) if path else None,
                    vocab_size=tok.vocab_size, n_merges=len(merges), alphabet_size=len(_byte_table()),
                    text_alphabet={c: s for c, s in alphabet},
                    merges=[dict(pair=[a, b], token=a + b, count=n, id=hf.token_to_id(a + b))
                            for (a, b), n in zip(merges[:100], counts)],
                    ids=ids, tokens=pieces, decoded=decoded, roundtrip=decoded == text, characters=len(text),
                    bytes=n_bytes, tokens_per_character=len(ids) / len(text), bytes_per_token=n_bytes / len(ids))
    return d


def _byte_table() -> list[str]:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel.alphabet()


def _alphabet_rows(hf, text: str) -> list[tuple[str, str]]:
    """(character, its byte-level symbols) for each distinct character of the text, in order of appearance;
    the symbols come from the tokenizer's own pre-tokenizer."""
    rows = []
    for ch in dict.fromkeys(text):
        symbols = "".join(w for w, _ in hf.pre_tokenizer.pre_tokenize_str(ch))
        rows.append((ch, symbols))
    return rows


TOPICS = [
    Topic("tokenizer", "分词器",
          {"en": "byte-level BPE trained on a text: alphabet, first merges with counts, ids, round trip, tokens/char",
           "zh": "在一段文本上训练字节级 BPE：字母表、最先的合并及其次数、id、往返解码、每字符 token 数"},
          tokenizer,
          [Arg("--text", dict(default=None, help=f"the text (default: \"{DEFAULT_TEXT}\")")),
           Arg("--file", dict(default=None, help="read the text from this UTF-8 file instead")),
           Arg("--vocab-size", dict(type=int, default=300, help="vocabulary of the tiny tokenizer (default 300)")),
           Arg("--run", dict(default=None, metavar="DIR",
                             help="use the tokenizer.json of this run instead of training one"))],
          "trainwise explain tokenizer --text \"低碳 low lower lowest\""),
]
