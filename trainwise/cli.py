"""`trainwise <command>`: a thin layer over functions that tests call directly."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from trainwise.errors import TrainwiseError

EPILOG_TRAIN = """examples:
  trainwise train                                   # default model on the built-in corpus
  trainwise train --data notes/ --out runs/notes --set train.max_steps=2000
  trainwise train --model trainwise-gpt2-small --set train.precision=fp32
  trainwise train --resume runs/notes --max-steps 3000
  (the same `--out runs/notes ...` command run again continues its run: train.resume=auto)
"""


def build_config(args: argparse.Namespace):
    from trainwise.config import RunConfig, apply_overrides, load_config
    from trainwise.presets import get_preset

    cfg = load_config(args.config) if args.config else RunConfig()
    if args.model:
        cfg.model = get_preset(args.model)
        cfg.tokenizer.vocab_size = cfg.model.vocab_size
    overrides = list(args.set or [])
    if args.data:
        overrides.append("data.paths=" + json.dumps(args.data))
    return apply_overrides(cfg, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    import os

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return _train(args)
    try:
        code = _train(args)
        # Leave without the interpreter's teardown: under load, a torch.distributed worker thread that
        # outlives destroy_process_group() can abort the process at exit ("terminate called without an
        # active exception"), turning a finished run into a failed job. Every file is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except RuntimeError as err:  # a collective failed: another rank died or hung past the timeout
        from torch.distributed import DistError

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
    from trainwise.train.loop import train

    if args.resume:
        if args.config or args.data or args.set or args.model or args.init_from:
            raise TrainwiseError(
                "--resume continues a run with the config saved in its directory; drop --config, --data, "
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


def cmd_sample(args: argparse.Namespace) -> int:
    from trainwise.api import load

    run = load(args.run_dir, device=args.device)
    text = run.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(text)
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from trainwise.tokenizer import Tokenizer

    if args.action == "train":
        from trainwise import data as data_mod
        from trainwise.config import DataConfig

        tok = data_mod.prepare_tokenizer(DataConfig(paths=args.data or [], text_field=args.text_field),
                                         args.vocab_size)
        tok.save(args.out)
        print(f"trained a byte-level BPE tokenizer with {tok.vocab_size} tokens -> {args.out}")
    elif args.action == "encode":
        tok = Tokenizer.load(args.tokenizer)
        print(json.dumps(tok.encode(args.text)))
    else:
        tok = Tokenizer.load(args.tokenizer)
        try:
            ids = [int(i) for i in args.ids]
        except ValueError:
            raise TrainwiseError("decode takes token ids as integers, e.g. `decode 464 3290`.") from None
        print(tok.decode(ids))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainwise",
        description="Train language models and account for what training costs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run `trainwise <command> --help` for the options and examples of each command",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True

    p = sub.add_parser("train", help="train a model (default: the small default model on the built-in corpus)",
                       epilog=EPILOG_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML file with [model], [train], [data], [tokenizer] sections")
    p.add_argument("--model", help="model preset name (trainwise-small, trainwise-gpt2-small, trainwise-moe-small, ...; "
                   "an unknown name lists them all)")
    p.add_argument("--data", nargs="+", metavar="PATH", help="files, folders or globs: text in any encoding, .jsonl, .csv/.tsv, "
                   "Parquet, Arrow, datasets folders, compressed or not (see `trainwise data`)")
    p.add_argument("--out", help="run directory to create (default runs/run-DATE-TIME); one that holds a run of the same "
                   "config is continued from its latest checkpoint (train.resume=auto; never|always)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override one config value")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    p.add_argument("--max-steps", type=int, help="train until this optimizer step")
    p.add_argument("--init-from", metavar="HF_DIR", help="start from a local Hugging Face checkpoint (llama, qwen3, "
                   "gpt2, mixtral): its config, weights and tokenizer")
    p.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    p.add_argument("--json", action="store_true", help="print the final numbers as JSON")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", help="generate text from a trained run",
                       epilog="example:\n  trainwise sample runs/run-1 --prompt 'The for statement' --seed 1",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("tokenizer", help="train, encode, decode with a byte-level BPE tokenizer",
                       epilog="examples:\n  trainwise tokenizer train --data corpus/ --vocab-size 8192 --out tok.json\n"
                              "  trainwise tokenizer encode --tokenizer tok.json 'hello world'\n"
                              "  trainwise tokenizer decode --tokenizer tok.json 31373 995",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    tsub = p.add_subparsers(dest="action", metavar="<action>")
    tsub.required = True
    t = tsub.add_parser("train", help="train on a corpus (default: the built-in corpus)")
    t.add_argument("--data", nargs="+", metavar="PATH")
    t.add_argument("--text-field", default="text")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--out", default="tokenizer.json")
    t = tsub.add_parser("encode", help="text -> token ids (JSON list)")
    t.add_argument("--tokenizer", required=True)
    t.add_argument("text")
    t = tsub.add_parser("decode", help="token ids -> text")
    t.add_argument("--tokenizer", required=True)
    t.add_argument("ids", nargs="+")
    p.set_defaults(func=cmd_tokenizer)

    for module in ("trainwise.cost.cli", "trainwise.measure.cli", "trainwise.explain", "trainwise.report.cli",
                   "trainwise.datareport", "trainwise.evaluate", "trainwise.report.compare", "trainwise.scale.cli"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        if hasattr(mod, "register"):
            mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from trainwise.train.allocator import keep_freed_memory

    keep_freed_memory()  # what `plan` and `hardware` time is what `train` runs: one allocator (train.allocator)
    try:
        return args.func(args)
    except TrainwiseError as err:
        message = textwrap.fill(str(err), width=100, break_long_words=False, break_on_hyphens=False)
        print(f"trainwise {args.command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trainwise ... | head`: an OSError too, but not the user's problem
        return 0
    except OSError as err:  # a full disk, a permission, a vanished file: the user's environment, not a bug
        where = f" ({err.filename})" if err.filename else ""
        print(f"trainwise {args.command}: error: {err.strerror or err}{where}. Free disk space or fix the "
              "permissions, then run the command again (a training run resumes with --resume DIR).",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
