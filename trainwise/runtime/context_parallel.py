"""Context parallelism (parallel.cp): each sequence divided over cp ranks, attention over keys and values
all-gathered from them (Llama 3's context parallelism, Dubey et al. 2024, section 3.3.2; the all-gather form
of Megatron-Core's cp_comm_type and of PyTorch's context_parallel). Shapes: B batch, T the sequence's
positions, T/cp a rank's, nh query heads, nkv key/value heads, hd head dimension.

    chunks      the sequence cut into 2 cp chunks of T / 2cp; cp rank r holds chunks r and 2cp - 1 - r, in that
                order (head-tail load balancing, torch's _HeadTailLoadBalancer): under the causal mask every
                rank's queries then see as many keys, so the ranks do the same attention work
    tokens      each micro-batch's token ids and targets cut to the rank's T/cp positions before the model
                runs (a pre-hook on the Transformer's forward); everything in a block but attention's core is
                per token and runs on those positions alone
    positions   RoPE turns each query and key by its position in the sequence, and learned position
                embeddings are looked up there (pre-hooks on the blocks and on pos_embed)
    attention   each layer's k and v of the rank's positions, (B, 2 nkv, T/cp, hd) together, all-gathered over
                the cp group along the positions: (B, 2 nkv, T, hd), every rank's in rank order; the rank's
                queries attend to the keys at or before their own positions (SDPA with a boolean (T/cp, T)
                mask). The gather is autograd's (a functional collective): backward reduce-scatters the keys'
                and values' gradients to the ranks that computed them
    loss        the rank's tokens' mean cross-entropy; the forward returns the mean over the whole sequence
                (one fp32 scalar all-reduced over cp: every rank holds T/cp of the targets, so the mean of
                the ranks' means is the sequence's), with the gradient of the rank's own mean

Gradients. The cp ranks of a replica hold the same parameters, so they join the data-parallel reduction, as in
torchtitan: the job's data-parallel group is dp x cp ranks (runtime.distributed.wrap over the world when tp and
pp are 1, otherwise over the mesh's dp and cp dimensions flattened). A rank's backward yields the gradient of
its own loss, the reduce-scattered key and value gradients carrying the other ranks' losses into its parameters;
summed over the cp ranks that is the gradient of the sum of their means, cp times the sequence's, so the mean
over the dp x cp ranks is one process's gradient.

Applied from outside to a built model (runtime.step), before tensor parallelism (whose sequence parallelism then
divides the rank's T/cp positions by tp), activation checkpointing and sharding: the model does not know its
sequence is divided, and its state dict stays the same. A model with context parallelism applied trains and
evaluates (model(x, y)); it does not generate (the trainer samples from the checkpoint's weights in one
process).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from trainwise.cost.layout import Layout
from trainwise.errors import TrainwiseError

try:
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
except ImportError:  # older torch: the same indices, below
    _HeadTailLoadBalancer = None

_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def sequence_order(seq_len: int, cp: int) -> torch.Tensor:
    """(T,) int64: the positions of the sequence in cp rank order, rank r's T/cp at [r T/cp, (r + 1) T/cp):
    chunk r then chunk 2cp - 1 - r of the 2cp chunks (head-tail), by torch's load balancer where it has one."""
    if _HeadTailLoadBalancer is None:
        return head_tail_order(seq_len, cp)
    return _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0].long()


def head_tail_order(seq_len: int, cp: int) -> torch.Tensor:
    """sequence_order without torch's load balancer."""
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    heads = torch.arange(cp)
    return torch.stack([chunks[heads], chunks[2 * cp - 1 - heads]], dim=1).reshape(-1)


def rank_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """(T/cp,) int64: the positions cp rank `cp_rank` holds of a sequence of seq_len."""
    return sequence_order(seq_len, cp).view(cp, -1)[cp_rank]


def cp_ranks(layout: Layout, rank: int) -> list[int]:
    """The global ranks of `rank`'s cp group, in cp order: cp ranks tp apart (ranks ordered tp, cp, dp, pp)."""
    inner = rank % layout.tp + rank // (layout.tp * layout.cp) * layout.tp * layout.cp
    return [inner + j * layout.tp for j in range(layout.cp)]


def build_cp_group(layout: Layout) -> dist.ProcessGroup:
    """This rank's cp process group; every rank calls it (each group is created by all ranks, in order)."""
    mine = None
    for first in range(layout.gpus):
        ranks = cp_ranks(layout, first)
        if ranks[0] != first:
            continue
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


