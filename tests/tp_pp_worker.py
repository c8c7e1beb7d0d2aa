"""Run by tests/test_tp_pp.py under torchrun (gloo, one thread per rank): tensor-, pipeline-, expert- and
context-parallel layouts built by trainwise's one step builder, each trained STEPS steps on seeded batches, with
a DCP checkpoint at step SAVE_AT resumed into a fresh model for the steps after it, and every rank's states, peak
and messages of the MEASURED steps before it measured as the trainer measures its last step. After every case,
the ranks share out the one-process runs on the same global batch (dp x K micro-batches a step, same seed).

    python -m torch.distributed.run --nproc-per-node N tests/tp_pp_worker.py OUT CASE [CASE ...]

Each rank writes OUT/CASE.rankR.json (the test compares it with one process and with the plan). With tied
embeddings each pipeline end also records a digest of its copy of the table after the straight run and after
the resumed one, and rank 0 the loss one process computes from the checkpoint's weights. Under expert
parallelism each rank also records the assignments it routed to each expert in its measured step (the plan's
all-to-alls are evaluated at them).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from trainwise import rundir
from trainwise.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from trainwise.cost.run import Run
from trainwise.measure.memtrack import StepPeakMeter, foreign_storages
from trainwise.runtime import checkpoint as ckpt
from trainwise.runtime import distributed
from trainwise.runtime.comms import CommCounter
from trainwise.runtime.expert_parallel import routed_tokens
from trainwise.runtime.fused import split_fused
from trainwise.runtime.mesh import layout_for
from trainwise.runtime.step import build_model, build_step

STEPS, SAVE_AT = 6, 4
MEASURED = 3  # steady-state steps whose peak is read (the least taken: see train)
TINY = dict(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
MOE = dict(n_experts=4, top_k=2, n_shared_experts=1, router_bias=True, first_dense_layers=1)
CASES = {  # name: (model, parallel, micro_batch, grad_accum)
    "tp": (dict(), dict(tp=2), 2, 2),
    "pp_1f1b": (dict(tie_embeddings=False), dict(pp=2), 1, 4),
    "pp_interleaved": (dict(tie_embeddings=False, n_layers=4), dict(pp=2, pp_schedule="interleaved", vpp=2), 1, 4),
    "pp_gpipe": (dict(tie_embeddings=False), dict(pp=2, pp_schedule="gpipe"), 1, 3),
    "pp_tied": (dict(), dict(pp=2), 1, 3),
    "moe_tp": (MOE, dict(tp=2), 2, 1),
    "fsdp_tp": (dict(), dict(tp=2, strategy="fsdp"), 1, 2),
    "pp_tp": (dict(tie_embeddings=False), dict(pp=2, tp=2), 1, 2),
    "moe_pp": ({**MOE, "n_layers": 3}, dict(pp=2), 1, 4),  # stage 0: a dense and a MoE layer; stage 1: a MoE
    "pp_dp": (dict(), dict(pp=2, strategy="ddp"), 1, 3),
    "pp_fsdp": (dict(n_layers=4), dict(pp=2, strategy="fsdp"), 2, 4),  # pp 2 x dp 2, two blocks a stage
    "tp_dp_bf16": (dict(), dict(tp=2, strategy="ddp"), 2, 2),  # tp 2 x dp 2: ddp on a mesh is FSDP2's replicate
    "pp_tp_tied": (dict(vocab_size=2048), dict(pp=2, tp=2), 2, 2),  # stage 0's tied table: its gradient whole
    "ep": ({**MOE, "first_dense_layers": 0}, dict(ep=2, strategy="ddp"), 2, 2),  # 2 ranks: dp 2 = ep 2
    "dp_ep": ({**MOE, "dropless": False, "capacity_factor": 1.0}, dict(ep=2, strategy="ddp"), 2, 1),  # dp 4
    # FSDP2 beside ep: the dense parameters sharded over dp, the experts divided (2 ranks: ep = dp, edp 1; 4 ranks:
    # zero2 over dp 4, each expert whole on its edp 2 ranks)
    "ep_fsdp": ({**MOE, "first_dense_layers": 0}, dict(ep=2, strategy="fsdp"), 2, 2),
    # FSDP2 over a MoE's blocks, every expert in them: one micro-batch of 16 tokens, so the step's peak is the
    # blocks' backward (gathered, prefetched, their gradients and reduce-scatter inputs: the plan block by block)
    "moe_fsdp": ({**MOE, "first_dense_layers": 0}, dict(strategy="fsdp"), 1, 1),
    # FSDP2 reduce-scattering each of 3 micro-batches' gradients into the rank's shard (parallel.fsdp_grad_sync)
    "fsdp_sync": (dict(), dict(strategy="fsdp", fsdp_grad_sync="micro-batch"), 2, 3),
    "dp_ep_zero2": (MOE, dict(ep=2, strategy="zero2"), 2, 2),
    "cp": (dict(), dict(cp=2, strategy="ddp"), 2, 2),  # 16 positions: 4 chunks of 4, rank 0 holds 0-3 and 12-15
    "cp_dp": (dict(position="learned", n_kv_heads=1), dict(cp=2, strategy="fsdp"), 2, 2),  # dp 2 x cp 2
    "tp_cp": (dict(), dict(tp=2, cp=2, strategy="ddp"), 2, 2),  # each rank: 4 of a sequence's 16 positions
    "pp_dp_ep": ({**MOE, "n_layers": 3}, dict(pp=2, ep=2, strategy="ddp"), 1, 2),  # pp 2 x dp 2 = ep 2
    # tp 2 x dp 2 = ep 2 under FSDP2 (ddp: tp_pp_ep, on 8 ranks)
    "tp_ep_fsdp": ({**MOE, "first_dense_layers": 0}, dict(tp=2, ep=2, strategy="fsdp"), 2, 2),
    "tp_pp_dp": (dict(), dict(tp=2, pp=2, strategy="ddp"), 1, 2),  # 8 ranks: tp 2 x pp 2 x dp 2, tied
    "tp_pp_ep": ({**MOE, "n_layers": 3}, dict(tp=2, pp=2, ep=2, strategy="ddp"), 1, 2),  # 8 ranks, dp 2 = ep 2
    # the zero-bubble schedules, stages 0-3 of one layer each: interleaved_zb places them 0, 2 | 1, 3 (tied: the
    # head's copy on rank 1), zbv and dualpipev in a V, 0, 3 | 1, 2 (tied: both ends on rank 0)
    "pp_zb": (dict(n_layers=4), dict(pp=2, pp_schedule="interleaved_zb", vpp=2), 1, 4),
    "pp_zbv": (dict(n_layers=4), dict(pp=2, pp_schedule="zbv", vpp=2), 1, 4),
    # MoE stages (layer 0 dense, 1-3 MoE) under a split backward: each stage's auxiliary loss rides its output
    "pp_zb_moe": ({**MOE, "n_layers": 4}, dict(pp=2, pp_schedule="interleaved_zb", vpp=2), 1, 4),
    # dualpipev on 5 micro-batches: torch's V schedules take a count that pp does not divide
    "pp_dualpipev": (dict(n_layers=4, tie_embeddings=False), dict(pp=2, pp_schedule="dualpipev", vpp=2), 1, 5),
    "pp_fp16": (dict(), dict(pp=2), 1, 3),  # fp16 autocast with its loss scaler (PRECISION), tied
    # torch.compile per block (COMPILED): a pipeline stage's blocks, tied; blocks of DTensor shards
    "pp_compiled": (dict(), dict(pp=2), 1, 4),
    "tp_compiled": (dict(), dict(tp=2), 2, 2),
}
PRECISION = {"pp_fp16": "fp16", "tp_dp_bf16": "bf16"}  # the others: fp32
# fp16's skip path: in this step the first block's first norm weight (pipeline stage 0 only) gets an inf gradient,
# so only rank 0 finds one, and every rank must skip the step (one process does the same)
OVERFLOW_STEP, OVERFLOWED = 0, "blocks.0.norm1.weight"
COMPILED = ("pp_compiled", "tp_compiled")
V_EVAL = ("zbv", "dualpipev")  # schedules whose cases also evaluate one batch after the resumed steps


def config(name: str) -> RunConfig:
    model, parallel, micro_batch, grad_accum = CASES[name]
    # the expert-parallel cases clip (their norms are 0.6-0.8), so that a norm counting an expert twice would show
    clip = 0.5 if parallel.get("ep", 1) > 1 else 1.0
    train = TrainConfig(micro_batch=micro_batch, grad_accum_steps=grad_accum, seq_len=16, max_steps=STEPS, lr=1e-2,
                        warmup_steps=0, precision=PRECISION.get(name, "fp32"), seed=7, grad_clip=clip,
                        compile="true" if name in COMPILED else "false")
    return RunConfig(model=ModelConfig(**{**TINY, **model}), train=train, parallel=ParallelConfig(**parallel))


def global_batches(cfg: RunConfig, dp: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's dp x K micro-batches, in data-parallel rank order: rank r takes [r K, (r + 1) K)."""
    t = cfg.train
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, cfg.model.vocab_size, (dp * t.grad_accum_steps, t.micro_batch, t.seq_len + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in ids]


