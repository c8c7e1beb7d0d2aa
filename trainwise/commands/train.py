"""`trainwise train`: train (or continue) a run."""

from __future__ import annotations

import argparse
import json
import os

from torch.distributed import DistError

from trainwise.config import RunConfig, apply_overrides, load_config
from trainwise.errors import TrainwiseError
from trainwise.presets import get_preset
from trainwise.runtime.distributed import exit_worker
from trainwise.trainer.loop import train

EPILOG = """examples:
  trainwise train                                   # default model on the built-in corpus
  trainwise train --data notes/ --out runs/notes --set train.max_steps=2000
  trainwise train --model trainwise-gpt2-small --set train.precision=fp32
  trainwise train --resume runs/notes --max-steps 3000
  (the same `--out runs/notes ...` command run again continues its run: train.resume=auto)
"""


def register(sub, help_text: str) -> None:
    p = sub.add_parser("train", help=help_text, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML file with [model], [train], [data], [tokenizer] sections")
    p.add_argument("--model", help="model preset name (trainwise-small, trainwise-gpt2-small, trainwise-moe-small, "
                   "...; an unknown name lists them all)")
    p.add_argument("--data", nargs="+", metavar="PATH", help="files, folders or globs: text in any encoding, .jsonl, "
                   ".csv/.tsv, Parquet, Arrow, datasets folders, compressed or not (see `trainwise data`)")
    p.add_argument("--out", help="run directory to create (default runs/run-DATE-TIME); one that holds a run of the "
                   "same config is continued from its latest checkpoint (train.resume=auto; never|always)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one config value")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    p.add_argument("--max-steps", type=int, help="train until this optimizer step")
    p.add_argument("--init-from", metavar="HF_DIR", help="start from a local Hugging Face checkpoint (llama, qwen3, "
                   "gpt2, mixtral): its config, weights and tokenizer")
    p.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    p.add_argument("--json", action="store_true", help="print the final numbers as JSON")
    p.set_defaults(func=cmd_train)


def build_config(args: argparse.Namespace) -> RunConfig:
    """The run's config from --config, --model, --data and --set, in that order."""
    cfg = load_config(args.config) if args.config else RunConfig()
    if args.model:
        cfg.model = get_preset(args.model)
        cfg.tokenizer.vocab_size = cfg.model.vocab_size
    overrides = list(args.set or [])
    if args.data:
        overrides.append("data.paths=" + json.dumps(args.data))
    return apply_overrides(cfg, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return _train(args)
    try:
        exit_worker(_train(args))
    except RuntimeError as err:  # a collective failed: another rank died or hung past the timeout
        text = str(err)
        if not isinstance(err, DistError) and not any(w in text for w in ("gloo", "Connection", "NCCL", "imed out")):
            raise
        rank = os.environ.get("RANK", "?")
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrainwiseError(
            f"rank {rank} of {world_size}: lost contact with the other ranks ({first_line[:200]}). The job "
            "stops; once every rank is back, rerun the same torchrun command: it continues from the last "
            "checkpoint (or use --resume DIR)."
        ) from None


def _train(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.data or args.set or args.model or args.init_from or args.out:
            raise TrainwiseError(
                "--resume DIR continues the run in DIR with the config saved there; drop --out, --config, --data, "
                "--model, --set and --init-from (only --max-steps may change)."
            )
        result = train(out=args.resume, resume=True, max_steps=args.max_steps, quiet=args.quiet)
    else:
        cfg = build_config(args)
        result = train(cfg, out=args.out, max_steps=args.max_steps, quiet=args.quiet, init_from=args.init_from)
    if args.json:
        print(json.dumps({"run_dir": str(result.run_dir), "step": result.step, "train_loss": result.train_loss,
                          "val_loss": result.val_loss, "unigram_loss": result.unigram_loss,
                          "stopped_early": result.stopped_early}))
    return 0
