"""Bits per byte rank runs with different vocabularies; nats per token cannot.

Two tokenizers (vocab 1024 and 4096 by default) on the same corpus, each trained briefly and for longer
(separate runs, each with its own LR schedule). Every run is evaluated with `trainwise eval` on the same
held-out text (every tenth topic of the built-in corpus, 32 KB, never trained on). The claim checked: the order
of the vocabularies by bpb after the short training is the order after the longer one; the table also
shows loss in nats/token, which a bigger vocabulary inflates (more bytes per token to predict), so it
cannot rank them.

    python benchmarks/bench_bpb_vocab.py --short-steps 100 --long-steps 400 --out /tmp/bpb-vocab
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4", "model.max_seq_len=64",
         "train.seq_len=64", "train.micro_batch=8", "train.warmup_steps=20", "train.eval_steps=8",
         "train.log_every=25", "train.checkpoint_every=0", "train.sample_tokens=20", "train.seed=1",
         "train.precision=fp32", "train.compile=false"]  # small: the whole benchmark fits in ~10 min on 2 cores




from trainwise.hardware.cache import cpu_model

def split_corpus(out: Path) -> tuple[Path, Path]:
    """The built-in corpus, every tenth topic held out (7% of its bytes): (train.txt, held_out.txt)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    train = [topics[k] for i, k in enumerate(keys) if i % 10 != 0]
    held = [topics[k] for i, k in enumerate(keys) if i % 10 == 0]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("\n\n".join(train), encoding="utf-8")
    (out / "held_out.txt").write_text("\n\n".join(held), encoding="utf-8")
    return out / "train.txt", out / "held_out.txt"


def run_one(out: Path, corpus: Path, held_out: Path, vocab: int, steps: int, extra: list[str]) -> dict:
    from trainwise.config import RunConfig, apply_overrides
    from trainwise.evaluate import evaluate_run
    from trainwise.trainer.loop import train

    run_dir = out / f"v{vocab}-s{steps}"
    start = time.perf_counter()
    cfg = apply_overrides(RunConfig(), MODEL + extra + [f"tokenizer.vocab_size={vocab}", f"train.max_steps={steps}",
                                                        f"train.eval_every={steps}", f"data.paths=['{corpus}']"])
    result = train(cfg, out=run_dir, quiet=True)
    seconds = time.perf_counter() - start
    ev = evaluate_run(run_dir, [str(held_out)])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val_bpb" in r][-1]
    return {"vocab": vocab, "steps": steps, "train_s": seconds, "val_loss": result.val_loss, "val_bpb": val["val_bpb"],
            "eval_loss": ev.loss, "eval_bpb": ev.bpb, "eval_tokens": ev.tokens, "eval_bytes": ev.bytes,
            "bytes_per_token": ev.bytes / ev.tokens, "run_dir": str(run_dir)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", type=int, nargs=2, default=[1024, 4096])
    p.add_argument("--short-steps", type=int, default=100)
    p.add_argument("--long-steps", type=int, default=400)
    p.add_argument("--out", required=True, help="a new directory for the runs")
    p.add_argument("--set", action="append", default=[], help="extra config overrides (section.key=value)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    out = Path(args.out)
    corpus, held_out = split_corpus(out)
    print(f"CPU: {cpu_model()}; held-out text: {held_out.stat().st_size:,} bytes")
    results = [run_one(out, corpus, held_out, v, s, args.set) for s in (args.short_steps, args.long_steps)
               for v in args.vocabs]
    print(f"{'vocab':>6} {'steps':>6} {'train s':>8} {'bytes/tok':>9} {'eval nats/tok':>13} {'eval bpb':>9} "
          f"{'val bpb':>8}")
    for r in results:
        print(f"{r['vocab']:>6} {r['steps']:>6} {r['train_s']:>8.1f} {r['bytes_per_token']:>9.3f} "
              f"{r['eval_loss']:>13.4f} {r['eval_bpb']:>9.4f} {r['val_bpb']:>8.4f}")

    def order(steps: int, key: str) -> list[int]:
        return [r["vocab"] for r in sorted((r for r in results if r["steps"] == steps), key=lambda r: r[key])]

    summary = {key: {"short": order(args.short_steps, key), "long": order(args.long_steps, key)}
               for key in ("eval_bpb", "val_bpb", "eval_loss")}
    consistent = summary["eval_bpb"]["short"] == summary["eval_bpb"]["long"]
    for key, o in summary.items():
        print(f"best to worst by {key}: short {o['short']}, long {o['long']}")
    print(f"bpb ranking after {args.short_steps} steps {'matches' if consistent else 'DIFFERS FROM'} the ranking "
          f"after {args.long_steps} steps")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "runs": results, "order": summary,
                                               "consistent": consistent}, indent=1))
    return 0 if consistent else 1


if __name__ == "__main__":
    sys.exit(main())