def reference(cfg: RunConfig, dp: int) -> tuple[list[float], list, float | None, float | None]:
    """One process, the same global batch and seed: its losses, the routing of its last forward, (V_EVAL)
    the loss of one evaluation batch after its steps and (fp16) its loss scale at the end."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    train = TrainConfig(**{**vars(cfg.train), "grad_accum_steps": cfg.train.grad_accum_steps * dp})
    step = build_step(model, train, torch.device("cpu"), cfg.train.precision)
    losses = []
    for i in range(cfg.train.max_steps):
        with overflow(cfg, model, i):
            losses.append(step(global_batches(cfg, dp, i)).loss.item())
    evaluated = step.loss(*global_batches(cfg, 1, STEPS)[0]).item() if cfg.parallel.pp_schedule in V_EVAL else None
    return losses, routing(model), evaluated, step.scaler.get_scale() if step.scaler.is_enabled() else None


@contextlib.contextmanager
def overflow(cfg: RunConfig, model: torch.nn.Module, i: int):
    """fp16, step OVERFLOW_STEP: OVERFLOWED's gradient made inf wherever this rank (or one process) holds it."""
    hooks = [p.register_hook(lambda g: torch.full_like(g, math.inf))
             for name, p in distributed.unwrap(model).named_parameters()
             if cfg.train.precision == "fp16" and i == OVERFLOW_STEP and name == OVERFLOWED]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def routing(model: torch.nn.Module) -> list:
    """Assignments per expert of each MoE layer in the last forward (a pipeline rank: its own layers)."""
    model = distributed.unwrap(model)
    blocks = model.blocks.values() if isinstance(model.blocks, torch.nn.ModuleDict) else model.blocks
    return [b.mlp.last_expert_counts.tolist() for b in blocks if getattr(b.mlp, "last_expert_counts", None) is not None]


