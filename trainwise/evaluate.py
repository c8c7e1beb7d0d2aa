"""How well a trained run predicts a text (`trainwise eval RUN --data PATH...`), in units that compare
across tokenizers.

    loss (nats/token)   = N / tokens,  N = sum over predicted tokens of -ln p(token | context)
    perplexity          = exp(loss)
    bpb (bits per byte) = N / ln 2 / bytes,  bytes = UTF-8 bytes of the evaluated text

Loss per token depends on the tokenizer (a bigger vocabulary packs more text into a token, so each
token is harder to predict); bits per byte do not: N / ln 2 is the length in bits of the text coded with
the model (arithmetic coding reaches it to within a few bits), and the text has the same bytes whatever
the tokenizer. So runs with different vocabularies are ranked by bpb.

How the text is scored, as training sees it: the documents are tokenized as the token cache tokenizes
them (trainwise.data.tokencache.encode_pieces) and joined with the end-of-text token after each one,
behind one leading end-of-text token (the context a document starts from in training). The stream is
cut into consecutive windows of the run's seq_len; every token after the leading one is predicted
exactly once, the tokens at the start of a window from a shorter context (no overlap, as the training
loss is computed). The end-of-text tokens are predicted too and their nats count in N, but they hold
0 bytes of text: bpb is the cost of coding the text *and* where its documents end, per byte of text.
Deterministic: the same run and text give the same numbers.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from trainwise.config import DataConfig
from trainwise.data.bpb import bits_per_byte
from trainwise.data.formats import iter_documents
from trainwise.data.tokencache import ShardStats, encode_pieces
from trainwise.errors import TrainwiseError
from trainwise.inference import load_run
from trainwise.runtime.precision import autocast, resolve_precision
from trainwise.tokenizer import Tokenizer

LOGIT_ROWS = 1024  # LM-head rows computed at once: never the whole (B*T, V) logits
BATCH_TOKENS = 8192  # windows per forward: at least micro_batch, else about this many tokens (no gradients kept)


@dataclass
class EvalResult:
    loss: float  # nats per predicted token
    perplexity: float  # exp(loss)
    bpb: float  # bits per UTF-8 byte of text
    nats: float  # summed over predicted tokens
    tokens: int  # predicted tokens, one end-of-text token per document included
    bytes: int  # UTF-8 bytes of the evaluated text
    documents: int  # documents read (a file of plain text, a .jsonl line, a row)
    windows: int  # forward passes over at most seq_len tokens
    seq_len: int
    precision: str
    run_dir: str
    data: list[str]

    def to_json(self) -> dict:
        return asdict(self)


@torch.no_grad()
def window_nats(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Summed -ln p(y | x) over a batch of windows, x and y (B, T); the LM head a slice of rows at a time."""
    hidden = model.hidden_states(x).flatten(0, 1)  # (B*T, H)
    targets = y.flatten()
    total = 0.0
    for start in range(0, hidden.shape[0], LOGIT_ROWS):
        logits = model.lm_head(hidden[start:start + LOGIT_ROWS]).float()  # (rows, V)
        total += F.cross_entropy(logits, targets[start:start + LOGIT_ROWS], reduction="sum").item()
    return total


