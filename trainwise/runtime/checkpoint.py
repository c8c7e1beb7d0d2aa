"""Checkpoints that survive crashes: atomic, checksummed, and loadable without pickle.

Layout of one checkpoint, DIR/checkpoints/step_XXXXXXXX/:
    model.safetensors   weights (tied weights stored once)
    optimizer.pt        optimizer state: tensors and numbers only, read with weights_only=True
    rng.pt              torch CPU/CUDA generator states (tensors), read with weights_only=True
    trainer.json        step, token count, sampler state, Python/NumPy RNG states, scaler state
    manifest.json       SHA-256 and size of every file above

A run whose model is divided (parallel.tp, pp or ep > 1) keeps it divided on disk: model.safetensors and
optimizer.pt are replaced by dcp/, written by every rank with torch.distributed.checkpoint (DCP): each
rank saves its own shards (DTensor shards, its pipeline stages, its experts: runtime.expert_parallel) under
the whole model's parameter names, in the split form of runtime.fused; a tensor several ranks hold alike is
written once. DCP reshards on load, so the same files load on another
layout, and into one process (sampling, export: `load_weights` joins the split projections again). A tied
table under pipeline parallelism is saved by both of its holders, as embed.weight by the first stage and
lm_head.weight by the last (equal copies, runtime.pipeline), with each copy's optimizer states.

A checkpoint is written to a hidden temporary directory, every file is fsync'ed, and only then is the
directory renamed into place, so a reader never sees a half-written `step_*` directory. Which
checkpoints a run directory holds (latest, best) is trainwise.rundir's.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainwise import rundir
from trainwise.errors import TrainwiseError
from trainwise.runtime.fused import join_fused, split_fused

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
SHARDED = "dcp"  # the DCP directory of a divided model's checkpoint
FORMAT_VERSION = 1


def dedup_tied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with tied weights stored once (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.shape, tensor.stride()) if tensor.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def load_model_state(model: torch.nn.Module, path: Path) -> None:
    state = load_file(str(path))
    tied = {"lm_head.weight"} if getattr(getattr(model, "cfg", None), "tie_embeddings", False) else set()
    expected = model.state_dict()
    missing = set(expected) - set(state) - tied
    unexpected = set(state) - set(expected)
    wrong_shape = [k for k in set(state) & set(expected) if state[k].shape != expected[k].shape]
    if missing or unexpected or wrong_shape:
        raise TrainwiseError(
            f"weights in '{path}' do not fit this model (missing {sorted(missing)[:3]}, unexpected "
            f"{sorted(unexpected)[:3]}, other shape {sorted(wrong_shape)[:3]}): the checkpoint was made "
            "with a different [model] config. Use the config.toml saved beside it."
        )
    model.load_state_dict(state, strict=False)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                    trainer_state: dict[str, Any], rng_state: dict[str, Any], keep: int) -> Path:
    final, tmp = _begin(run_dir, step, f"-{os.getpid()}")
    try:
        save_file(dedup_tied(model_state), str(tmp / WEIGHTS))
        torch.save(optimizer_state, tmp / "optimizer.pt")
    except (OSError, RuntimeError, SafetensorError) as err:
        _fail(run_dir, final, tmp, err)
    return _finish(run_dir, final, tmp, step, trainer_state, rng_state, keep)


def _begin(run_dir: Path, step: int, suffix: str) -> tuple[Path, Path]:
    root = rundir.checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / rundir.checkpoint_name(step)
    tmp = root / f".tmp-{final.name}{suffix}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return final, tmp


def _finish(run_dir: Path, final: Path, tmp: Path, step: int, trainer_state: dict, rng_state: dict, keep: int) -> Path:
    """Write the trainer and RNG states beside the weights, the manifest of every file, and move the
    directory into place."""
    try:
        torch.save(rng_state, tmp / "rng.pt")
        (tmp / "trainer.json").write_text(json.dumps(trainer_state), encoding="utf-8")
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(path)
            files[str(path.relative_to(tmp))] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
        manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        _fsync(tmp / MANIFEST)
        if final.exists():  # same step saved twice (e.g. the final save right after a periodic one)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(final.parent)
    except (OSError, RuntimeError, SafetensorError) as err:  # ENOSPC, EFBIG, EACCES from any writer
        _fail(run_dir, final, tmp, err)
    rundir.prune_checkpoints(run_dir, keep)
    return final


def _fail(run_dir: Path, final: Path, tmp: Path, err: Exception):
    shutil.rmtree(tmp, ignore_errors=True)
    reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
    raise TrainwiseError(
        f"could not write checkpoint {final}: {reason}. The previous checkpoint is intact; "
        "free disk space or fix the permissions of the run directory, then resume with "
        f"`trainwise train --resume {run_dir}`."
    ) from None


# Optimizer states keyed by parameter name, param-group settings included ("param_groups.<fqn>.lr"), as
# torchtitan saves them: with the default nested form every pipeline rank writes "param_groups.0.params"
# under the same key with its own parameter names, DCP keeps rank 0's, and the other stages load groups
# without their settings (KeyError 'betas' at the next step).
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
    return state


def save_sharded(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 trainer_state: dict[str, Any] | None, rng_state: dict[str, Any] | None, keep: int, barrier) -> Path:
    """A checkpoint of a divided model: every rank calls it (a collective). Rank 0 (the one given
    trainer_state) prepares the directory and finishes it; DCP writes each rank's shards into dcp/."""
    main = trainer_state is not None
    root = rundir.checkpoint_dir(run_dir)
    final, tmp = root / rundir.checkpoint_name(step), root / f".tmp-{rundir.checkpoint_name(step)}-sharded"
    if main:
        final, tmp = _begin(run_dir, step, "-sharded")
    barrier()
    try:
        dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(tmp / SHARDED))
    except (OSError, RuntimeError) as err:
        _fail(run_dir, final, tmp, err)
    barrier()
    if main:
        _finish(run_dir, final, tmp, step, trainer_state, rng_state, keep)
    barrier()
    return final


