"""The operator list of one training step, recorded: the trainer's own step (trainwise.runtime.step)
runs on fake tensors (no memory, no compute) under a dispatch mode that records each aten op.

FLOPs from the one FLOP counter's formulas (trainwise.measure.flopcount) for matmuls and attention, one
FLOP per output element for everything else; bytes = tensor inputs read + outputs written (no cache
reuse). Each record keeps its phase (forward, backward incl. recompute, optimizer), its dtype and, for
matmuls and attention, its shape and operand layout, which the time model needs: a skinny matmul runs
far below peak. Each record also keeps the bytes it moves under a fusing stack (Transformer Engine,
torch.compile), where a chain of element-wise ops reads and writes only the tensors that must be in memory
(_Recorder._in_memory); the cluster model prices those for the stacks that fuse. What a record is, and the
pure views of a list, is trainwise.cost.ops.

One micro-batch is recorded; a step of K micro-batches repeats its forward and backward K times. Where a
record is to be priced at other micro-batch sizes (cost.steptime.scale_batch: the planner's GPU steps and
`plan --fit`), the step is recorded once more at twice the micro-batch and the two call sequences, the same
ops in the same order, are laid side by side: what a call moves at B and 2B splits into bytes that grow with
the tokens and bytes that do not (autocast's weight casts, the gradients' casts: weight-sized work), so a
micro-batch of any size is priced exactly (_fixed_bytes). A cast autocast makes of a parameter is recorded
under its own name (cost.ops.WEIGHT_CAST): a stack that gathers its parameters in the compute dtype
(FSDP2's mixed precision) does not run it.
`compiled=True` records the step as torch.compile runs it on a CPU: attention as two matmuls around a
softmax (trainwise.model.transformer.explicit_attention) instead of the SDPA kernel.
"""

from __future__ import annotations

import difflib
import itertools
from collections import OrderedDict, defaultdict
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from trainwise.config import TrainConfig
from trainwise.cost.ops import WEIGHT_CAST, Op, op_class
from trainwise.measure.fake import fake_step_mode
from trainwise.measure.flopcount import flop_counter
from trainwise.runtime.parallelize import use_compiled_attention, use_native_dropout, use_unfused_attention
from trainwise.runtime.precision import DTYPE_NAMES
from trainwise.runtime.step import build_model, build_step

# Ops that move memory but compute nothing: casts (autocast's copies of weights and activations), copies
# and fills. They cost time like any element-wise op (a bf16 step spends ~10% of its time casting), so
# they are in the list, with bytes and no FLOPs.
COPIES = {"_to_copy", "copy_", "clone", "fill_", "zero_", "zeros", "ones", "zeros_like", "ones_like", "full",
          "new_zeros", "new_ones", "new_full"}
# A record's counts: [calls, FLOPs, bytes, fused bytes, fixed bytes, fixed fused bytes] (fixed: _fixed_bytes)
EMPTY = (0, 0.0, 0.0, 0.0, 0.0, 0.0)


VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "split", "split_with_sizes", "slice",
         "select", "detach", "alias", "unsqueeze", "squeeze", "as_strided", "chunk", "unbind", "reshape",
         "lift_fresh", "empty", "empty_like", "new_empty_strided", "new_empty", "_local_scalar_dense", "randint",
         "empty_strided", "normal_", "arange", "device", "sym_size", "sym_stride", "sym_numel", "dim"}


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _layout(t: torch.Tensor) -> str:
    """N: the last dimension is contiguous (row-major); T: a transposed view (a weight's .t())."""
    return "N" if t.dim() < 2 or t.stride(-1) == 1 or t.shape[-1] == 1 else "T"


