"""Byte-level BPE tokenizer: a thin wrapper over Hugging Face `tokenizers`.

Byte-level means every string is first turned into its UTF-8 bytes, and the 256 byte values are all
in the vocabulary, so any text can be encoded and `decode(encode(s)) == s` holds exactly (GPT-2's
design, Radford et al. 2019, section 2.2). BPE merges learned on the corpus then shorten the
sequences. The file format is HF's `tokenizer.json`, which `transformers.PreTrainedTokenizerFast(
tokenizer_file=...)` loads unchanged.

Three choices a user may notice:

- The end-of-text token `<|endoftext|>` is inserted by the data pipeline between documents, never
  by `encode`: the literal string "<|endoftext|>" inside a text is encoded as ordinary bytes, so a
  document cannot forge a document boundary (tiktoken does the same by default). Decoding the
  `eot_id` gives back the string "<|endoftext|>".
- A tokenizer from elsewhere (`--init-from` a Hugging Face checkpoint) keeps its own end-of-sequence
  token as the document separator: the `eos_token` its tokenizer_config.json names, else the first of
  EOS_NAMES it has (`</s>` of Llama 2 and Mistral, `<|end_of_text|>` of Llama 3, `<|endoftext|>` of
  GPT-2 and Qwen). Its tokenizer_config.json, special_tokens_map.json and chat template are kept
  verbatim beside tokenizer.json (HF_SIDE_FILES), so the run exports the very tokenizer it imported.
- Python strings may hold lone surrogates (e.g. from `json.loads('"\\ud800"')`), which are not
  characters and cannot be UTF-8 encoded. `encode` turns surrogate pairs into the character they
  stand for and each lone surrogate into U+FFFD (the replacement character), so for such strings
  `decode(encode(s)) == sanitize(s)`. Every other string round-trips unchanged.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainwise.errors import TrainwiseError
from trainwise.files import not_a_file, write_atomic

EOT = "<|endoftext|>"
# end-of-sequence names of the common open tokenizers, tried in this order when none is declared:
# GPT-2/Qwen (and trainwise's own), Llama 3, Llama 2/Mistral/Mixtral, Gemma
EOS_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
# the files transformers' save_pretrained writes beside tokenizer.json
HF_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MIN_VOCAB_SIZE = 257  # 256 byte tokens + the end-of-text token
_SURROGATE = re.compile("[\ud800-\udfff]")


def sanitize(text: str) -> str:
    """Join surrogate pairs into their character and replace lone surrogates with U+FFFD."""
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class Tokenizer:
    """Byte-level BPE with one special token, `<|endoftext|>`; or a Hugging Face tokenizer with its own
    end-of-sequence token (see the module docstring).

    Build one with `Tokenizer.train(texts, vocab_size)` or `Tokenizer.load(path)`; `vocab_size` is the
    actual size, which can be smaller than asked for when the corpus is tiny.
    side_files: HF_SIDE_FILES name -> text, kept verbatim (empty for trainwise's own tokenizers).
    """

    def __init__(self, hf: HFTokenizer, side_files: dict[str, str] | None = None):
        self.side_files = dict(side_files or {})
        declared = self.special_token("eos_token")
        names = ([declared] if declared else []) + list(EOS_NAMES)
        eot = next((name for name in names if hf.token_to_id(name) is not None), None)
        if eot is None:
            raise TrainwiseError(
                f"the tokenizer has no end-of-sequence token (tokenizer_config.json names "
                f"{declared or 'none'}; none of {', '.join(EOS_NAMES)} is in its vocabulary), and trainwise "
                "separates documents with one. Name it as eos_token in the tokenizer_config.json beside "
                "tokenizer.json, or train a new tokenizer with `trainwise tokenizer train`."
            )
        hf.encode_special_tokens = True  # "<|endoftext|>" in a text is plain text, see module docstring
        self._hf = hf
        self.eot_token: str = eot
        self.eot_id: int = hf.token_to_id(eot)
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        """The id of `token` as a whole vocabulary entry (special tokens included), or None."""
        return self._hf.token_to_id(token)

    def special_token(self, name: str) -> str | None:
        """The token tokenizer_config.json (else the older special_tokens_map.json) names as `name`
        (bos_token, eos_token, ...), if any."""
        for file in ("tokenizer_config.json", "special_tokens_map.json"):
            try:
                value = json.loads(self.side_files.get(file, "{}")).get(name)
            except (ValueError, AttributeError):
                continue
            if isinstance(value, dict):  # older files: {"content": "</s>", "lstrip": false, ...}
                value = value.get("content")
            if isinstance(value, str):
                return value
        return None

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
        """tokenizer.json, with the HF_SIDE_FILES beside it (as transformers reads a model directory)."""
        path = Path(path)
        if not path.is_file():
            raise TrainwiseError(f"tokenizer file '{path}' {not_a_file(path)}; pass the tokenizer.json of a run.")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception on a bad file
            raise TrainwiseError(
                f"'{path}' is not a valid Hugging Face tokenizer.json ({err}); pass the tokenizer.json "
                "that trainwise wrote into the run directory."
            ) from None
        sides = {name: (path.parent / name).read_text(encoding="utf-8") for name in HF_SIDE_FILES
                 if (path.parent / name).is_file()}
        return cls(hf, sides)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json, and the side files beside it, atomically (temporary file, then rename)."""
        path = Path(path)
        for name, text in [(path.name, self.to_json()), *self.side_files.items()]:
            write_atomic(path.with_name(name), text)

    def to_json(self) -> str:
        return self._hf.to_str()

    def fingerprint(self) -> str:
        """sha256 of tokenizer.json (and of the separator, when it is not EOT): two tokenizers with the
        same fingerprint encode identically and separate documents with the same token."""
        text = self.to_json() + ("" if self.eot_token == EOT else f"\0eos={self.eot_token}")
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

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