class ContextParallel:
    """The sequence split of one model over a cp group: the positions, masks and RoPE rows of each sequence
    length, made once and kept (a few kilobytes)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup):
        self.model, self.group = model, group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._cache: dict = {}

    def _cached(self, key: tuple, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(T/cp,) this rank's positions of a sequence of seq_len."""
        if seq_len % (2 * self.cp):
            raise TrainwiseError(
                f"a sequence of {seq_len} tokens cannot be divided over parallel.cp = {self.cp} ranks: context "
                f"parallelism cuts it into 2 x cp = {2 * self.cp} equal chunks; use a length that is a multiple "
                f"of {2 * self.cp}.")
        return self._cached(("positions", seq_len, device),
                            lambda: rank_positions(seq_len, self.cp, self.rank).to(device))

    def mask(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(T/cp, T) bool: True where this rank's query may see the gathered key (key position <= its own)."""
        def make():
            keys = sequence_order(seq_len, self.cp).to(device)
            return keys[None, :] <= self.positions(seq_len, device)[:, None]

        return self._cached(("mask", seq_len, device), make)

    def rope(self, tables: tuple[torch.Tensor, torch.Tensor], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE half tables' rows (T/cp, hd/2) at this rank's positions."""
        cos, sin = tables
        key = ("rope", seq_len, cos.device, cos.dtype, cos.data_ptr())
        return self._cached(key, lambda: tuple(t[self.positions(seq_len, t.device)] for t in tables))

    def shard(self, module: nn.Module, args: tuple, kwargs: dict):
        """Transformer forward pre-hook: token ids and targets (B, T) -> the rank's (B, T/cp)."""
        idx, *rest = args
        pos = self.positions(idx.shape[1], idx.device)
        args = (idx[:, pos], *(t[:, pos] if torch.is_tensor(t) else t for t in rest))
        if torch.is_tensor(kwargs.get("targets")):
            kwargs = {**kwargs, "targets": kwargs["targets"][:, pos]}
        return args, kwargs

    def sequence_loss(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        """Transformer forward hook: a loss (a scalar) becomes the sequence's mean in value, the rank's mean in
        gradient; logits (the rank's positions) pass unchanged."""
        if out.ndim:
            return out
        total = out.detach().float().clone()
        dist.all_reduce(total, group=self.group)
        return out + (total / self.cp - out.detach()).to(out.dtype)

    def block_rope(self, module: nn.Module, args: tuple):
        """Block forward pre-hook: the RoPE rows the Transformer sliced for positions 0..T/cp-1 replaced by the
        rows of the rank's positions."""
        x, rope, *rest = args
        if rope is None:
            return None
        tables = (self.model.rope_cos, self.model.rope_sin)  # (max_seq_len, hd/2) each
        return (x, self.rope(tables, self.cp * rope[0].shape[0]), *rest)

    def learned_positions(self, module: nn.Module, args: tuple):
        """pos_embed forward pre-hook: the positions 0..T/cp-1 the Transformer looks up -> the rank's."""
        (local,) = args
        return (self.positions(self.cp * local.shape[0], local.device) + local[:1],)

    def core(self, attn: nn.Module):
        """attn.core over keys and values gathered from the cp group (module docstring)."""

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
            kv = _gather(torch.cat([k, v], dim=1), 2, self.group)  # (B, 2 nkv, T, hd)
            k, v = kv.chunk(2, dim=1)
            mask = self.mask(kv.shape[2], q.device)  # (T/cp, T)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  dropout_p=attn.dropout if attn.training else 0.0,
                                                  enable_gqa=k.shape[1] != q.shape[1])

        return core


def apply_cp(model: nn.Module, group: dist.ProcessGroup) -> ContextParallel:
    """Divide `model`'s sequences over the cp `group` (module docstring), in place: hooks on the Transformer,
    its blocks and learned positions, and each attention's core replaced. Multi-head attention (GQA, MQA)
    without windows or sinks (runtime.mesh.check_layout refuses the others)."""
    cp = ContextParallel(model, group)
    model.register_forward_pre_hook(cp.shard, with_kwargs=True)
    model.register_forward_hook(cp.sequence_loss, with_kwargs=True)
    if getattr(model, "pos_embed", None) is not None:
        model.pos_embed.register_forward_pre_hook(cp.learned_positions)
    for block in model.blocks:
        block.register_forward_pre_hook(cp.block_rope)
        block.attn.core = cp.core(block.attn)
    return cp
