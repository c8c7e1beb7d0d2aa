"""Cross-entropy of the LM head without the whole (N, V) logits: chunked over tokens.

The plain loss, `F.cross_entropy(lm_head(x).float(), y)`, keeps the fp32 log-softmax of every token
(N x V x 4 bytes) for backward and builds two more N x V fp32 buffers in it; at V = 32k that is most
of a small model's step memory. Here the forward computes the logits of `chunk_tokens` tokens at a time
and keeps only each token's fp32 logsumexp; backward recomputes each chunk's logits and turns them into
softmax - onehot on the spot, so no more than one (chunk, V) block is alive at once (the idea of
Liger-Kernel's fused linear cross-entropy and of Apple's "Cut Your Losses", Wijmans et al. 2024, at
chunk instead of tile granularity). The cost is one extra head matmul, 2HV FLOPs per token, counted as
recompute (hardware FLOPs), not model FLOPs: see trainwise.cost.flops.loss_recompute_flops_per_token.

Shapes: N tokens, H d_model, V vocab, C chunk_tokens.
"""

from __future__ import annotations

import torch


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits = hidden @ weight.T, in chunks of C tokens. The matmuls run in the
    inputs' dtype (the caller casts them for autocast), logsumexp and softmax in fp32."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
        n = hidden.shape[0]
        lse = torch.empty(n, device=hidden.device, dtype=torch.float32)  # (N,)
        target_logit = torch.empty(n, device=hidden.device, dtype=torch.float32)  # (N,)
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = (hidden[rows] @ weight.T).float()  # (C, V)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            target_logit[rows] = logits.gather(1, targets[rows, None]).squeeze(1)
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return (lse - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return ChunkedCrossEntropy._backward(ctx, grad_loss)

    @staticmethod
    def _backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        n, chunk = hidden.shape[0], ctx.chunk_tokens
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype) if want_hidden else None
        # fp32 accumulator: summing bf16 partial products chunk by chunk would round N/C times.
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_weight else None
        scale = grad_loss.float() / n
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows]  # (C, H)
            probs = (h @ weight.T).float()  # (C, V) recomputed logits
            probs.sub_(lse[rows, None]).exp_()  # softmax, in place
            probs.scatter_add_(1, targets[rows, None], probs.new_full((h.shape[0], 1), -1.0))  # - onehot
            probs.mul_(scale)
            dlogits = probs.to(hidden.dtype)  # (C, V); the same tensor in fp32
            del probs
            if want_hidden:
                torch.mm(dlogits, weight, out=grad_hidden[rows])
            if want_weight:
                if dlogits.dtype == torch.float32:  # addmm(out=), not addmm_: FlopCounterMode counts it
                    torch.addmm(grad_weight, dlogits.T, h, out=grad_weight)
                else:
                    grad_weight += dlogits.T @ h
            del dlogits
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_tokens: int) -> torch.Tensor:
    """Mean over N tokens of cross_entropy(hidden @ weight.T, targets), never holding all N x V logits.

    hidden (N, H), weight (V, H) (the LM head, possibly tied to the embedding), targets (N,) int64.
    Under autocast the two matmul inputs are cast to the autocast dtype here, as autocast does for a
    Linear (the weight's copy is what backward saves); the result equals F.cross_entropy on the
    .float() logits up to float rounding."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    with torch.autocast(device_type, enabled=False):
        return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_tokens)
