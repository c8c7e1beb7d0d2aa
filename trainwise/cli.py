"""`trainwise <command>`: the dispatcher. Each command lives in its own module of trainwise.commands
(parse, call the library, print); only the one being run is imported, so `trainwise --help` stays fast."""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import sys
import textwrap

from trainwise.errors import TrainwiseError
from trainwise.runtime.allocator import keep_freed_memory

# command -> (module of trainwise.commands, one line of help), in the order `trainwise --help` lists them
COMMANDS = {
    "train": ("train", "train a model (default: the small default model on the built-in corpus)"),
    "sample": ("sample", "generate text from a trained run"),
    "tokenizer": ("tokenizer", "train, encode, decode with a byte-level BPE tokenizer"),
    "plan": ("plan", "parameters, FLOPs, memory and time of a run, before running it"),
    "mem": ("mem", "bytes of one tensor"),
    "hardware": ("hardware", "the table of known accelerators"),
    "verify": ("verify", "recompute and print a run's predicted-vs-measured table"),
    "roofline": ("roofline", "every operator of one training step on the roofline"),
    "explain": ("explain", "each concept of LLM training as a computation you can run"),
    "report": ("report", "write DIR/report.html: loss, LR, throughput, plan vs measured, memory, roofline"),
    "export": ("export", "export a run as a Hugging Face transformers model directory"),
    "data": ("data", "inspect a corpus without training: files, encodings, tokens"),
    "eval": ("eval", "loss, perplexity and bits per byte of a trained run on any text"),
    "compare": ("compare", "runs side by side: loss vs tokens and FLOPs, throughput, memory, plan vs measured, config"),
    "scale": ("scale", "fit L(N, D) = E + A/N^alpha + B/D^beta to runs; predict, plan, sweep"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-paragraph error: the flag, what is wrong, and where the usage is (not the whole
    usage block, which buries the one line that matters). A negative number in exponent form (-1e9) is a
    value, as -5 and -0.5 are to argparse, not an unknown flag: the flag's own check then names it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str):
        text = f"{self.prog}: error: {message.rstrip('.')}. See `{self.prog} --help` for the options and examples."
        text = textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)
        self.exit(2, text + "\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: every command is listed, and the one argv names gets its full parser (its
    module, and what it imports, is loaded only then)."""
    parser = _Parser(
        prog="trainwise",
        description="Train language models and account for what training costs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="run `trainwise <command> --help` for the options and examples of each command",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        if name == chosen:
            importlib.import_module(f"trainwise.commands.{module}").register(sub, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return parser


# What to do about the operating system's refusals a user meets (others: the generic advice)
OS_FIXES = {errno.ENOENT: "Give a path that exists (a file to write: one whose folder exists)",
            errno.EISDIR: "A folder has that name: give the path of a file",
            errno.ENOTDIR: "A part of that path is a file, not a folder: give another path",
            errno.EACCES: "Fix the permissions, or give a path you may write", errno.EPERM: "Fix the permissions",
            errno.EROFS: "That file system is read-only: give a path on another",
            errno.ENOSPC: "Free disk space"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    keep_freed_memory()  # what `plan` and `hardware` time is what `train` runs: one allocator (runtime.allocator)
    try:
        return args.func(args)
    except TrainwiseError as err:
        message = textwrap.fill(str(err), width=100, break_long_words=False, break_on_hyphens=False)
        print(f"trainwise {args.command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trainwise ... | head`: an OSError too, but not the user's problem
        return 0
    except OSError as err:  # a full disk, a permission, a path that is not there: the user's environment, not a bug
        where = f" ({err.filename})" if err.filename else ""
        fix = OS_FIXES.get(err.errno, "Free disk space or fix the permissions")
        again = " (a training run resumes with --resume DIR)" if args.command == "train" else ""
        print(f"trainwise {args.command}: error: {err.strerror or err}{where}. {fix}, then run the command "
              f"again{again}.", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
