"""The cross-entropy's memory: which kernel a run computes its loss with (trainwise's F.cross_entropy, its chunked
loss, torch.compile's kernel, or another stack's: Megatron's, flash-attn's, Transformer Engine's), what each saves
for backward per token and what its backward holds beside the saved activations (cost.memory and cost.rank_memory
add them up)."""

from __future__ import annotations

import math

from trainwise.config import ModelConfig
from trainwise.cost.recipe import Recipe

# The cross-entropy a run computes, by what it keeps (loss_kernel): what the plan's memory says it saves
LOSS_KERNELS = {"torch": "the loss's fp32 log-softmax B*T*V", "chunked": "the chunked loss's fp32 logsumexp B*T",
                "compiled": "the compiled loss's logits B*T*V", "flash-attn": "flash-attn's fused loss's logits B*T*V",
                "te": "Transformer Engine's fused loss's logits B*T*V, its gradient written over them",
                "megatron": "Megatron's vocabulary-parallel loss's fp32 softmax B*T*V, its gradient in place"}
STACK_LOSSES = ("torch", "megatron", "flash-attn", "te")  # a stack's loss kernel, as --loss-kernel names it


def loss_kernel(cfg: ModelConfig, compiled: bool = False, stack: str | None = None, megatron: bool = False) -> str:
    """The cross-entropy a run computes: the one its stack is said to run (cost.run.Run.loss_kernel, STACK_LOSSES):
    "torch" (F.cross_entropy on an fp32 copy of the logits), "megatron" (Megatron's vocab_parallel_cross_entropy: an
    fp32 copy turned into the softmax in place and kept, the gradient made over it in backward), "flash-attn" (its
    fused kernel on the compute-dtype logits, the gradient a new buffer) or "te" (Transformer Engine's
    parallel_cross_entropy: the gradient written over the logits in forward). Unsaid: trainwise's own, "chunked"
    (model.loss_chunk_tokens: trainwise.model.loss), "compiled" (torch.compile's one fused kernel) or "torch"; for
    another stack's run (`megatron`: cost.run.trains false) Megatron-Core's, "megatron"."""
    if stack:
        return stack
    if cfg.loss_chunk_tokens or compiled:
        return "chunked" if cfg.loss_chunk_tokens else "compiled"
    return "megatron" if megatron else "torch"


def loss_saved_bytes_per_token(cfg: ModelConfig, recipe: Recipe, kernel: str = "torch") -> int:
    """What the cross-entropy saves for backward per token: F.cross_entropy the fp32 log-softmax row (4V),
    Megatron's the fp32 softmax (4V); the chunked loss the fp32 logsumexp (4); a fused kernel, compiled or
    another stack's, the logits as the LM head made them (cV) and their logsumexp; an in-place one only the
    logits' buffer, its gradient by then."""
    if kernel in ("chunked", "te"):
        return 4 if kernel == "chunked" else recipe.compute_bytes * cfg.vocab_size
    return recipe.compute_bytes * cfg.vocab_size + 4 if kernel in ("compiled", "flash-attn") else 4 * cfg.vocab_size


def loss_backward_bytes(cfg: ModelConfig, recipe: Recipe, tokens: int, tp: int = 1, kernel: str = "torch") -> int:
    """Scratch of the cross-entropy's backward, alive at the start of backward beside the activations.

    Plain F.cross_entropy: two fp32 N x V buffers (the log-softmax gradient and the logits gradient), 8V per token;
    vocabulary-parallel (tp > 1: torch's loss_parallel, as another stack's tensor-parallel run calls it), three:
    its nll_loss backward makes the log-softmax's gradient too, as (one-hot + exp(saved log-probabilities)) x the
    incoming gradient, and holds the one-hot, the exponential and their sum at once, 12V / tp per token.
    Another stack's fused kernel (flash-attn's cross-entropy as llm-foundry calls it, not in place): one gradient as
    wide as the logits it saved, cV per token; in place (Transformer Engine's), none: the gradient is the saved
    buffer, scaled in place. Megatron's: its fp32 gradient is the saved softmax, made in place, and autograd casts
    it to the logits' dtype, cV (none in fp32). Chunked (model.loss_chunk_tokens = C > 0, trainwise.model.loss): the
    fp32 grad_weight accumulator 4VH, grad_hidden cNH, and one chunk's recomputed fp32 logits/softmax 4CV plus, when
    the compute dtype c is not fp32, its c-byte cast for the matmuls cCV and the c-byte VH product each chunk adds
    to the accumulator. N x V never appears."""
    V, H, c = cfg.vocab_size, cfg.d_model, recipe.compute_bytes
    if not cfg.loss_chunk_tokens:
        each = {"flash-attn": c, "te": 0, "megatron": c if c != 4 else 0}.get(kernel, 12 if tp > 1 else 8)
        return math.ceil(each * V * tokens / tp)
    chunk = min(cfg.loss_chunk_tokens, tokens)
    cast = c if c != 4 else 0
    return math.ceil((4 * V * H + c * tokens * H + (4 + cast) * chunk * V + cast * V * H) / tp)


def compiled_loss_backward_bytes(cfg: ModelConfig, recipe: Recipe, tokens: int, checkpointing: str) -> int:
    """Compiled, the cross-entropy backward is one fused kernel. Without full checkpointing it writes the
    logits' gradient over the saved logits (inductor reuses a buffer at its last use): no N x V scratch,
    and the high point moves to the LM head's weight gradient, 4VH (fp32), plus its c-byte matmul
    output under autocast. Under full checkpointing the loss sits in a graph of its own whose backward
    holds the fp32 log-softmax gradient 4V and the logits' gradient cV per token (measured:
    benchmarks/memory_grid.py)."""
    V, H, c = cfg.vocab_size, cfg.d_model, recipe.compute_bytes
    if checkpointing == "full":
        return tokens * (4 + c) * V
    return 4 * V * H + (c * V * H if c != recipe.residual_bytes else 0)