def evaluate_texts(model: torch.nn.Module, tokenizer: Tokenizer, texts: Iterator[tuple[str, bool]], seq_len: int,
                   micro_batch: int, device: torch.device, precision: str, quiet: bool = True) -> dict:
    """nats, tokens, bytes, documents and windows of `model` over `texts`, (piece, ends_a_document) pairs
    (see the module docstring)."""
    counts = {"nats": 0.0, "tokens": 0, "windows": 0}
    read = ShardStats()  # bytes and documents of the text, counted as it is encoded
    was_training = model.training
    model.eval()

    def run(windows: np.ndarray, length: int) -> None:  # windows (B, length + 1)
        x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1])).to(device)
        y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:])).to(device)
        with autocast(device, precision):
            counts["nats"] += window_nats(model, x, y)
        counts["tokens"] += windows.shape[0] * length
        counts["windows"] += windows.shape[0]
        bar.update(windows.shape[0] * length)

    full = micro_batch * seq_len  # targets in one full batch
    buf = np.zeros(0, dtype=np.int64)
    with tqdm(desc="evaluating", unit="tok", unit_scale=True, delay=1.0, disable=quiet, file=sys.stderr) as bar:
        for ids in encode_pieces(texts, tokenizer, tokenizer.eot_id, read, leading_eot=True):
            buf = np.concatenate([buf, np.asarray(ids, dtype=np.int64)])
            while len(buf) > full:
                # B windows of T targets: window b is buf[bT : bT + T + 1]; the next batch starts at buf[BT]
                starts = np.arange(micro_batch) * seq_len
                run(np.stack([buf[s:s + seq_len + 1] for s in starts]), seq_len)
                buf = buf[full:]
        n_full = (len(buf) - 1) // seq_len
        if n_full:
            run(np.stack([buf[s:s + seq_len + 1] for s in np.arange(n_full) * seq_len]), seq_len)
        rest = buf[n_full * seq_len:]
        if len(rest) > 1:
            run(rest[None, :], len(rest) - 1)
    model.train(was_training)
    return {**counts, "bytes": read.bytes, "documents": read.documents}


def evaluate_run(run_dir: str | Path, paths: list[str], text_field: str = "text", device: str = "auto",
                 precision: str = "auto", quiet: bool = True) -> EvalResult:
    """Load the latest checkpoint of `run_dir` and evaluate it on the text at `paths`."""

    if not paths:
        raise TrainwiseError("eval needs the text to evaluate on: --data PATH... (files, directories or globs).")
    run = load_run(run_dir, device=device)
    precision, _ = resolve_precision(run.config.train.precision if precision == "auto" else precision, run.device)
    t = run.config.train
    texts = iter_documents(DataConfig(paths=list(paths), text_field=text_field))
    batch = max(t.micro_batch, BATCH_TOKENS // t.seq_len)  # small batches pay per-forward overhead
    c = evaluate_texts(run.model, run.tokenizer, texts, t.seq_len, batch, run.device, precision, quiet)
    if c["bytes"] == 0:
        raise TrainwiseError(f"the text at {', '.join(paths)} is empty: there is nothing to evaluate. Pass files "
                             "with text (or set --text-field to the field that holds it).")
    loss = c["nats"] / c["tokens"]
    return EvalResult(loss=loss, perplexity=math.exp(loss), bpb=bits_per_byte(c["nats"], c["bytes"]),
                      nats=c["nats"], tokens=c["tokens"], bytes=c["bytes"], documents=c["documents"],
                      windows=c["windows"], seq_len=t.seq_len, precision=precision, run_dir=str(run_dir),
                      data=list(paths))


def format_result(r: EvalResult) -> str:
    rows = [("loss", f"{r.loss:.4f} nats/token (natural log, mean over predicted tokens)"),
            ("perplexity", f"{r.perplexity:.2f} (exp of the loss)"),
            ("bits per byte", f"{r.bpb:.4f} (summed nats / ln 2 / UTF-8 bytes; tokenizer-independent)"),
            ("tokens", f"{r.tokens:,} predicted, {r.documents:,} end-of-text included"),
            ("bytes", f"{r.bytes:,} bytes of UTF-8 text ({r.bytes / 1e6:.3f} MB)"),
            ("windows", f"{r.windows:,} of at most {r.seq_len} tokens, {r.precision}")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def explain_result(r: EvalResult) -> str:
    """The formulas, the numbers substituted, the results."""
    return "\n".join([
        "N = sum over predicted tokens of -ln p(token | preceding tokens of its window)",
        f"  = {r.nats:,.4f} nats over {r.tokens:,} tokens ({r.windows:,} windows of at most {r.seq_len})",
        "loss = N / tokens",
        f"     = {r.nats:,.4f} / {r.tokens:,} = {r.loss:.4f} nats/token",
        "perplexity = exp(loss)",
        f"           = exp({r.loss:.4f}) = {r.perplexity:.2f}",
        "bpb = N / ln 2 / bytes   (bits to code the text and its document ends, per UTF-8 byte of text)",
        f"    = {r.nats:,.4f} / {math.log(2):.6f} / {r.bytes:,} = {r.bpb:.4f} bits/byte",
    ])


