"""`trainwise data PATH...`: what a corpus holds, before any training.

Files by kind (formats, binaries skipped, duplicates), encodings, bytes, documents, tokens with a given
tokenizer (or a run's, or one trained on the corpus), characters and bytes per token, the most frequent
tokens, and each source's share of a mixture. The tokens go to the same cache `trainwise train` uses,
so a run on the same data and tokenizer starts without tokenizing again.
"""

from __future__ import annotations

import numpy as np

from trainwise.config import DataConfig
from trainwise.data import corpus as data_mod
from trainwise.data.batches import Mixture


def inspect_data(data_cfg: DataConfig, tokenizer, top: int = 10) -> dict:
    """The data report as a JSON-ready dict (bytes in bytes, counts as integers)."""
    tokens = data_mod.prepare_data(data_cfg, tokenizer, seq_len=1)
    s = tokens.stats
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for split in (tokens.train, tokens.val):
        for stream in split.streams if isinstance(split, Mixture) else [split]:
            counts += data_mod._bincount(stream, tokenizer.vocab_size)[:tokenizer.vocab_size]
    order = np.argsort(-counts, kind="stable")[:top]
    report = {
        "corpus": data_mod.describe(data_cfg),
        "discovery": s.report,
        "documents": s.documents,
        "text_bytes": s.bytes,
        "chars": s.chars,
        "tokens": s.tokens,
        "replaced_bytes": s.replaced_bytes,
        "chars_per_token": s.chars / s.tokens,
        "bytes_per_token": s.bytes / s.tokens,
        "tokenizer": {"vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
                      "fingerprint": tokenizer.fingerprint()[:16]},
        "top_tokens": [{"id": int(i), "text": tokenizer.decode([int(i)]), "count": int(counts[i]),
                        "share": float(counts[i] / s.tokens)} for i in order if counts[i]],
        "cache": str(tokens.path),
    }
    if tokens.sources:
        weights = sum(src["weight"] for src in tokens.sources)
        report["sources"] = [{**src, "share_of_tokens": src["tokens"] / s.tokens,
                              "share_sampled": src["weight"] / weights} for src in tokens.sources]
    return report


def render(report: dict) -> str:
    d = report["discovery"]
    lines = [f"corpus: {report['corpus']}"]
    sections = [d] if "files" in d else list(d.get("sources", {}).values())
    for i, disc in enumerate(sections):
        if not disc:
            continue
        prefix = f"  source {i + 1}: " if len(sections) > 1 else "  "
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(disc["formats"].items()))
        lines.append(f"{prefix}files: {disc['files']:,} read ({kinds}), {disc['bytes']:,} bytes on disk")
        for codec, e in sorted(disc["encodings"].items()):
            lines.append(f"{prefix}  encoding {codec}: {e['files']:,} file(s), {e['bytes']:,} bytes")
        for kind in ("binary_skipped", "duplicates_skipped", "unreadable_skipped"):
            if disc[kind]["files"]:
                size = f", {disc[kind]['bytes']:,} bytes" if "bytes" in disc[kind] else ""
                lines.append(f"{prefix}  skipped {kind.split('_')[0]}: {disc[kind]['files']:,} file(s){size}: "
                             + ", ".join(disc[kind]["examples"]))
        lines += [f"{prefix}  {note}" for note in disc.get("notes", [])]
    t = report["tokenizer"]
    lines += [
        f"documents: {report['documents']:,}; text: {report['chars']:,} characters, "
        f"{report['text_bytes']:,} UTF-8 bytes"
        + (f"; {report['replaced_bytes']:,} undecodable input bytes replaced by U+FFFD"
           if report["replaced_bytes"] else ""),
        f"tokens: {report['tokens']:,} (tokenizer with {t['vocab_size']:,} tokens, one end-of-text token per "
        f"document); {report['chars_per_token']:.2f} characters / token, {report['bytes_per_token']:.2f} bytes / token",
        "top tokens: " + ", ".join(f"{tok['text']!r} {tok['share']:.1%}" for tok in report["top_tokens"]),
    ]
    for src in report.get("sources", []):
        lines.append(f"source {src['name']}: {src['tokens']:,} tokens ({src['share_of_tokens']:.1%} of the corpus), "
                     f"weight {src['weight']:g} -> {src['share_sampled']:.1%} of the tokens trained on")
    lines.append(f"cached at {report['cache']} (trainwise train on this data and tokenizer reuses it)")
    return "\n".join(lines)
