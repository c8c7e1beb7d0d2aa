"""The Python API, mirroring the CLI: `trainwise.train(...)`, `trainwise.load(DIR)`, `trainwise.plan(...)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trainwise.config import RunConfig, load_config
from trainwise.errors import TrainwiseError
from trainwise.model import Transformer
from trainwise.tokenizer import Tokenizer
from trainwise.train import checkpoint as ckpt
from trainwise.train.precision import resolve_device


@dataclass
class LoadedRun:
    """A trained model with its tokenizer and config, ready to generate."""

    config: RunConfig
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device

    def generate(self, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 50,
                 top_p: float = 1.0, seed: int = 0) -> str:
        from trainwise.train.loop import sample_text

        return sample_text(self.model, self.tokenizer, self.device, max_new_tokens, seed=seed, prompt=prompt,
                           temperature=temperature, top_k=top_k, top_p=top_p)


def load(run_dir: str | Path, device: str = "auto") -> LoadedRun:
    """Load the latest checkpoint of a run directory (verified against its manifest)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise TrainwiseError(f"'{run_dir}' is not a trainwise run directory (no config.toml).")
    cfg = load_config(run_dir / "config.toml")
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        raise TrainwiseError(f"run directory '{run_dir}' has no checkpoint yet; train it first.")
    tokenizer = Tokenizer.load(run_dir / "tokenizer.json")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise TrainwiseError(
            f"{run_dir / 'tokenizer.json'} has {tokenizer.vocab_size} tokens but the model was built for "
            f"{cfg.model.vocab_size}: the tokenizer does not belong to this checkpoint."
        )
    model = Transformer(cfg.model)
    ckpt.verify_checkpoint(latest)
    ckpt.load_model_state(model, latest / "model.safetensors")
    dev = resolve_device(device)
    model.to(dev).eval()
    return LoadedRun(cfg, model, tokenizer, dev)


def train(config: RunConfig | None = None, out: str | Path | None = None, **kwargs):
    """Same as `trainwise train`; returns a TrainResult (run_dir, losses, sample)."""
    from trainwise.train.loop import train as _train

    return _train(config, out, **kwargs)


def plan(model=None, *, params: float | None = None, tokens: float | None = None, **run):
    """Same as `trainwise plan`: `model` is a preset name, a trainwise TOML, a HF config.json or a
    ModelConfig; `run` takes plan_run's keywords (seq_len, micro_batch, gpu, gpus, precision, zero, ...).
    Returns a Plan (`.to_json()`, `.explain()`)."""
    from trainwise.config import ModelConfig
    from trainwise.cost.cli import load_model
    from trainwise.cost.plan import plan_run

    settings = {}
    if isinstance(model, str):
        model, settings = load_model(model)
    elif model is not None and not isinstance(model, ModelConfig):
        raise TrainwiseError("plan(model=...) takes a preset name, a file path or a ModelConfig.")
    run_tokens = settings.pop("tokens", None)  # a trainwise TOML knows its run length
    settings.update(run)
    if tokens is None and run_tokens is None:
        raise TrainwiseError("plan() needs tokens=D, the number of training tokens.")
    return plan_run(model, params_count=params, tokens=tokens or run_tokens, **settings)
