"""Batches of token windows for training and evaluation: random windows of one token stream, or of
several in proportion to their weights (a mixture).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trainwise.errors import TrainwiseError


class Mixture:
    """Token streams sampled in proportion to weights (one per [[data.sources]] entry)."""

    def __init__(self, streams: list[np.ndarray], weights: list[float], names: list[str]):
        self.streams, self.names = streams, names
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))

    def __len__(self) -> int:
        return sum(len(s) for s in self.streams)


class BatchSampler:
    """Random windows of seq_len + 1 tokens (nanoGPT's get_batch), reproducible and resumable.

    Each call draws the offsets of a whole global batch (micro_batch * world_size windows) from one
    PCG64 generator seeded with `seed`, and keeps rank's slice of them. So all ranks draw the same
    numbers, use disjoint parts of every global batch, and one process with micro_batch * world_size
    sees exactly what the world_size processes see together.
    """

    def __init__(self, tokens: np.ndarray | Mixture, micro_batch: int, seq_len: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        if micro_batch < 1 or seq_len < 1:
            raise TrainwiseError(f"micro_batch = {micro_batch} and seq_len = {seq_len} must be positive.")
        if not 0 <= rank < world_size:
            raise TrainwiseError(f"rank = {rank} must be in [0, world_size = {world_size}).")
        streams = tokens.streams if isinstance(tokens, Mixture) else [tokens]
        if min(len(s) for s in streams) < seq_len + 1:
            raise TrainwiseError(
                f"the token split has {min(len(s) for s in streams)} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1} needed for one sequence; use a smaller train.seq_len or more text."
            )
        self.tokens = tokens
        self.micro_batch = micro_batch
        self.seq_len = seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches_drawn = 0
        self.source_tokens = np.zeros(len(streams), dtype=np.int64)  # tokens drawn per source, whole batches

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: int64 tensors of shape (micro_batch, seq_len); y[i, t] = x[i, t + 1] in the stream."""
        n = self.micro_batch * self.world_size
        if isinstance(self.tokens, Mixture):  # a source per window, in proportion to the weights
            streams = self.tokens.streams
            which = self.rng.choice(len(streams), size=n, p=self.tokens.weights)
            starts = self.rng.random(size=n)
            offsets = [int(u * (len(streams[w]) - self.seq_len)) for u, w in zip(starts, which)]
            self.source_tokens += np.bincount(which, minlength=len(streams)) * self.seq_len
        else:  # the last valid offset is len - seq_len - 1, so that y's window ends inside the tokens
            streams, which = [self.tokens], np.zeros(n, dtype=np.int64)
            offsets = self.rng.integers(0, len(self.tokens) - self.seq_len, size=n)
            self.source_tokens += n * self.seq_len
        self.batches_drawn += 1
        mine = range(self.rank * self.micro_batch, (self.rank + 1) * self.micro_batch)
        windows = np.stack([streams[which[i]][offsets[i]:offsets[i] + self.seq_len + 1] for i in mine]
                           ).astype(np.int64)  # (B, T+1)
        x = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
        y = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
        return x, y

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable: the generator state plus what must match on restore."""
        return {
            "rng": self.rng.bit_generator.state,
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.micro_batch * self.world_size,
            "source_tokens": self.source_tokens.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seq_len"] != self.seq_len or state["global_batch"] != self.micro_batch * self.world_size:
            raise TrainwiseError(
                f"the saved data sampler drew batches of {state['global_batch']} x {state['seq_len']} tokens "
                f"but this run draws {self.micro_batch * self.world_size} x {self.seq_len}; resume with the "
                "same train.seq_len and micro_batch x number of processes."
            )
        self.rng.bit_generator.state = state["rng"]
        self.batches_drawn = state["batches_drawn"]
        if "source_tokens" in state:
            self.source_tokens = np.asarray(state["source_tokens"], dtype=np.int64)

    def source_counts(self) -> dict[str, int] | None:
        """{source name: tokens drawn so far (all ranks)} for a mixture, else None."""
        if not isinstance(self.tokens, Mixture):
            return None
        return dict(zip(self.tokens.names, self.source_tokens.tolist()))
