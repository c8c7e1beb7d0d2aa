"""A model named on the command line or in the API: a preset, a trainwise TOML (with the run its [train]
section describes) or a Hugging Face config.json."""

from __future__ import annotations

from pathlib import Path

from trainwise.config import ModelConfig, load_config
from trainwise.cost.run import Run
from trainwise.hf_config import load_hf_config
from trainwise.presets import PRESETS, get_preset


def load_model(spec: str) -> tuple[ModelConfig, Run | None]:
    """Preset name, .toml or config.json. A trainwise TOML also returns the run it describes
    (Run.of: its [train] batch, recipe, optimizer and checkpointing on one device, and its tokens =
    max_steps x tokens_per_step); the others None."""
    path = Path(spec)
    if spec in PRESETS:
        return get_preset(spec), None
    if spec.endswith(".toml"):
        cfg = load_config(path)
        return cfg.model, Run.of(cfg, cfg.train.precision)
    if spec.endswith(".json") or path.is_file():
        return load_hf_config(path), None
    return get_preset(spec), None  # raises with the closest preset names