def is_sharded(path: Path) -> bool:
    return (path / SHARDED).is_dir()


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a divided model's checkpoint into `model` (divided the same way or another: DCP reshards)
    and its optimizer; every rank calls it."""
    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path / SHARDED))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=FLAT_OPTIMIZER)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file against the manifest; raise TrainwiseError on any difference."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError):
        raise TrainwiseError(
            f"checkpoint {path} has no readable manifest; it is damaged. Delete it to resume from the one "
            "before it."
        ) from None
    for name, meta in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != meta["bytes"] or _sha256(file) != meta["sha256"]:
            raise TrainwiseError(
                f"checkpoint file {file} does not match its SHA-256 in {manifest_path} (truncated or "
                f"corrupted). Delete the directory {path} to resume from the checkpoint before it."
            )
    return manifest


@dataclass
class Checkpoint:
    path: Path
    trainer_state: dict[str, Any]
    rng_state: dict[str, Any]
    optimizer_state: dict[str, Any]


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Verify the checkpoint at `path` against its manifest, then load its weights into `model` (a whole
    model in one process; a divided model's checkpoint is gathered from its DCP shards)."""
    verify_checkpoint(path)
    if is_sharded(path):
        split_fused(model)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(path / SHARDED), no_dist=True)
        model.load_state_dict(state["model"])
        join_fused(model)
        return
    load_model_state(model, path / WEIGHTS)


def read_trainer_state(path: Path) -> Checkpoint:
    """The trainer and RNG states of a divided model's checkpoint (its weights and optimizer: load_sharded)."""
    verify_checkpoint(path)
    rng_state = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)
    trainer_state = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    return Checkpoint(path, trainer_state, rng_state, None)


def load_checkpoint(path: Path, model: torch.nn.Module) -> Checkpoint:
    """Verify, then load weights into `model`; return the rest for the trainer to restore."""
    load_weights(model, path)
    try:
        optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        rng_state = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # pickle.UnpicklingError and friends: refuse anything that isn't plain data
        raise TrainwiseError(
            f"refusing to load {path}: it holds objects other than tensors and plain data ({err}). "
            "trainwise never unpickles arbitrary objects; this file was not written by trainwise."
        ) from None
    trainer_state = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    return Checkpoint(path, trainer_state, rng_state, optimizer_state)


def capture_rng() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for trainer.json)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, plain


def restore_rng(tensors: dict, plain: dict | list, rank: int = 0) -> None:
    """Restore this rank's generators (checkpoints hold one entry per rank)."""
    if "ranks" in tensors:
        if rank >= len(tensors["ranks"]):
            raise TrainwiseError(
                f"the checkpoint was saved by {len(tensors['ranks'])} ranks; resume it with the same number "
                "of processes (torchrun --nproc-per-node)."
            )
        tensors, plain = tensors["ranks"][rank], plain[rank]
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["torch_cuda"]))
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