def fresh(cfg: RunConfig):
    """The model initialised whole from the run's seed, then divided by the layout (the trainer's: its run
    description over this world size)."""
    layout = layout_for(cfg.parallel, distributed.world_size(), cfg.train.grad_accum_steps)
    d = distributed.init(Run.of(cfg, cfg.train.precision, layout), "cpu")
    torch.manual_seed(cfg.train.seed)
    return d, build_step(build_model(cfg.model), cfg.train, torch.device("cpu"), cfg.train.precision, dist=d,
                         compile=cfg.train.compile == "true")


def train(cfg: RunConfig, d, step, steps: range, foreign: set[int] | None = None) -> tuple[list[float], dict]:
    """Steps `steps` of this rank's share of each global batch; the last MEASURED ones measured when given
    `foreign`, the storages alive before the model was built (StepPeakMeter leaves them out, as the trainer
    does): states and messages of the last, the least of their peaks. Under gloo a finished collective's
    output buffer is sometimes released only at a later wait (the work object outlives the wait on gloo's
    thread), adding one to three logits-sized buffers to a step's peak at random (seen in 1 step in 10 on
    2 cores); the least of three steady-state steps is the step's own residency."""
    K, losses, measured, peaks = cfg.train.grad_accum_steps, [], {}, []
    for i in steps:
        mine = global_batches(cfg, d.layout.dp, i)[d.dp_rank * K:(d.dp_rank + 1) * K]
        if foreign is not None and i >= steps[-MEASURED]:
            grads, routed = {}, []

            def hook(phase: str) -> None:
                if phase == "forward" and routed_tokens(step.model) is not None:
                    routed.append(routed_tokens(step.model))
                if phase == "step":
                    grads["bytes"] = distributed.local_bytes(p.grad for p in step.params)

            meter, counter = StepPeakMeter(torch.device("cpu"), foreign), CommCounter()
            meter.start()
            with counter, overflow(cfg, step.model, i):
                result = step(mine, hook)
            peaks.append(meter.stop())
            measured = distributed.rank_state_bytes(step.params, step.optimizer, grads["bytes"])
            measured["peak_memory_bytes"] = min(peaks)
            measured["comm"] = counter.result()
            measured["expert_tokens"] = torch.stack(routed).sum(0).tolist() if routed else None
        else:
            with overflow(cfg, step.model, i):
                result = step(mine)
        losses.append(distributed.mean_across_ranks(result.loss.float(), d, d.dp_group).item())
    return losses, measured


