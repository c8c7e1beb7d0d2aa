"""A model named on the command line or in the API: a preset, a trainwise TOML (with its [train]
settings) or a Hugging Face config.json."""

from __future__ import annotations

from pathlib import Path

from trainwise.config import ModelConfig, load_config
from trainwise.hf_config import load_hf_config
from trainwise.planner.plan import train_settings
from trainwise.presets import PRESETS, get_preset


def load_model(spec: str) -> tuple[ModelConfig, dict]:
    """Preset name, .toml (trainwise config, returns its [train] section too) or config.json."""
    path = Path(spec)
    if spec in PRESETS:
        return get_preset(spec), {}
    if spec.endswith(".toml"):
        cfg = load_config(path)
        return cfg.model, {**train_settings(cfg.train), "tokens": cfg.train.max_steps * cfg.train.tokens_per_step}
    if spec.endswith(".json") or path.is_file():
        return load_hf_config(path), {}
    return get_preset(spec), {}  # raises with the closest preset names