def _shape(name: str, ins: list[torch.Tensor]) -> tuple[tuple[int, ...] | None, str]:
    """(shape, layout) of an operator call: a matmul's (batch, M, K, N) of mm / addmm / bmm / baddbmm from
    its two matrix operands (the last two) and their layout; an attention kernel's (batch, heads, kv heads,
    T, head dim) from q and k; (None, "") for other ops."""
    cls = op_class(name)
    if cls == "attention" and len(ins) >= 3 and ins[0].dim() == 4:
        q, k = ins[1:3] if "backward" in name else ins[:2]  # the backward's first input is the output's gradient
        return (q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.shape[3]), ""
    floats = [x for x in ins if x.is_floating_point()]
    if cls != "matmul" or len(floats) < 2:
        return None, ""
    a, b = floats[-2], floats[-1]
    layout = _layout(a) + _layout(b)
    if "grouped_mm" in name:
        groups = next((x.numel() for x in ins if not x.is_floating_point()), 1)  # the offsets
        if b.dim() == 3:  # (S, K) rows split over E experts' (K, N) weights
            return (b.shape[0], a.shape[0] // b.shape[0], a.shape[1], b.shape[2]), layout
        # (K, S) x (S, N) split along S into E groups: the experts' weight gradients, (E, K, N)
        return (groups, a.shape[0], a.shape[1] // groups, b.shape[1]), layout + ":split-k"
    if a.dim() == 2 and b.dim() == 2:
        return (1, a.shape[0], a.shape[1], b.shape[1]), layout
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1], a.shape[2], b.shape[2]), layout
    return None, ""


def _tensors(tree, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of an aten call's arguments or result, in order: what torch.utils._pytree.tree_flatten
    finds there, filtered to tensors (an aten op takes and returns tensors, scalars, and tuples, lists and
    dicts of them), without its generic node lookups (a tenth of a record's time)."""
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _tensors(x, found)
    elif isinstance(tree, dict):
        for x in tree.values():
            _tensors(x, found)
    return found


class _Recorder(TorchDispatchMode):
    """Records each aten op's calls, FLOPs and bytes per (name, phase, dtype, shape, layout, bytes per call),
    and which tensors each call read and wrote, to price the step as a fusing stack runs it (records)."""

    def __init__(self):
        super().__init__()
        self.registry = flop_counter().flop_registry
        self.phase = "forward"
        self.ops: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0.0])
        self.calls: list[tuple] = []  # (record key, fusable, [(serial, bytes) read], [(serial, bytes) written])
        # Each tensor seen gets a serial number (a view its base's), held weakly: a reference kept here would
        # change the step (autograd copies a gradient it cannot steal).
        self.serial: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.serials = itertools.count(1)
        self.made: dict[int, tuple[bool, str]] = {}  # serial -> (written by a fusable op, in which phase)
        self.uses: dict[int, set] = defaultdict(set)  # serial -> {(read by a fusable op, in which phase)}
        self.weights: set[int] = set()  # id() of the model's parameters: autocast's casts of them (WEIGHT_CAST)

    def hook(self, phase: str) -> None:  # train_step's hook: called after each phase
        self.phase = {"forward": "backward", "backward": "optimizer"}.get(phase, self.phase)

    def _id(self, t: torch.Tensor) -> int:
        if t not in self.serial:
            self.serial[t] = next(self.serials)
        return self.serial[t]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = str(packet)
        ins = _tensors((args, kwargs), [])
        outs = _tensors(out, [])
        if name.split(".")[-1] in VIEWS:
            for o in outs:
                if ins and o is not ins[0] and o not in self.serial:
                    self.serial[o] = self._id(ins[0])
            return out
        short = name.split(".")[-1]
        if packet in self.registry:
            flops = self.registry[packet](*args, **kwargs, out_val=out)
        elif short in COPIES:
            flops = 0
        else:
            flops = sum(o.numel() for o in outs)
        dtype = next((DTYPE_NAMES.get(x.dtype, "other") for x in ins + outs if x.is_floating_point()), "other")
        if short == "_to_copy" and ins and id(ins[0]) in self.weights:
            name = WEIGHT_CAST
        if short in ("copy_", "fill_", "zero_"):  # in place: the output is the input, written once
            ins, outs = ins[1:], ins[:1]
        nbytes = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
        shape, layout = _shape(name, ins)
        key = (name, self.phase, dtype, shape, layout, nbytes if shape is None else 0)
        rec = self.ops[key]
        rec[0] += 1
        rec[1] += flops
        rec[2] += nbytes
        fusable = op_class(name) not in ("matmul", "attention") and self.phase != "optimizer"
        read = [(self._id(x), _nbytes(x)) for x in ins]
        for t, _ in read:
            self.uses[t].add((fusable, self.phase))
        written = [(self._id(x), _nbytes(x)) for x in outs]
        for t, _ in written:
            self.made[t] = (fusable, self.phase)
        self.calls.append((key, fusable, read, written))
        return out

    def _in_memory(self, t: int) -> bool:
        """A tensor a fusing stack writes to memory: one no fusable op wrote (a parameter, an input, a matmul's
        or attention's result), one a matmul or attention reads, one read in another phase (kept for backward)
        or never read (a gradient, the loss)."""
        fusable, phase = self.made.get(t, (False, ""))
        uses = self.uses.get(t, set())
        return not fusable or not uses or any(not f or p != phase for f, p in uses)

    def per_call(self) -> list[tuple[tuple, float, float]]:
        """(key, bytes, fused bytes) of each call in order: a fusable op's fused bytes are its reads and
        writes of tensors in memory (_in_memory); the rest of its traffic stays inside a fused kernel."""
        return [(key, sum(b for _, b in read + written),
                 sum(b for t, b in read + written if not fusable or self._in_memory(t)))
                for key, fusable, read, written in self.calls]

    def records(self, calls: list[tuple[tuple, float, float]] | None = None) -> dict[tuple, list]:
        """{key: [calls, FLOPs, bytes, fused bytes, 0, 0]} (the fixed bytes: _fixed_bytes), from per_call's
        list where the caller has it already."""
        fused: dict[tuple, float] = defaultdict(float)
        for key, _, nbytes in calls if calls is not None else self.per_call():
            fused[key] += nbytes
        return {key: [*rec, fused[key], 0.0, 0.0] for key, rec in self.ops.items()}


