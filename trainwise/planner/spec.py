"""A model named on the command line or in the API: a preset, a trainwise TOML (with the run its [train]
section describes) or a Hugging Face config.json, or a folder holding one."""

from __future__ import annotations

from pathlib import Path

from trainwise.config import ModelConfig, load_config
from trainwise.cost.run import Run
from trainwise.errors import TrainwiseError
from trainwise.hf_config import load_hf_config
from trainwise.presets import PRESETS, get_preset


def load_model(spec: str) -> tuple[ModelConfig, Run | None]:
    """Preset name, .toml or config.json, or a folder holding one (a run directory's config.toml, a Hugging
    Face checkout's config.json). A trainwise TOML also returns the run it describes (Run.of: its [train]
    batch, recipe, optimizer and checkpointing on one device, and its tokens = max_steps x tokens_per_step);
    the others None."""
    path = Path(spec)
    if spec in PRESETS:
        return get_preset(spec), None
    if path.is_dir():
        found = [path / name for name in ("config.toml", "config.json") if (path / name).is_file()]
        if not found:
            raise TrainwiseError(f"--model '{spec}' is a folder without config.toml (a trainwise run) or "
                                 "config.json (a Hugging Face model); give one of those files, or a preset name.")
        spec, path = str(found[0]), found[0]
    if spec.endswith(".toml"):
        cfg = load_config(path)
        return cfg.model, Run.of(cfg, cfg.train.precision)
    if spec.endswith(".json") or path.is_file():
        return load_hf_config(path), None
    return get_preset(spec), None  # raises with the closest preset names
