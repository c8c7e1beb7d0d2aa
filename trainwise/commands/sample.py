"""`trainwise sample DIR --prompt TEXT`: generate text from a trained run."""

from __future__ import annotations

import argparse

from trainwise.inference import check_sampling, load_run


def register(sub, help_text: str) -> None:
    p = sub.add_parser("sample", help=help_text,
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


def cmd_sample(args: argparse.Namespace) -> int:
    # before the checkpoint loads
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    run = load_run(args.run_dir, device=args.device)
    print(run.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed))
    return 0