def save(out: Path, name: str, d, step) -> Path:
    run_dir = out / f"{name}-run"
    if d.is_main:
        shutil.rmtree(run_dir, ignore_errors=True)
    distributed.barrier(d)
    return ckpt.save_sharded(run_dir, SAVE_AT, step.model, step.optimizer, {"step": SAVE_AT} if d.is_main else None,
                             {"ranks": []} if d.is_main else None, 2, lambda: distributed.barrier(d))


def tied_digest(d, model: torch.nn.Module) -> str | None:
    """SHA-256 of a pipeline rank's copy of a tied table (the embedding on the first stage, the LM head on
    the last), None elsewhere: equal digests are bit-equal copies."""
    model = distributed.unwrap(model)
    module = model.embed if model.embed is not None else model.lm_head
    if not model.cfg.tie_embeddings or d.layout.pp == 1 or module is None:
        return None
    return hashlib.sha256(distributed.local_value(module.weight.detach()).numpy().tobytes()).hexdigest()


def one_process_loss(cfg: RunConfig, path: Path, dp: int) -> float:
    """The checkpoint's weights in one process (DCP gathers the shards): the mean loss of step SAVE_AT's
    global batch, before that step's update."""
    torch.manual_seed(0)
    model = build_model(cfg.model)
    ckpt.load_weights(model, path)
    with torch.no_grad():
        batches = global_batches(cfg, dp, SAVE_AT)
        return sum(model(x, y).item() for x, y in batches) / len(batches)


def run(name: str, out: Path) -> None:
    """STEPS steps straight with a checkpoint after step SAVE_AT (the MEASURED steps before it measured), then
    the steps after it again from that checkpoint in a freshly built model (one_process adds the one-process run)."""
    cfg = config(name)
    foreign = foreign_storages(torch.device("cpu"))
    d, step = fresh(cfg)
    losses, measured = train(cfg, d, step, range(SAVE_AT), foreign)
    path = save(out, name, d, step)
    scaler = step.scaler.state_dict()  # fp16's loss scale (the trainer keeps it in trainer.json)
    more, _ = train(cfg, d, step, range(SAVE_AT, STEPS))
    result = {"losses": losses + more, "measured": measured, "routing": routing(step.model),
              "tied": tied_digest(d, step.model)}
    d, step = fresh(cfg)
    ckpt.load_sharded(path, step.model, step.optimizer)
    if scaler:
        step.scaler.load_state_dict(scaler)
    result["resumed"], _ = train(cfg, d, step, range(SAVE_AT, STEPS))
    result["scale"] = step.scaler.get_scale() if step.scaler.is_enabled() else None
    result["tied_resumed"] = tied_digest(d, step.model)
    if cfg.parallel.pp_schedule in V_EVAL:  # evaluation through the V's own schedule (runtime.pipeline.eval_loss)
        result["eval"] = step.loss(*global_batches(cfg, 1, STEPS)[0]).item()
    (out / f"{name}.rank{d.rank}.json").write_text(json.dumps(result))
    distributed.barrier(d)


def one_process(name: str, out: Path, world: int) -> None:
    """The one-process run of a case on the same global batch (and, tied across stages, the loss one process
    computes from the checkpoint's weights): OUT/CASE.reference.json. Each rank takes its share of the cases
    after all of them have run, so the ranks compute them side by side."""
    cfg = config(name)
    dp = layout_for(cfg.parallel, world, cfg.train.grad_accum_steps).dp
    result = dict(zip(("reference", "reference_routing", "reference_eval", "reference_scale"), reference(cfg, dp)))
    if cfg.model.tie_embeddings and cfg.parallel.pp > 1:
        path = rundir.checkpoint_dir(out / f"{name}-run") / rundir.checkpoint_name(SAVE_AT)
        result["one_process_at_save"] = one_process_loss(cfg, path, dp)
    (out / f"{name}.reference.json").write_text(json.dumps(result))


