"""Sparse Mixture-of-Experts feed-forward block (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2022).

A router picks top_k of n_experts routed experts per token; n_shared_experts always-on experts
(DeepSeekMoE, Dai et al. 2024) see every token. Shapes: B batch, T tokens, H d_model, N = B*T tokens,
E routed experts, k top_k, F expert width (2F for the fused gate+up of gated activations), S = N*k
token-expert assignments.

Dispatch has no Python loop over tokens: the S assignments are sorted by expert, each expert runs one
matmul on its contiguous group (a loop over E experts), and the results are scattered back with
`index_add_` (CombineRows), weighted by the router. Expert weights are stacked 3-D parameters so that the loop body
is two matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode

from trainwise.config import ModelConfig
from trainwise.model.layers import ACTIVATION_FNS, MLP, gated_activation


# On a CPU, torch._grouped_mm in 16 bits runs each expert's group through oneDNN, which builds a kernel for
# every new group size (milliseconds each) and keeps at most 1024 of them: with routing new at every step,
# nearly every grouped call built kernels. Each group is padded with zero rows to a multiple of 1/GROUP_SIZES
# of the call's rows (16 at least), so that a matmul meets at most GROUP_SIZES + 1 sizes, built in a run's
# first steps and found afterwards (benchmarks/bench_moe.py measures the step with and without; its figures
# are in benchmarks/RESULTS.md). fp32 runs on MKL, which builds no kernel per size: left unpadded. The
# padded rows are zeros and are never read back: the outputs and gradients are those of the unpadded call.
GROUP_SIZES = 64


def pad_multiple(rows: int) -> int:
    """The row multiple each expert's group of a grouped call of `rows` rows is padded to (GROUP_SIZES)."""
    return max(16, -(-rows // GROUP_SIZES // 16) * 16)


def pads_groups(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a grouped matmul pads its groups (GROUP_SIZES): on a CPU in 16 bits, in eager mode. A step
    compiled, or run under a dispatch mode (the FLOP counter, the memory tracker, the operator recorder's
    fake tensors: measurements of the model's own work), runs its groups as routed."""
    if device_type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or torch.compiler.is_compiling():
        return False
    return _get_current_dispatch_mode() is None


def padded_groups(counts: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts (E,) of rows grouped by expert -> (E,) counts padded up to `multiple`, and (S,) the row of
    each of the S grouped rows in the padded buffer."""
    padded = (counts + multiple - 1) // multiple * multiple
    expert = torch.arange(counts.numel(), device=counts.device).repeat_interleave(counts)  # (S,)
    inside = torch.arange(expert.numel(), device=counts.device) - (counts.cumsum(0) - counts)[expert]
    return padded, (padded.cumsum(0) - padded)[expert] + inside


class ExpertLinear(nn.Module):
    """E independent Linear layers held as one (E, d_in, d_out) weight (+ (E, d_out) bias)."""

    def __init__(self, n_experts: int, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_in, d_out))
        self.bias = nn.Parameter(torch.empty(n_experts, d_out)) if bias else None
        bound = 1 / math.sqrt(d_in)  # nn.Linear's default; Transformer.reset_parameters overrides it
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x (n, d_in) tokens of expert e -> (n, d_out)."""
        y = x @ self.weight[e]  # autocast casts matmul inputs as it does nn.Linear's
        return y if self.bias is None else y + self.bias[e].to(y.dtype)

    def forward_grouped(self, x: torch.Tensor, offsets: torch.Tensor, expert_of: torch.Tensor) -> torch.Tensor:
        """x (S', d_in) grouped by expert -> (S', d_out), one torch._grouped_mm in x's dtype (autocast does not
        cover it: the weight is cast by hand). offsets (E,) int32: where each group ends; expert_of (S',):
        each row's expert (for the bias)."""
        y = torch._grouped_mm(x, self.weight.to(x.dtype), offs=offsets)
        return y if self.bias is None else y + self.bias.to(x.dtype)[expert_of]


class CombineRows(torch.autograd.Function):
    """(S', H) rows added into N zero rows at token_of, as index_add_ does, saving only the index for backward
    (the rows' gradient is the output's gradient gathered at token_of). Autograd's own index_add keeps its source,
    the S' weighted rows, for their shape: k x H more per token than the combine needs."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, token_of: torch.Tensor, n_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(token_of)
        return rows.new_zeros((n_tokens, rows.shape[1])).index_add_(0, token_of, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (token_of,) = ctx.saved_tensors
        return grad.index_select(0, token_of), None, None


class MoE(nn.Module):
    """Router + routed experts (+ shared experts). forward: (B, T, H) -> (B, T, H).

    After each forward: `last_aux_loss` (scalar, already weighted: aux_loss_coef x load balancing +
    z_loss_coef x router z-loss; 0 in eval mode), `last_expert_counts` (LongTensor (E,), assignments
    routed to each expert, before any capacity drop) and `last_dropped` (int, assignments dropped by
    the capacity limit; 0 when dropless)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, Fe = cfg.n_experts, cfg.d_model, cfg.expert_ffn_hidden
        self.n_experts, self.top_k, self.gated = E, cfg.top_k, cfg.gated
        self.act = gated_activation(cfg) if self.gated else ACTIVATION_FNS[cfg.activation]
        self.gating, self.renormalize = cfg.router_gating, cfg.renormalize_top_k
        self.scale, self.groups, self.group_top_k = cfg.routed_scaling_factor, cfg.router_groups, cfg.router_group_top_k
        self.bias_rate = cfg.router_bias_rate
        self.dropless, self.capacity_factor = cfg.dropless, cfg.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.router = nn.Linear(H, E, bias=cfg.router_logit_bias)
        # DeepSeek-V3's e_score_correction_bias: added to the scores for choosing experts only, never to
        # the weights; set by a rule after each step (balance_expert_bias), not by gradients: a buffer, saved
        # with the weights
        self.register_buffer("expert_bias", torch.zeros(E) if cfg.router_bias else None)
        self.experts_fc = ExpertLinear(E, H, 2 * Fe if self.gated else Fe, cfg.bias)  # gate+up fused
        self.experts_proj = ExpertLinear(E, Fe, H, cfg.bias)
        # n shared experts of width F have the parameters and FLOPs of one MLP of width n*F.
        self.shared = MLP(cfg, hidden=cfg.n_shared_experts * Fe) if cfg.n_shared_experts else None
        self.last_aux_loss: torch.Tensor | float = 0.0
        self.last_expert_counts: torch.Tensor | None = None
        self.last_dropped = 0
        self.grouped_mm: bool | None = None  # None = torch._grouped_mm where usable; False = loop over experts
        self.pad_groups = True  # pad the groups where it pays (pads_groups); False: always as routed
        # expert parallelism (trainwise.runtime.expert_parallel) sets it: called as exchange(self, grouped, counts),
        # it carries the grouped assignments to the ranks that hold their experts and their outputs back
        self.exchange = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        tokens = x.reshape(B * T, H)  # (N, H)
        logits = self.router_logits(tokens)  # (N, E) fp32
        probs, weights, chosen = self.route(logits)  # (N, E), (N, k), (N, k)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)  # (E,)
        out = self.dispatch(tokens, weights, chosen, counts)
        if self.shared is not None:
            out = out + self.shared(tokens)
        self.last_expert_counts = counts.detach()
        if self.training:
            self.last_aux_loss = (self.aux_loss_coef * load_balancing_loss(probs, counts, self.top_k)
                                  + self.z_loss_coef * router_z_loss(logits))
        else:
            self.last_aux_loss = 0.0
        return out.reshape(B, T, H)

    def router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, E) in fp32 also under autocast: top-k choices and softmax are sensitive to
        rounding (Switch Transformer section 2.4, "selective precision")."""
        bias = self.router.bias.float() if self.router.bias is not None else None
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.float(), self.router.weight.float(), bias)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits (N, E) -> probabilities (N, E) for the balancing loss, combine weights (N, k) and the
        chosen experts (N, k). softmax: Mixtral/Qwen-MoE (gpt-oss softmaxes the k chosen logits alone: the
        weights renormalize_top_k gives); sigmoid: DeepSeek-V3 (section 2.1.2), whose balancing loss uses the
        scores normalised to sum to 1."""
        if self.gating == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice_scores = scores if self.expert_bias is None else scores + self.expert_bias
        if self.groups > 1:
            choice_scores = self.group_limited(choice_scores)
        chosen = choice_scores.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, chosen)  # (N, k)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return probs, weights * self.scale if self.scale != 1.0 else weights, chosen

    def group_limited(self, choice_scores: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited routing (section 2.1.2): experts in `groups` groups, each group
        scored by the sum of its two best experts' scores; a token chooses among the experts of its best
        group_top_k groups only (the others' scores become -inf). (N, E) -> (N, E)."""
        grouped = choice_scores.unflatten(-1, (self.groups, -1))  # (N, groups, E / groups)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # (N, groups)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
            1, best.topk(self.group_top_k, dim=-1).indices, True)  # (N, groups)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)

    def dispatch(self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        """Sort the S = N*k assignments by expert, run each expert on its group, scatter back weighted."""
        order = chosen.flatten().argsort(stable=True)  # (S,) assignments grouped by expert, token order inside
        self.last_dropped = 0
        if not self.dropless:
            order, counts = self.apply_capacity(order, counts, tokens.shape[0])
        token_of = order // self.top_k  # (S',) the token of each grouped assignment
        # (S', H) the dispatch buffer. index_select, not tokens[token_of]: its gradient is index_add_, where
        # indexing's (index_put_, accumulating) took 3.8 ms per layer on a CPU at 4096 rows of 256 (profiler,
        # `moe T512` of benchmarks/time_model.py: 15 ms of its step; index_add_ there: 0.1 ms per layer)
        grouped = tokens.index_select(0, token_of)
        if self.exchange is not None:
            y = self.exchange(self, grouped, counts)
        elif self.use_grouped_mm(grouped):
            y = self.experts_grouped(grouped, counts, chosen.flatten()[order])
        else:
            y = self.experts_looped(grouped, counts)
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)  # (S', H)
        return CombineRows.apply(y, token_of, tokens.shape[0])

    def apply_capacity(self, order: torch.Tensor, counts: torch.Tensor,
                       n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the first `capacity` assignments of each expert in token order (Switch Transformer,
        section 2.2); capacity = ceil(capacity_factor * N * k / E). A dropped assignment adds nothing:
        the token passes on through the residual connection."""
        capacity = math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)
        starts = counts.cumsum(0) - counts  # (E,) where each expert's group begins in `order`
        rank = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(counts)
        kept = counts.clamp(max=capacity)
        self.last_dropped = int(counts.sum() - kept.sum())
        return order[rank < capacity], kept

    def use_grouped_mm(self, grouped: torch.Tensor) -> bool:
        """torch._grouped_mm (one kernel for all experts) where this build has it for the device and
        dtype, and every row stride is a multiple of 16 bytes as it requires; else a loop over experts."""
        if self.grouped_mm is False or not hasattr(torch, "_grouped_mm"):
            return False
        device = grouped.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else grouped.dtype
        if device == "cuda":  # torch's CUDA kernels: bf16 on Hopper and newer (unverified here: no GPU)
            if dtype != torch.bfloat16 or torch.cuda.get_device_capability(grouped.device) < (9, 0):
                return False
        elif device != "cpu":
            return False
        if dtype != torch.bfloat16 and is_fake(grouped):  # its meta kernel takes bf16 only (the CUDA rule), so
            return False  # fake tensors (the planner's records, `plan --simulate`) loop: same FLOPs and bytes
        widths = (grouped.shape[1], self.experts_proj.weight.shape[1])  # H and F (experts_fc's 2F follows)
        return all(w * dtype.itemsize % 16 == 0 for w in widths)

    def experts_grouped(self, x: torch.Tensor, counts: torch.Tensor, expert_of: torch.Tensor) -> torch.Tensor:
        """x (S', H) grouped by expert -> (S', H), each group through its expert, in two grouped matmuls.
        No host sync where the groups run as routed (the group offsets stay on the device); padded
        (pads_groups, a CPU's), one for the padded buffer's size."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x, rows = x.to(dtype), None
        if self.pad_groups and pads_groups(device, dtype):  # a few group sizes, their kernels found (GROUP_SIZES)
            multiple = pad_multiple(x.shape[0])
            counts, rows = padded_groups(counts, multiple)
            # a buffer of the same size at every call (the most padding there can be), so that the allocator
            # reuses its memory: one of each call's own size faulted in fresh pages (2 MB zeroed in 2.2 ms)
            buffer = x.new_zeros(x.shape[0] + counts.numel() * multiple, x.shape[1])
            x = buffer[:int(counts.sum())].index_copy_(0, rows, x)
            if self.experts_fc.bias is not None or self.experts_proj.bias is not None:  # the padded rows' experts
                expert_of = torch.arange(counts.numel(), device=x.device).repeat_interleave(counts)
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's group
        with torch.autocast(device, enabled=False):
            h = self.activate(self.experts_fc.forward_grouped(x, offsets, expert_of))  # (S', 2F) -> (S', F)
            y = self.experts_proj.forward_grouped(h, offsets, expert_of)  # (S', H)
        return y if rows is None else y.index_select(0, rows)

    def experts_looped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (S', H) grouped by expert -> (S', H): one iteration per expert with tokens."""
        outputs = []
        for e, xe in enumerate(x.split(counts.tolist())):  # the split sizes cost one host sync
            if xe.shape[0]:
                h = self.activate(self.experts_fc.forward_expert(e, xe))
                outputs.append(self.experts_proj.forward_expert(e, h))
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[1])

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The middle of trainwise.model.layers.MLP: act(gate) * up for gated MLPs, else act(h)."""
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.act(gate, up)
        return self.act(h)

    @torch.no_grad()
    def balance_expert_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing (section 2.1.2): after a step, raise the choice
        bias of the experts that got fewer than the mean assignments `load` (E,) and lower it for the
        others, by router_bias_rate. trainwise.runtime.step calls it after each optimizer step with the
        step's load summed over micro-batches (and ranks), never between a forward and its
        activation-checkpointing recompute."""
        load = load.float()
        self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer eq. 4, for top-k routing: E * sum_i f_i P_i, where f_i = counts_i / (N k) is
    the fraction of assignments sent to expert i and P_i the mean router probability of expert i.
    Equals 1 for a uniform router and a uniform assignment; f carries no gradient, P does."""
    E = probs.shape[-1]
    fraction = counts.to(probs.dtype) / (probs.shape[0] * top_k)  # (E,)
    return E * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE (Zoph et al. 2022) eq. 5: mean over tokens of logsumexp(logits)^2, keeps logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()
