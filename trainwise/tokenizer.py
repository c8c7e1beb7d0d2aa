"""Byte-level BPE tokenizer: a thin wrapper over Hugging Face `tokenizers`.

Byte-level means every string is first turned into its UTF-8 bytes, and the 256 byte values are all
in the vocabulary, so any text can be encoded and `decode(encode(s)) == s` holds exactly (GPT-2's
design, Radford et al. 2019, section 2.2). BPE merges learned on the corpus then shorten the
sequences. The file format is HF's `tokenizer.json`, which `transformers.PreTrainedTokenizerFast(
tokenizer_file=...)` loads unchanged.

Two choices a user may notice:

- The end-of-text token `<|endoftext|>` is inserted by the data pipeline between documents, never
  by `encode`: the literal string "<|endoftext|>" inside a text is encoded as ordinary bytes, so a
  document cannot forge a document boundary (tiktoken does the same by default). Decoding the
  `eot_id` gives back the string "<|endoftext|>".
- Python strings may hold lone surrogates (e.g. from `json.loads('"\\ud800"')`), which are not
  characters and cannot be UTF-8 encoded. `encode` turns surrogate pairs into the character they
  stand for and each lone surrogate into U+FFFD (the replacement character), so for such strings
  `decode(encode(s)) == sanitize(s)`. Every other string round-trips unchanged.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainwise.errors import TrainwiseError

EOT = "<|endoftext|>"
MIN_VOCAB_SIZE = 257  # 256 byte tokens + the end-of-text token
_SURROGATE = re.compile("[\ud800-\udfff]")


def sanitize(text: str) -> str:
    """Join surrogate pairs into their character and replace lone surrogates with U+FFFD."""
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class Tokenizer:
    """Byte-level BPE with one special token, `<|endoftext|>`.

    Build one with `Tokenizer.train(texts, vocab_size)` or `Tokenizer.load(path)`; `vocab_size` is the
    actual size, which can be smaller than asked for when the corpus is tiny.
    """

    def __init__(self, hf: HFTokenizer):
        eot_id = hf.token_to_id(EOT)
        if eot_id is None:
            raise TrainwiseError(
                f"the tokenizer has no '{EOT}' token, which trainwise uses to separate documents. "
                "Train a new one with `trainwise tokenizer train` (or Tokenizer.train)."
            )
        hf.encode_special_tokens = True  # "<|endoftext|>" in a text is plain text, see module docstring
        self._hf = hf
        self.eot_id: int = eot_id
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """Learn BPE merges on `texts` until the vocabulary has `vocab_size` tokens or no pair occurs
        twice. Deterministic: the same texts and vocab_size give the same tokenizer.json."""
        if vocab_size < MIN_VOCAB_SIZE:
            raise TrainwiseError(
                f"vocab_size = {vocab_size} is too small: byte-level BPE needs the 256 byte tokens plus "
                f"'{EOT}', so at least {MIN_VOCAB_SIZE}; use e.g. 4096."
            )
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,  # a pair seen once is noise, not a pattern worth a token
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so nothing is unknown
            show_progress=False,
        )
        hf.train_from_iterator((sanitize(t) for t in texts), trainer)
        return cls(hf)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise TrainwiseError(f"tokenizer file '{path}' does not exist; pass the tokenizer.json of a run.")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on a bad file
            raise TrainwiseError(
                f"'{path}' is not a valid Hugging Face tokenizer.json ({err}); pass the tokenizer.json "
                "that trainwise wrote into the run directory."
            ) from None
        return cls(hf)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json atomically (temporary file, then rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        os.replace(tmp, path)

    def to_json(self) -> str:
        return self._hf.to_str()

    def fingerprint(self) -> str:
        """sha256 of tokenizer.json: two tokenizers with the same fingerprint encode identically."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in parallel on all cores (HF tokenizers' Rust thread pool)."""
        try:
            encodings = self._encode_batch(texts)
        except TypeError:  # a lone surrogate cannot cross into Rust; sanitize and retry
            encodings = self._encode_batch([sanitize(t) for t in texts])
        return [e.ids for e in encodings]

    def _encode_batch(self, texts: list[str]) -> list:
        # encode_batch_fast skips computing character offsets: ~1.5x faster (tokenizers >= 0.20).
        fast = getattr(self._hf, "encode_batch_fast", None)
        if fast is not None:
            return fast(texts, add_special_tokens=False)
        return self._hf.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Ids back to text; byte sequences that are not valid UTF-8 (possible for arbitrary ids)
        become U+FFFD."""
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eot_id={self.eot_id})"