def step_ops(model_cfg, micro_batch: int, seq_len: int, precision: str = "fp32", checkpointing: str = "none",
             grad_accum: int = 1, compiled: bool = False, optimizer: str = "adamw", fixed: bool = False) -> list[Op]:
    """Operators of one training step of the trainwise model (K = grad_accum micro-batches), recorded on
    fake CPU tensors; largest FLOPs first. precision: "fp32" or a bf16/fp16 autocast recipe. fixed: each op's
    bytes that do not grow with the micro-batch found too (_fixed_bytes), for pricing other sizes.

    A deep model whose blocks repeat (every layer after first_dense_layers alike) is recorded at depths
    d+1 and d+2 and extrapolated: ops(L) = ops(d+1) + (L-d-1) x (ops(d+2) - ops(d+1)), exact because a
    block's operators do not depend on its depth (an 80-layer step took 20 s to record whole)."""
    base = model_cfg.first_dense_layers + 1 if model_cfg.is_moe else 1
    if model_cfg.n_layers > base + 1 and (not model_cfg.is_moe or model_cfg.moe_every == 1):
        one, two = (_record(replace(model_cfg, n_layers=n), micro_batch, seq_len, precision, checkpointing,
                            compiled, optimizer, fixed=fixed) for n in (base, base + 1))
        extra = model_cfg.n_layers - base
        recs = {k: [a + extra * (b - a) for a, b in zip(one.get(k, EMPTY), two[k])] for k in two}
    else:
        recs = _record(model_cfg, micro_batch, seq_len, precision, checkpointing, compiled, optimizer, fixed=fixed)
    ops = [op.scaled(grad_accum) if op.phase != "optimizer" else op for op in _ops(recs)]
    return sorted(ops, key=lambda o: -o.flops)


def _record(model_cfg, micro_batch: int, seq_len: int, precision: str, checkpointing: str, compiled: bool,
            optimizer: str, attention: str = "sdpa", fixed: bool = False) -> dict[tuple, list]:
    """{(name, phase, dtype, shape, layout, bytes per call): [calls, FLOPs, bytes, fused bytes, fixed bytes,
    fixed fused bytes]} of one micro-batch's step on fake tensors (bytes per call 0 for matmuls and attention,
    which their shape describes); the fixed bytes with `fixed` (_fixed_bytes), else 0."""
    calls, records = _recorded(model_cfg, micro_batch, seq_len, precision, checkpointing, compiled, optimizer,
                               attention)
    out = {key: list(counts) for key, counts in records.items()}
    if fixed:
        two, _ = _recorded(model_cfg, 2 * micro_batch, seq_len, precision, checkpointing, compiled, optimizer,
                           attention)
        _fixed_bytes(out, calls, two)
    return out


# The last RECORDS_KEPT steps recorded (_recorded): their calls and records, about 1 MB each. A planner
# asks for the same step again where it prices a layout at another micro-batch (the record at 2B for the fixed
# bytes, after one without) or a record reaches it by another way (plan, report, a second plan in a process).
RECORDS_KEPT = 64
_RECORDED: OrderedDict[str, tuple[list, dict]] = OrderedDict()


