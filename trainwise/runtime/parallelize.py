"""Wrappers applied to a built model from outside (torchtitan's "parallelize" step): activation
checkpointing, the attention of a compiled CPU step, and torch.compile. Sharding is
trainwise.runtime.distributed.

The model does not know about them: its state dict keys stay the same, so checkpoints load with or
without them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainwise.config import FSDP_STRATEGIES, ModelConfig
from trainwise.model.attention import explicit_attention, unfused_attention


def _checkpointed(forward, context_fn=None):
    def run(*args, **kwargs):
        # use_reentrant=False: works with keyword arguments, and with inputs that need no grad.
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


_aten = torch.ops.aten
MATMULS = {_aten.mm.default, _aten.addmm.default}
# kept whole under op-level checkpointing: attention (any SDPA kernel: its output and logsumexp) and a
# tensor-parallel block's reduce-scatters (recomputing them would run the collectives again)
KEPT = {_aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _op_policy(counts: dict, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's op-level policy: keep the output of every other matmul of a block, the 1st, 3rd, ...
    (the fused projections run as their parts, Attention.split and MLP.split, so that these are
    torchtitan's: q, v, gate and down kept; k, the output projection and up recomputed), and of the
    operators in KEPT; recompute everything else in backward. The matmuls are counted per pass (forward,
    recompute), so the recompute finds the same ones kept."""
    if op in MATMULS:
        phase = "recompute" if ctx.is_recompute else "forward"
        counts[phase] += 1
        keep = counts[phase] % 2 == 1
    else:
        keep = op in KEPT
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _op_contexts():
    return create_selective_checkpoint_contexts(functools.partial(_op_policy, {"forward": 0, "recompute": 0}))


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """full: keep only each block's input and recompute the block in backward.
    selective: recompute only the attention core (softmax(q k^T) v), as in Korthikanti et al. 2022.
    op: torchtitan's op-level selective checkpointing (_op_policy), each block one checkpointed region."""
    for block in model.blocks:
        if mode == "full":
            block.forward = _checkpointed(block.forward)
        elif mode == "op":
            block.attn.split = block.mlp.split = True  # the unfused projections' matmuls (_op_policy)
            block.forward = _checkpointed(block.forward, _op_contexts)
        else:
            block.attn.core = _checkpointed(block.attn.core)


def _explicit_core(attn: nn.Module, sdpa_core, when_compiling: bool):
    """attn.core written as explicit_attention for causal attention without dropout: always, or only
    while torch.compile traces it (`when_compiling`: the eager forward keeps SDPA)."""

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        if causal and not (attn.training and attn.dropout) and (
                not when_compiling or torch.compiler.is_compiling()):
            return explicit_attention(q, k, v)
        return sdpa_core(q, k, v, causal)

    return core


def use_compiled_attention(model: nn.Module, only_when_compiling: bool = True) -> None:
    """A compiled CPU step's attention: inductor fuses explicit_attention's scale, mask and softmax
    around two bf16 matmuls, faster than the CPU flash kernel it would otherwise call (RESULTS.md).
    Installed before checkpointing, which then wraps it. only_when_compiling=False: explicit attention
    in every forward (how the operator recorder describes a compiled step without compiling one).
    Attention with windows or sinks (not plain_causal) keeps its core: it is explicit already."""
    for block in model.blocks:
        if block.attn.plain_causal:
            block.attn.core = _explicit_core(block.attn, block.attn.core, only_when_compiling)


def use_unfused_attention(model: nn.Module) -> None:
    """Attention as frameworks ran it before fused attention kernels (Megatron-LM's 2021-22 runs):
    the T x T scores in memory, a softmax and dropout between two batched matmuls (model.attention
    .unfused_attention with the model's attention dropout). For the planner's records of such runs
    (`plan --attention-impl unfused`); trainwise itself trains with SDPA's fused kernels. Attention with
    windows or sinks keeps its core, which is unfused already."""
    for block in model.blocks:
        attn = block.attn
        if not attn.plain_causal:
            continue
        block.attn.core = lambda q, k, v, causal, attn=attn: unfused_attention(
            q, k, v, attn.dropout if attn.training else 0.0)


def use_native_dropout(model: nn.Module) -> None:
    """Dropout as a CUDA device runs it: PyTorch's fused kernel (torch.native_dropout: one read, one
    write and a 1-byte mask), where a CPU's F.dropout runs bernoulli_, div_ and mul. For the planner's
    records of GPU steps (trainwise.measure.record)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.forward = lambda x, m=module: torch.native_dropout(x, m.p, True)[0] if m.training and m.p else x


COMPILE_MIN_STEPS = 300  # below this many steps the one-off compile time is not repaid (see resolve_compile)


def resolve_compile(requested: str, model: ModelConfig, steps_left: int, strategy: str,
                    divided: bool = False) -> tuple[bool, str]:
    """(compile?, reason) for train.compile. auto compiles a dense model's run of COMPILE_MIN_STEPS or
    more steps: the default model compiles in tens of seconds with a cold cache and then steps ~1.4x
    faster on a CPU (benchmarks/RESULTS.md), so it pays off after about a hundred steps. A model divided
    by tensor or pipeline parallelism (`divided`) compiles only when asked (per block, as torchtitan does):
    its per-rank plan describes the eager step."""
    if requested != "auto":
        return requested == "true", "set in the config" + ("; per block, on this rank's share of the model"
                                                          if divided and requested == "true" else "")
    if divided:
        return False, "auto: tensor/pipeline-parallel steps run eager (train.compile=true compiles this " \
            "rank's blocks)"
    if model.is_moe:
        return False, "auto: MoE routing has data-dependent shapes, which compile poorly"
    if model.attention == "mla":
        return False, "auto: the memory model describes MLA's eager kernels (train.compile=true compiles it)"
    if strategy in FSDP_STRATEGIES:
        return False, "auto: FSDP2 compiles per block, which gains nothing measurable here"
    if steps_left < COMPILE_MIN_STEPS:
        return False, f"auto: {steps_left} steps are too few to repay the compile time"
    return True, f"auto: {steps_left} steps repay the one-off compile time"


def apply_compile(model: nn.Module, per_block: bool = False) -> None:
    """torch.compile the model in place (nn.Module.compile: the state dict keys stay the same).

    Whole model by default, so inductor fuses the loss's log-softmax and, on CPU, the attention softmax
    (use_compiled_attention) with the norm/RoPE/activation work; compiling each block alone gained
    nothing on a CPU (benchmarks/RESULTS.md). per_block=True (torchtitan's scheme) is for FSDP2, whose
    per-block hooks must stay outside the compiled graphs (fsdp, zero2). The first steps pay the
    compile time.

    Dynamo's caches are cleared first: code compiled earlier in this process for another model or
    dtype (a second run from the Python API, a test) made inductor fail on the Rotary node ("mul
    expected 2 arguments, got 3") when the same code was compiled again in bf16."""
    torch._dynamo.reset()
    if per_block:
        for block in model.blocks:
            block.compile()
    else:
        model.compile()


def remove_compile(model: nn.Module) -> None:
    """Back to eager, e.g. before KV-cache generation, whose growing cache would recompile."""
    for module in (model, *model.blocks):
        module._compiled_call_impl = None
