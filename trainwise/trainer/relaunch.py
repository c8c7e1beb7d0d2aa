"""Relaunch = resume: a cluster scheduler that requeues a job runs the very same command again.

`trainwise train --out DIR ...` decides from DIR's files alone, before any process writes there, so every
rank of a torchrun job (one or many machines, DIR on shared storage) decides the same:

    DIR absent or empty                           a new run
    DIR holds a run (config.toml) of this config  continue it from its latest checkpoint, or from step 0
                                                  when it was killed before its first one
    DIR holds a run of another config             TrainwiseError naming the keys that differ
    DIR holds other files                         TrainwiseError (check_run_dir): nothing is touched

`train.resume` chooses: auto (the table above, the default), never (an existing run is refused, as
before relaunch existed), always (a new run is refused: DIR must hold one, e.g. a job that must only
ever continue). What a continued run may change is what `--resume DIR --max-steps N` may change.
"""

from __future__ import annotations

import copy
from pathlib import Path

from trainwise import rundir
from trainwise.config import RunConfig, config_to_dict, load_config
from trainwise.errors import TrainwiseError
from trainwise.export.hf import read_hf_model_config
from trainwise.runtime import distributed

# a longer run, another policy or core count: the same run
MAY_DIFFER = {"train.max_steps", "train.resume", "data.workers"}
MAX_LISTED = 8


def should_resume(out: Path, cfg: RunConfig, init_from: str | None) -> bool:
    """Whether `train(cfg, out)` continues the run already in `out` (see the module docstring); raises
    when DIR holds a run the policy or the config forbids continuing."""
    policy = cfg.train.resume
    if not rundir.is_run_dir(out):
        if policy == "always":
            raise TrainwiseError(
                f"train.resume = always, but '{out}' holds no trainwise run to continue (no config.toml). "
                "Check --out, or set train.resume=auto to start a new run there."
            )
        return False
    if policy == "never":
        raise TrainwiseError(
            f"run directory '{out}' already holds a run and train.resume = never; nothing was written to it. "
            f"Continue it with `trainwise train --resume {out}`, drop train.resume=never to let the same "
            "command continue it, or choose a new --out."
        )
    differences = config_differences(as_saved(cfg, out, init_from), load_config(out / rundir.CONFIG))
    if differences:
        listed = "; ".join(differences[:MAX_LISTED]) + (
            f"; and {len(differences) - MAX_LISTED} more" if len(differences) > MAX_LISTED else "")
        raise TrainwiseError(
            f"run directory '{out}' holds a run of a different config, so this command cannot continue it; "
            f"nothing was written to it. {len(differences)} key(s) differ (this command vs its config.toml): "
            f"{listed}. Rerun the command that started it, continue it as saved with "
            f"`trainwise train --resume {out}`, or choose a new --out."
        )
    return True


def as_saved(cfg: RunConfig, out: Path, init_from: str | None) -> RunConfig:
    """`cfg` with the values a run fills in before it saves config.toml: the model's vocab_size follows
    the trained tokenizer; with --init-from the model is the Hugging Face checkpoint's and the
    tokenizer's vocab_size is its tokenizer's. Those are derived, not chosen, so they come from DIR."""
    cfg = copy.deepcopy(cfg)
    saved = load_config(out / rundir.CONFIG)
    if init_from:
        cfg.model, _ = read_hf_model_config(Path(init_from))
        cfg.tokenizer.vocab_size = saved.tokenizer.vocab_size
    else:
        cfg.model.vocab_size = saved.model.vocab_size
    return cfg


def config_differences(mine: RunConfig, saved: RunConfig) -> list[str]:
    """'section.key: A vs B' for every key whose value differs, except MAY_DIFFER."""
    a, b = config_to_dict(mine), config_to_dict(saved)
    out = []
    for section in a:
        for key in a[section]:
            name = f"{section}.{key}"
            if name not in MAY_DIFFER and a[section][key] != b.get(section, {}).get(key):
                out.append(f"{name} {a[section][key]!r} vs {b.get(section, {}).get(key)!r}")
    return out


def check_ranks_agree(out: Path, resume: bool, d: distributed.Dist) -> None:
    """Under torchrun every rank decided alone from DIR's files; they must have seen the same ones (one
    run directory on storage every machine shares), or rank 0 would resume while another starts anew."""
    if not d.active:
        return
    latest = rundir.latest_checkpoint(out) if resume else None
    views = distributed.gather_objects((resume, latest.name if latest else None), d)
    if any(view != views[0] for view in views):
        seen = ", ".join(f"rank {r}: {'continue ' + (v[1] or 'from step 0') if v[0] else 'new run'}"
                         for r, v in enumerate(views))
        raise TrainwiseError(
            f"the ranks see different contents in '{out}' ({seen}). Every machine must read and write the "
            "same run directory: put --out on storage all nodes share (NFS, Lustre, a cloud filesystem)."
        )