def _recorded(*args) -> tuple[list[tuple[tuple, float, float]], dict[tuple, list]]:
    """(_Recorder.per_call, _Recorder.records) of _run(*args), remembered: a step on fake tensors is
    recorded once per process, whatever asks (the caller copies the records before it adds to them)."""
    key = repr(args)
    if key in _RECORDED:
        _RECORDED.move_to_end(key)
        return _RECORDED[key]
    rec = _run(*args)
    calls = rec.per_call()
    _RECORDED[key] = calls, rec.records(calls)
    while len(_RECORDED) > RECORDS_KEPT:
        _RECORDED.popitem(last=False)
    return _RECORDED[key]


def _fixed_bytes(records: dict[tuple, list], a: list[tuple[tuple, float, float]], b: list[tuple[tuple, float, float]]
                 ) -> None:
    """Adds to `records` (of micro-batch B, whose calls are `a`: _Recorder.per_call) each op's bytes that do not
    grow with the micro-batch, from the same step's calls at 2B (`b`): the two runs call the same ops in the
    same order, and a call that moves b1 bytes at B and b2 at 2B moves 2 b1 - b2 whatever the batch (a weight
    cast: b1; an activation's op: 0).
    The sequences are lined up by op (name, phase, dtype): a call only one of them makes (the labels' copy,
    which a one-sequence batch does not need) has no fixed bytes."""
    match = difflib.SequenceMatcher(None, [x[0][:3] for x in a], [y[0][:3] for y in b], autojunk=False)
    for i, j, n in match.get_matching_blocks():
        for (key, b1, f1), (_, b2, f2) in zip(a[i:i + n], b[j:j + n]):
            records[key][4] += max(0.0, 2 * b1 - b2)
            records[key][5] += max(0.0, 2 * f1 - f2)


def _run(model_cfg, micro_batch: int, seq_len: int, precision: str, checkpointing: str, compiled: bool,
         optimizer: str, attention: str = "sdpa") -> _Recorder:
    """The recorder after one micro-batch's step on fake tensors (_record).
    attention: "sdpa" (as this machine's SDPA runs it), "flash" (a GPU's flash kernel, attention dropout
    inside it) or "unfused" (runtime.parallelize.use_unfused_attention). precision "bf16-pure" / "fp16-pure":
    the weights themselves in 16 bits, activations and residual stream too, no autocast (Megatron-LM's
    mixed precision, whose fp32 master copy lives in the optimizer)."""
    pure = {"bf16-pure": torch.bfloat16, "fp16-pure": torch.float16}.get(precision)
    precision = {"amp": "bf16", "bf16": "bf16", "fp16": "fp16"}.get(precision, "fp32")
    if model_cfg.is_moe and not model_cfg.dropless:
        # Capacity-limited routing cuts the groups with data-dependent shapes, which fake tensors cannot
        # follow; under the uniform routing recorded here no expert exceeds its capacity (>= N k / E), so
        # the dropless step runs the same expert work.
        model_cfg = replace(model_cfg, dropless=True)
    rec = _Recorder()
    train = TrainConfig(optimizer="sgd" if optimizer.startswith("sgd") else "adamw",
                        momentum=0.9 if optimizer == "sgd-momentum" else 0.0, activation_checkpointing=checkpointing)
    with fake_step_mode():
        default = torch.get_default_dtype()
        torch.set_default_dtype(pure or default)  # built in 16 bits (a fake tensor cannot be converted in place)
        try:
            model = build_model(model_cfg)
        finally:
            torch.set_default_dtype(default)
        if compiled:  # what a compiled CPU step runs instead of SDPA (the rest is the eager step's operators)
            use_compiled_attention(model, only_when_compiling=False)
        elif attention == "unfused":
            use_unfused_attention(model)
        elif attention == "flash":  # a GPU's flash kernel applies attention dropout inside; the CPU's has none
            for block in model.blocks:
                block.attn.dropout = 0.0
                # and takes windows and sinks (cuDNN's, FlashAttention's): recorded as causal flash attention
                # over the whole sequence, a sliding-window layer's work overcounted, the sink logits' left out
                block.attn.plain_causal = True
        if attention != "sdpa":  # a GPU step: CUDA's fused dropout kernel
            use_native_dropout(model)
        step = build_step(model, train, torch.device("cpu"), precision)
        rec.weights = {id(p) for p in model.parameters()}
        ids = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq_len + 1))
        with rec:
            step([(ids[:, :-1], ids[:, 1:])], hook=rec.hook)
    return rec