def reshard(out: Path) -> None:
    """DCP across layouts: tp 2's checkpoint of step SAVE_AT (case "tp", untied) loaded into pp 2, and into one
    process."""
    cfg = config("tp")
    cfg.model = ModelConfig(**{**TINY, "tie_embeddings": False})
    d, step = fresh(cfg)
    train(cfg, d, step, range(SAVE_AT))
    path = save(out, "reshard", d, step)
    losses, _ = train(cfg, d, step, range(SAVE_AT, SAVE_AT + 1))
    cfg.parallel = ParallelConfig(pp=2)
    d, step = fresh(cfg)
    ckpt.load_sharded(path, step.model, step.optimizer)
    after, _ = train(cfg, d, step, range(SAVE_AT, SAVE_AT + 1))
    # the whole model in one process, from the shards: the next step's loss before its update
    one = one_process_loss(cfg, path, 1) if d.is_main else None
    result = {"tp_next_step": losses[0], "pp_next_step": after[0], "one_process_next_step": one}
    (out / f"reshard.rank{d.rank}.json").write_text(json.dumps(result))


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor a DCP checkpoint holds, read whole in one process ("model.<name>", "optimizer.state.<name>.<key>"),
    and whether each was stored once (its chunks add up to its size: no shard written twice)."""
    meta = dcp.FileSystemReader(str(path / ckpt.SHARDED)).read_metadata().state_dict_metadata
    tensors = {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    once = all(sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size) for m in tensors.values())
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
    dcp.load(state, checkpoint_id=str(path / ckpt.SHARDED), no_dist=True)
    return state, once


def bit_equal(state: dict, saved: dict, prefix: str) -> bool:
    """Every tensor of `state` (whole, by name) is the checkpoint's, bit for bit, and none is missing."""
    names = {k[len(prefix):] for k in saved if k.startswith(prefix)}
    return names == set(state) and all(torch.equal(distributed.local_value(v), saved[prefix + k])
                                       for k, v in state.items())


def reshard_ep(out: Path) -> None:
    """DCP across expert-parallel sizes: the checkpoints of step SAVE_AT of the "ep" and "ep_fsdp" cases (ep 2
    beside DDP and beside FSDP2, run before this in the launch) loaded at ep 1 on the same two ranks (tp 2: every
    expert on both, split by width) and into one process. Each rank's model and optimizer states gathered whole,
    and the one-process model, against the checkpoint's tensors read whole; the next step's loss."""
    results = {}
    for source in ("ep", "ep_fsdp"):
        cfg = config(source)
        path = rundir.checkpoint_dir(out / f"{source}-run") / rundir.checkpoint_name(SAVE_AT)
        saved, once = checkpoint_tensors(path)
        cfg.parallel = ParallelConfig(tp=2)
        cfg.train.grad_accum_steps *= 2  # one tp replica takes both data-parallel ranks' micro-batches
        d, step = fresh(cfg)
        ckpt.load_sharded(path, step.model, step.optimizer)
        whole = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
        model_equal = bit_equal(get_model_state_dict(step.model, options=whole), saved, "model.")
        optimizer = get_optimizer_state_dict(step.model, step.optimizer, options=whole)
        optimizer_equal = bit_equal({k: v for k, v in optimizer.items() if k.startswith("state.")}, saved,
                                    "optimizer.")
        after, _ = train(cfg, d, step, range(SAVE_AT, SAVE_AT + 1))
        result = {"stored_once": once, "model_equal": model_equal, "optimizer_equal": optimizer_equal,
                  "tp_next_step": after[0]}
        if d.is_main:
            torch.manual_seed(0)
            model = build_model(cfg.model)
            ckpt.load_weights(model, path)
            result["one_process_equal"] = bit_equal(split_fused(model).state_dict(), saved, "model.")
            result["one_process_next_step"] = one_process_loss(cfg, path, 1)
        results[source] = result
    (out / f"reshard_ep.rank{d.rank}.json").write_text(json.dumps(results))


def main() -> None:
    torch.set_num_threads(1)
    # the imports' objects to the collector's permanent generation: each peak measurement collects and scans
    # the heap, and those objects are foreign to every case's run either way (tests/conftest.py does the same)
    gc.collect()
    gc.freeze()
    out = Path(sys.argv[1])
    special = {"reshard": reshard, "reshard_ep": reshard_ep}
    for name in sys.argv[2:]:
        special.get(name, lambda out: run(name, out))(out)
    world, rank = distributed.world_size(), torch.distributed.get_rank()
    for i, name in enumerate(n for n in sys.argv[2:] if n not in special):
        if i % world == rank:
            one_process(name, out, world)
    distributed.shutdown(distributed.Dist("x", world_size=2))


if __name__ == "__main__":
    main()
