"""A trained run, loaded for inference: its latest checkpoint, tokenizer and config, and sampling from it.

`trainwise.load(DIR)` and `trainwise sample DIR` come here, and so do evaluation and export.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from trainwise import rundir
from trainwise.config import RunConfig, load_config
from trainwise.errors import TrainwiseError
from trainwise.model import Transformer
from trainwise.model.transformer import NonFiniteLogits
from trainwise.runtime import checkpoint as ckpt
from trainwise.runtime.precision import resolve_device
from trainwise.runtime.step import build_model
from trainwise.tokenizer import Tokenizer


@dataclass
class LoadedRun:
    """A trained model with its tokenizer and config, ready to generate."""

    config: RunConfig
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device

    def generate(self, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 50,
                 top_p: float = 1.0, seed: int = 0) -> str:
        return sample_text(self.model, self.tokenizer, self.device, max_new_tokens, seed=seed, prompt=prompt,
                           temperature=temperature, top_k=top_k, top_p=top_p)


def load_run(run_dir: str | Path, device: str = "auto") -> LoadedRun:
    """Load the latest checkpoint of a run directory (verified against its manifest)."""
    run_dir = Path(run_dir)
    if not rundir.is_run_dir(run_dir):
        raise TrainwiseError(f"'{run_dir}' is not a trainwise run directory (no {rundir.CONFIG}).")
    cfg = load_config(run_dir / rundir.CONFIG)
    latest = rundir.latest_checkpoint(run_dir)
    if latest is None:
        raise TrainwiseError(f"run directory '{run_dir}' has no checkpoint yet; train it first.")
    tokenizer = Tokenizer.load(run_dir / rundir.TOKENIZER)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise TrainwiseError(
            f"{run_dir / rundir.TOKENIZER} has {tokenizer.vocab_size} tokens but the model was built for "
            f"{cfg.model.vocab_size}: the tokenizer does not belong to this checkpoint."
        )
    model = build_model(cfg.model)
    ckpt.load_weights(model, latest)
    dev = resolve_device(device)
    model.to(dev).eval()
    return LoadedRun(cfg, model, tokenizer, dev)


def sample_text(model: torch.nn.Module, tokenizer: Tokenizer, device: torch.device, n_tokens: int,
                seed: int, prompt: str = "", temperature: float = 0.8, top_k: int = 50,
                top_p: float = 1.0) -> str:
    check_sampling(n_tokens, temperature, top_k, top_p, seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    try:
        out = model.generate(idx, n_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    except NonFiniteLogits as err:  # a diverged run still ends with its report: the sample says why there is none
        return f"(no sample: {err})"
    new = out[0, len(ids):].tolist() if not prompt else out[0].tolist()
    return tokenizer.decode(new)


def check_sampling(n_tokens: int, temperature: float, top_k: int, top_p: float, seed: int = 0) -> None:
    """The sampling settings a user gives (`trainwise sample`'s flags, LoadedRun.generate's arguments)."""
    problems = [f"{name} (--{name.replace('_', '-')}) = {value} must be {what}" for name, value, ok, what in (
        ("max_new_tokens", n_tokens, n_tokens >= 0, "0 or more"),
        ("temperature", temperature, math.isfinite(temperature) and temperature >= 0, "a finite number, 0 or more "
         "(0 samples greedily)"),
        ("top_k", top_k, top_k >= 0, "0 or more (0 keeps every token)"),
        ("top_p", top_p, 0 <= top_p <= 1, "between 0 and 1 (1 keeps every token)"),
        ("seed", seed, 0 <= seed < 2**63, "0 or more and under 2^63 (a torch generator's seed)")) if not ok]
    if problems:
        raise TrainwiseError(f"cannot sample: {'; '.join(problems)}.")