def param_tensors(model_cfg) -> int:
    """Parameter tensors of the built model (the optimizer's per-tensor cost), counted on the meta device."""
    return len(param_numels(model_cfg))


def param_numels(model_cfg) -> list[int]:
    """Elements of each parameter tensor of the built model, in its order (DDP's buckets, cost.comm.ddp_buckets),
    on the meta device."""
    return [p.numel() for p in build_model(model_cfg, "meta").parameters()]


def block_ops(model_cfg, micro_batch: int, seq_len: int, precision: str = "fp32", checkpointing: str = "none",
              optimizer: str = "adamw", attention: str = "flash", fixed: bool = True) -> dict[str, list[Op]]:
    """One micro-batch's operators split where a pipeline splits them: "layer" (one dense block), "moe_layer"
    (one MoE block, MoE models only) and "ends" (embedding, final norm, LM head and loss), each with the
    optimizer update of its own parameters (one op, "optimizer"). Recorded at depths 1 and 2 (and one MoE
    block) and differenced: a block's operators do not depend on its depth (see step_ops); with `fixed`, each op's
    fixed bytes found too (_fixed_bytes: the planner prices these records at other micro-batch sizes)."""
    dense = model_cfg
    if model_cfg.is_moe:
        dense = replace(model_cfg, n_experts=0, top_k=0, n_shared_experts=0, first_dense_layers=0, router_bias=False)
    one, two = (_record(replace(dense, n_layers=n), micro_batch, seq_len, precision, checkpointing, False, optimizer,
                        attention, fixed=fixed and n == 2) for n in (1, 2))
    for key, counts in one.items():  # depth 1's fixed bytes per call are depth 2's: its calls are among them
        if fixed and key in two and two[key][0]:
            counts[4:] = [two[key][4] / two[key][0] * counts[0], two[key][5] / two[key][0] * counts[0]]
    one, two = _optimizer_as_one(one), _optimizer_as_one(two)
    layer = _minus(two, one)
    out = {"layer": _ops(layer), "ends": _ops(_minus(one, layer))}
    if model_cfg.is_moe:
        moe = _optimizer_as_one(_record(replace(model_cfg, n_layers=1, first_dense_layers=0, moe_every=1), micro_batch,
                                        seq_len, precision, checkpointing, False, optimizer, attention, fixed=fixed))
        out["moe_layer"] = _ops(_minus(moe, _minus(one, layer)))
    return out


def _optimizer_as_one(rec: dict[tuple, list]) -> dict[tuple, list]:
    """The optimizer phase's ops summed into one record (its foreach ops take every parameter at once,
    so their per-call sizes change with depth and would not difference)."""
    out, total = {}, list(EMPTY)
    for key, counts in rec.items():
        if key[1] == "optimizer":
            total = [1, *(a + b for a, b in zip(total[1:], counts[1:]))]
        else:
            out[key] = counts
    if total[0]:
        out[("optimizer", "optimizer", "fp32", None, "", 0)] = total
    return out


def _minus(a: dict[tuple, list], b: dict[tuple, list]) -> dict[tuple, list]:
    out = {}
    for key in [*a, *(k for k in b if k not in a)]:  # in the records' order: a set's order moves with the hash seed
        x, y = a.get(key, EMPTY), b.get(key, EMPTY)
        diff = [x[0] - y[0] if key[1] != "optimizer" else 1, *(u - v for u, v in zip(x[1:], y[1:]))]
        if diff[1] or diff[2] or (diff[0] and key[1] != "optimizer"):
            out[key] = diff
    return out


def _ops(rec: dict[tuple, list]) -> list[Op]:
    return sorted((Op(n, op_class(n), ph, dt, shape, int(c), f, b, layout, fused=fb, fixed=fx, fused_fixed=ffx)
                   for (n, ph, dt, shape, layout, _), (c, f, b, fb, fx, ffx) in rec.items() if c > 0 and (f or b)),
                  key=lambda o: -o.flops)
