"""Points (N, D, L) for the scaling-law fit, read from finished run directories.

N is the run's non-embedding parameter count from the planner (cost/params.py: total minus the token
table wte and a learned position table; Kaplan et al. 2020's convention). Small models spend a large
share of their parameters on the embedding, and that share does not buy loss the way the blocks do;
Kaplan et al. found that the law is a clean power law in non-embedding N. (Hoffmann et al. counted all
parameters, on models where the embedding is a rounding error.) For MoE runs N is the active count.

D is the tokens seen at each validation row of metrics.jsonl, L its val_loss. Which rows count depends
on the learning-rate schedule: under a constant LR (after warmup) the first D tokens of a long run ARE
a run of D tokens (same seed, same batches, same updates), so every row is the final loss of a shorter
run. Under a decaying schedule (cosine to min_lr < lr) an intermediate row is not: a run of that length
would have annealed its LR and reached a lower loss. Those runs contribute their final row only.

Rows past REPEAT_EPOCHS passes over the corpus's training split are left out: the law has no term for
repeated tokens, and Muennighoff et al. 2023 ("Scaling Data-Constrained Language Models") found up to
~4 epochs nearly as good as unique data, fast-diminishing returns after, and small models overfitting.
On the built-in corpus (106k training tokens) a constant-LR d_model-64 run reached its lowest validation
loss at 12 passes and was 11% worse at 27: a law fitted on such rows would describe memorisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainwise import rundir
from trainwise.config import RunConfig, load_config
from trainwise.cost.params import params as count_params
from trainwise.data.corpus import prepare_data
from trainwise.errors import TrainwiseError
from trainwise.scale.store import fit_key
from trainwise.tokenizer import Tokenizer

# Curve rows before this fraction of the run's tokens are left out: the very first steps are the
# transient from a random model (loss ~ ln V), which no power law in D describes.
MIN_CURVE_FRACTION = 0.1
REPEAT_EPOCHS = 4  # passes over the corpus's training tokens up to which rows are fitted and plans trusted


def non_embedding_params(cfg: RunConfig) -> int:
    """N of the law: the planner's non-embedding count (active parameters for MoE)."""
    c = count_params(cfg.model)
    return c.non_embedding - (c.total - c.active)


def constant_lr(cfg: RunConfig) -> bool:
    """True when the schedule holds lr after warmup (min_lr == lr), so a prefix of the run is a shorter run."""
    return cfg.train.min_lr >= cfg.train.lr


@dataclass
class RunPoints:
    run_dir: Path
    config: RunConfig
    n_params: int
    tokens: np.ndarray  # D at each used row
    losses: np.ndarray  # val_loss at each used row, nats/token
    schedule: str  # "constant" or "decaying"
    used: str  # what was taken and why
    unique_tokens: int  # the corpus's training split, in the run's tokenizer
    past_passes: int = 0  # rows left out: past REPEAT_EPOCHS passes over it

    def array(self) -> np.ndarray:
        """(P, 3) rows of (N, D, L)."""
        return np.stack([np.full(len(self.tokens), float(self.n_params)), self.tokens, self.losses], axis=1)


def val_rows(run_dir: Path) -> list[dict]:
    path = run_dir / rundir.METRICS
    if not path.is_file():
        raise TrainwiseError(f"'{run_dir}' has no metrics.jsonl: pass run directories written by `trainwise train`.")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            break  # a torn last line of a killed run
        if "val_loss" in row:
            rows.append(row)
    return rows


def read_run(run_dir: str | Path, points: str = "auto") -> RunPoints:
    """The fit's points of one run. points: "auto" (every row past MIN_CURVE_FRACTION under a constant
    LR, else the final row), "final" (the final row only) or "all" (every row past MIN_CURVE_FRACTION,
    whatever the schedule: the user says they know what the rows mean). Under each, rows past
    REPEAT_EPOCHS passes over the corpus are left out (a run may be left with none)."""
    run_dir = Path(run_dir)
    if not (run_dir / rundir.CONFIG).is_file():
        raise TrainwiseError(f"'{run_dir}' is not a trainwise run directory (no config.toml).")
    cfg = load_config(run_dir / rundir.CONFIG)
    rows = val_rows(run_dir)
    if not rows:
        raise TrainwiseError(f"run '{run_dir}' logged no validation loss; train with train.eval_every > 0.")
    final_tokens = cfg.train.max_steps * cfg.train.tokens_per_step
    if rows[-1]["step"] < cfg.train.max_steps:
        raise TrainwiseError(
            f"run '{run_dir}' stopped at step {rows[-1]['step']} of {cfg.train.max_steps}: its last loss is not "
            f"the final loss of the planned run. Finish it (`trainwise train --resume {run_dir}`) or leave it out.")
    schedule = "constant" if constant_lr(cfg) else "decaying"
    curve = points == "all" or (points == "auto" and schedule == "constant")
    if curve:
        first = max(MIN_CURVE_FRACTION * final_tokens, cfg.train.warmup_steps * cfg.train.tokens_per_step)
        rows = [r for r in rows if r["tokens"] >= first] or rows[-1:]
        used = f"{len(rows)} validation rows from {rows[0]['tokens']:,} tokens on ({schedule} LR)"
    else:
        rows = rows[-1:]
        used = ("final row (the LR decays: earlier rows are not losses of shorter runs)"
                if schedule == "decaying" and points == "auto" else "final row")

    unique = train_tokens(cfg, Tokenizer.load(run_dir / rundir.TOKENIZER))
    kept = [r for r in rows if r["tokens"] <= REPEAT_EPOCHS * unique]
    if len(kept) < len(rows):
        used += (f"; {len(rows) - len(kept)} of them left out: past {REPEAT_EPOCHS} passes over the corpus's "
                 f"{unique:,} training tokens (repeated tokens are worth less than new ones)")
    return RunPoints(run_dir, cfg, non_embedding_params(cfg), np.array([float(r["tokens"]) for r in kept]),
                     np.array([float(r["val_loss"]) for r in kept]), schedule, used, unique, len(rows) - len(kept))


def train_tokens(cfg: RunConfig, tokenizer) -> int:
    """Tokens in the training split of cfg's corpus with `tokenizer` (the token cache, as a run builds it)."""
    return int(len(prepare_data(cfg.data, tokenizer, cfg.train.seq_len).train))


def read_runs(run_dirs: list[str | Path], points: str = "auto") -> list[RunPoints]:
    runs = [read_run(d, points) for d in run_dirs]
    keys = {corpus_of(r.config, r.run_dir) for r in runs}
    if len(keys) > 1:
        raise TrainwiseError(
            "the runs were trained on different corpora or tokenizers, and a loss in nats per token is only "
            "comparable on the same text with the same tokenizer: fit each corpus + tokenizer separately.")
    return runs


def corpus_of(cfg: RunConfig, run_dir: Path) -> str:
    return fit_key(cfg.data, Tokenizer.load(run_dir / rundir.TOKENIZER))
