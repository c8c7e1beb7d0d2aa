"""What one rank sends in a step, counted as it runs: every collective and point-to-point transfer issued
through PyTorch's communication ops, by type, with its calls and bytes sent.

Everything distributed in PyTorch reaches the process group through the dispatcher: DTensor's
redistributions as functional collectives (_c10d_functional), FSDP2's all-gathers and reduce-scatters,
pipelining's sends and receives and torch.distributed's calls as c10d ops. A TorchDispatchMode (the
mechanism of PyTorch's own CommDebugMode) sees each of them with its tensors and its group, so the
counter needs no change to the code it watches. DDP's bucket all-reduces are issued by its C++ reducer
and are seen through the comm hook runtime.distributed installs (torch's default all-reduce hook).

Bytes are what the rank sends, as the ring algorithms move them (trainwise.cost.comm.bytes_sent, the
function the plan uses, of the collective's buffer S, rounded to whole bytes): an all-reduce of S bytes
over w ranks sends 2 (w - 1)/w S, an all-gather (w - 1)/w of its gathered output, a reduce-scatter
(w - 1)/w of its input, an all-to-all what leaves the rank (its input but the rows it keeps: (w - 1)/w S when
the splits are even, as the expert-parallel dispatch's are not), a send its tensor (a receive counts a call and
no bytes). A broadcast counts its calls only (its bytes depend on the root).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from trainwise.cost.comm import bytes_sent

_f = torch.ops._c10d_functional
_c = torch.ops.c10d


def _nbytes(tensors) -> int:
    if torch.is_tensor(tensors):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _group(group) -> ProcessGroup:
    if isinstance(group, str):
        return _resolve_process_group(group)
    return group if isinstance(group, ProcessGroup) else ProcessGroup.unbox(group)


def _group_size(group) -> int:
    return _group(group).size()


def _leaving(tensor: torch.Tensor, input_splits, group) -> int:
    """Bytes of an all-to-all's input that leave the rank: all but its own split (even splits when none given)."""
    g = _group(group)
    rows, size = tensor.shape[0] if tensor.ndim else 1, g.size()
    splits = list(input_splits) if input_splits else [rows // size] * size
    return _nbytes(tensor) - (splits[g.rank()] * _nbytes(tensor) // rows if rows else 0)


def _record(func, args, kwargs, out) -> tuple[str, int, int] | None:
    """(type, buffer bytes S, group size) of a communication op, None for any other op: the whole buffer
    for all_reduce / broadcast / send, the gathered output of an all_gather, the input of a reduce_scatter
    (cost.comm.bytes_sent's S); for an all_to_all the bytes that leave the rank (_leaving)."""
    op = func._overloadpacket
    a = list(args) + list(kwargs.values())
    if op in (_f.all_reduce, _f.all_reduce_coalesced):
        return "all_reduce", _nbytes(a[0]), _group_size(a[2])
    if op in (_f.all_gather_into_tensor, _f.all_gather_into_tensor_coalesced):
        return "all_gather", _nbytes(a[0]) * a[1], a[1]
    if op in (_f.reduce_scatter_tensor, _f.reduce_scatter_tensor_coalesced):
        return "reduce_scatter", _nbytes(a[0]), a[2]
    if op is _f.all_to_all_single:
        return "all_to_all", _leaving(a[0], a[2], a[3]), _group_size(a[3])
    if op is _f.broadcast:
        return "broadcast", _nbytes(a[0]), _group_size(a[2])
    if op in (_c.allreduce_, _c.allreduce_coalesced_):
        return "all_reduce", _nbytes(a[0]), _group_size(a[1])
    if op in (_c._allgather_base_, _c.allgather_into_tensor_coalesced_):
        return "all_gather", _nbytes(a[0]), _group_size(a[2])
    if op is _c.allgather_:
        return "all_gather", _nbytes(a[1]) * _group_size(a[2]), _group_size(a[2])
    if op in (_c._reduce_scatter_base_, _c.reduce_scatter_tensor_coalesced_):
        return "reduce_scatter", _nbytes(a[1]), _group_size(a[2])
    if op is _c.alltoall_base_:
        return "all_to_all", _leaving(a[1], a[4], a[2]), _group_size(a[2])
    if op is _c.broadcast_:
        return "broadcast", _nbytes(a[0]), _group_size(a[1])
    if op is _c.send:
        return "send", _nbytes(a[0]), 2
    if op in (_c.recv_, _c.recv_any_source_):
        return "recv", _nbytes(a[0]), 2
    return None


class CommCounter(TorchDispatchMode):
    """with CommCounter() as c: ...   c.counts -> {type: {"calls": int, "bytes": int}} (bytes sent).
    Types: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send_recv (verify.json's
    "comm" keys; sends and receives together: calls of both, bytes of the sends)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """A compiled graph runs compiled under the counter (the default would run it eager, op by op): the
        counter sees the collectives the graph's code issues through the dispatcher, not its fused ops."""
        return True

    def __init__(self):
        super().__init__()
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor turns the op into local ops and collectives, which come back here
        out = func(*args, **kwargs)
        seen = _record(func, args, kwargs, out)
        if seen is not None:
            kind, nbytes, world = seen
            key = "send_recv" if kind in ("send", "recv") else kind
            self.counts[key]["calls"] += 1
            if kind == "all_to_all":
                self.counts[key]["bytes"] += nbytes
            elif kind not in ("recv", "broadcast"):
                self.counts[key]["bytes"] += round(bytes_sent(key, nbytes, world))
        return out

    def result(self) -> dict[str, dict[str, int]]:
        return {kind: dict(v) for kind, v in sorted(self.counts.items())}
