"""Memory per device: model states (params, grads, optimizer, master weights) and activations.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 3.1 and figure 1): mixed-precision
Adam keeps 2+2+12 = 16 bytes per parameter, sharded over data-parallel ranks by stage (1: optimizer
states incl. master, 2: + gradients, 3: + parameters; FSDP full-shard = 3). Tensor and pipeline
parallelism split the model first (Megatron-LM; Narayanan et al. 2021).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainwise.config import ModelConfig
from trainwise.cost import loss as L
from trainwise.cost.params import attention_params, mlp_params
from trainwise.cost.recipe import Recipe, optimizer_moments
from trainwise.errors import TrainwiseError

DTYPE_BYTES = {"fp64": 8, "float64": 8, "fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2,
               "fp16": 2, "float16": 2, "half": 2, "fp8": 1, "int8": 1, "uint8": 1, "int32": 4, "int64": 8,
               "bool": 1}


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int
    master: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.master


def state_bytes(n_params: int, recipe: Recipe, optimizer: str, zero: int = 0, dp: int = 1,
                model_parallel: int = 1, fp8_numel: int = 0) -> StateBytes:
    """Per-device bytes of model states. Each part = n_params / (tp*pp) x bytes/param, divided by the
    data-parallel degree dp when the ZeRO stage shards it (ZeRO paper, section 5.1-5.3):
    stage >= 1 shards optimizer + master, >= 2 grads, 3 params. fp32 AdamW, 1e9 params: 16e9 bytes.
    With FP8 parameters (Recipe.fp8_params) the `fp8_numel` linear weights among them take 1 byte each."""
    if zero not in (0, 1, 2, 3):
        raise TrainwiseError(f"--zero {zero} must be 0, 1, 2 or 3 (FSDP full sharding = 3).")
    n = n_params / model_parallel

    def part(bytes_per_param: int, sharded: bool) -> int:
        return math.ceil(n * bytes_per_param / (dp if sharded else 1))

    return StateBytes(
        params=part(recipe.param_bytes, zero >= 3) - (math.floor(fp8_numel / model_parallel * (recipe.param_bytes - 1)
                                                              / (dp if zero >= 3 else 1)) if recipe.fp8_params else 0),
        grads=part(recipe.grad_bytes, zero >= 2),
        optimizer=part(recipe.moment_bytes * optimizer_moments(optimizer), zero >= 1),
        master=part(recipe.master_bytes, zero >= 1),
    )


def fp8_weights(params: list) -> int:
    """Elements of the blocks' linear weights among a rank's parameters (cost.rank.rank_params): those an FP8
    recipe multiplies in FP8 (the router excepted)."""
    return sum(p.numel for p in params if isinstance(p.spec.where, int) and len(p.spec.shape) >= 2
               and ".router." not in p.spec.name and ".weight" in p.spec.name)


def fp8_weight_bytes(recipe: Recipe, params: list) -> int:
    """The FP8 copies of the blocks' linear weights an FP8 recipe keeps through the step (Transformer Engine
    casts each weight once per step and keeps the copy and its transpose for the micro-batches after the
    first): 2 bytes per element; with FP8 parameters (Recipe.fp8_params) the parameter is the copy, and the
    transpose alone is kept (1 byte). And their scales: one fp32 per 128 x 128 block (blockwise), one byte per
    32 elements (MXFP8); per-tensor scales and delayed scaling's amax history are a few kilobytes."""
    if not recipe.fp8:
        return 0
    scales = {"blockwise": 4 / (128 * 128), "mx": 1 / 32}.get(recipe.fp8, 0.0)
    return math.ceil((1 if recipe.fp8_params else 2) * fp8_weights(params) * (1 + scales))


def zero1_partition(group_numels: list[list[int]], dp: int) -> list[int]:
    """Parameters (elements) whose optimizer states each of dp ranks owns under PyTorch's
    ZeroRedundancyOptimizer (trainwise's parallel.strategy = zero1), which shards by whole tensors: in
    each parameter group, largest first, every tensor goes to the rank that owns the fewest elements so
    far (lowest rank on ties). state_bytes' n/dp is DeepSpeed's even split of the flattened states; one
    big tensor (an embedding) makes the whole-tensor split uneven on small models."""
    owned = [0] * dp
    for numels in group_numels:
        for n in sorted(numels, reverse=True):
            owned[owned.index(min(owned))] += n
    return owned


def norm_saved_bytes(cfg: ModelConfig, s: int) -> int:
    """Bytes per token a pre-norm saves for backward. RMSNorm (PyTorch's composite, as on CPU): its
    input sH, x*rsqrt sH and rsqrt 4; LayerNorm (native_layer_norm): input sH, mean and rstd 8."""
    return (2 * s * cfg.d_model + 4) if cfg.norm == "rmsnorm" else (s * cfg.d_model + 8)


def activation_bytes_per_token_layer(cfg: ModelConfig, recipe: Recipe, layer: int,
                                     checkpointing: str = "none") -> float:
    """Bytes autograd saves per token in one block of the model trainwise builds (pre-norm, SDPA).

    After Korthikanti et al. 2022 ("Reducing Activation Recomputation", section 4.1) but for this block,
    read off the tensors autograd saves (torch.autograd.graph.saved_tensors_hooks), with c = compute
    dtype bytes, s = residual dtype bytes, q = nh*hd, kv = nkv*hd, F = MLP width:
      attention: norm1 (see norm_saved_bytes); the fused qkv Linear's input cH (the norm output, or
        its one cast under autocast); the qkv output c(q + 2kv), kept whole because v is a view of it;
        RoPE'd q and k c(q + kv) (none with learned positions: q, k are views of the qkv output too);
        SDPA out cq (also the o_proj input: a view) and logsumexp 4nh (flash kernel, no T^2 term);
        qk_norm inputs c(q + kv); dropout masks 1 byte/elem on the two residual branches. MLA: norm1 +
        mla_saved_bytes.
      MLP: norm2; fc input cH; gated: the fused gate|up output 2cF (gate and up are views of it) and the
        product (proj input) cF = 3cF (model.layers.GatedUnit computes act(gate) again in backward; gpt-oss's
        clamped SwiGLU, as autograd records it, keeps act(gate) too: 4cF); plain: act input and output 2cF
        (ReLU saves only its output, which is also the proj input: cF). MoE: see moe_saved_bytes (router, routing
        indices and weights, 2 top_k*cH of dispatch buffers, top_k expert MLPs) + the shared experts'
        MLP of width n_shared*F and its input cH (none in fp32: it is the router's input tensor).
    Selective checkpointing recomputes the attention core, dropping its logsumexp; its output stays, as
    the o_proj's saved input (measured: 16 of 272 bytes per token fewer at nh 4, hd 16, fp32). An FP8 recipe
    keeps its GEMMs' inputs as their FP8 casts: fp8_saved_delta fewer.
    Autocast's bf16 copies of the weights are per parameter, not per token: see autocast_weight_bytes."""
    if checkpointing == "op":
        return op_saved_bytes(cfg, recipe)
    c, s, H = recipe.compute_bytes, recipe.residual_bytes, cfg.d_model
    nh = cfg.n_heads
    norm = norm_saved_bytes(cfg, s)
    if cfg.attention == "mla":
        attn = norm + mla_saved_bytes(cfg, recipe, checkpointing)
        lse = 0  # mla_saved_bytes leaves its core's output out under selective checkpointing
    else:
        q, kv = nh * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        attn = norm + c * H + c * (q + 2 * kv)
        if cfg.position == "rope":
            attn += c * (q + kv)
        lse = 4 * nh
        attn += c * q + lse + (c * (q + kv) if cfg.qk_norm else 0)
    if checkpointing == "selective":
        attn -= lse
    if cfg.dropout > 0:
        attn += 2 * H
    up_inputs = c * H
    if cfg.is_moe_layer(layer):
        ffn = norm + moe_saved_bytes(cfg, recipe, unit_saved_bytes(cfg, c, cfg.expert_ffn_hidden))
        if cfg.n_shared_experts:
            ffn += unit_saved_bytes(cfg, c, cfg.n_shared_experts * cfg.expert_ffn_hidden)
            if not (c == 4 and s == 4):  # in fp32 the shared fc input is the router's input tensor
                ffn += up_inputs
    else:
        ffn = norm + up_inputs + unit_saved_bytes(cfg, c, cfg.ffn_hidden)
    return attn + ffn - fp8_saved_delta(cfg, recipe, layer)


def unit_saved_bytes(cfg: ModelConfig, c: int, width: int, fused: bool = False) -> float:
    """Bytes per token an MLP of `width` saves beyond its input, in compute dtype c (activation_bytes_per_token_layer's
    MLP terms): gated, the gate|up output and the product (clamped SwiGLU also act(gate), unless `fused`: Megatron-
    Core's fused weighted activation of its experts, which keeps its input and computes the rest again); plain, the
    activation's input and output (ReLU its output alone)."""
    if cfg.gated:
        return (4 if cfg.activation == "clamped_swiglu" and not fused else 3) * c * width
    return (1 if cfg.activation == "relu" else 2) * c * width


def expert_saved_bytes(cfg: ModelConfig, recipe: Recipe, megatron: bool = False) -> tuple[float, float]:
    """Bytes one routed assignment leaves saved on the rank whose expert computes it, as (the expert's grouped
    input, its MLP): c H (an FP8 recipe's cast, gemm_input_bytes) and unit_saved_bytes of the expert's width (its
    FP8 product as the cast; `megatron`: Megatron-Core's fused activation). Under expert parallelism a rank keeps
    these for the copies it receives: the most loaded rank (cost.run.routed_imbalance) the most."""
    c, H, F = recipe.compute_bytes, cfg.d_model, cfg.expert_ffn_hidden
    if not recipe.fp8:
        return c * H, unit_saved_bytes(cfg, c, F, megatron)
    e = gemm_input_bytes(recipe)
    return e * H, unit_saved_bytes(cfg, c, F, megatron) - _fp8_product_delta(cfg, recipe, F)


def gemm_input_bytes(recipe: Recipe) -> float:
    """Bytes per element of the input a linear layer keeps for its weight gradient: the compute dtype's, or under
    an FP8 recipe its FP8 cast's (one byte, and block scaling's scales: one fp32 per 128 elements, MXFP8's one
    byte per 32)."""
    if not recipe.fp8:
        return recipe.compute_bytes
    return 1 + {"blockwise": 4 / 128, "mx": 1 / 32}.get(recipe.fp8, 0.0)


def fp8_saved_delta(cfg: ModelConfig, recipe: Recipe, layer: int) -> float:
    """How many bytes per token fewer a block saves for backward under an FP8 recipe than in its compute dtype c:
    Transformer Engine keeps each FP8 GEMM's input for the weight gradient as the FP8 cast it multiplied
    (gemm_input_bytes), not the c-byte tensor. So the norms' outputs into the qkv and the MLP's first projection
    (a LayerNormLinear's output, kept only as its FP8 cast) and the activation's output into the down projection
    (plain and gated units; ReLU keeps its output for its own backward) shrink; the attention output, which the
    attention kernel keeps for its backward, gains the output projection's FP8 copy. A MoE layer: each
    assignment's expert input and product, the shared experts' likewise. Multi-head latent attention's
    projections are left as counted (not modelled)."""
    if not recipe.fp8:
        return 0.0
    c, H, k, e = recipe.compute_bytes, cfg.d_model, cfg.top_k, gemm_input_bytes(recipe)

    def mlp(width: int) -> float:  # its input, and the down projection's
        return (c - e) * H + _fp8_product_delta(cfg, recipe, width)

    attn = 0.0 if cfg.attention == "mla" else (c - e) * H - e * cfg.n_heads * cfg.head_dim
    if not cfg.is_moe_layer(layer):
        return attn + mlp(cfg.ffn_hidden)
    shared = mlp(cfg.n_shared_experts * cfg.expert_ffn_hidden) if cfg.n_shared_experts else 0.0
    return attn + k * mlp(cfg.expert_ffn_hidden) + shared


def _fp8_product_delta(cfg: ModelConfig, recipe: Recipe, width: int) -> float:
    """The down projection's input kept as its FP8 cast, bytes per token fewer (fp8_saved_delta); ReLU keeps
    its output for its own backward, so the cast is kept beside it."""
    c, e = recipe.compute_bytes, gemm_input_bytes(recipe)
    return -e * width if cfg.activation == "relu" and not cfg.gated else (c - e) * width


def mla_saved_bytes(cfg: ModelConfig, recipe: Recipe, checkpointing: str = "none") -> float:
    """Bytes per token trainwise.model.attention.LatentAttention saves for backward (training mode, the
    block's norm1 not included), read off torch.autograd.graph.saved_tensors_hooks, with c = compute
    bytes, H = d_model, Q = q_lora_rank, C = kv_lora_rank, r = qk_rope_head_dim, d = the query's head dim
    (qk_nope + r), dv = v_head_dim, nh heads:
      the input of the two down projections cH (under autocast cast once for each: 2cH);
      each latent RMSNorm (in fp32, also under autocast): its input 4Q (4C; without autocast the kv input
        is a view of the whole down projection's output, 4(C + r)), x*rsqrt 4Q, rsqrt 4, and its output
        as the up projection's input cQ (cC); without q_lora_rank no query norm: q_proj shares the input;
      under autocast the RoPE tables cast to c: rc;
      SDPA (flash): q, k and v padded to d (each c nh d), logsumexp 4 nh and its output c nh d (both
        recomputed under selective checkpointing); the output's first dv columns copied as o_proj's input
        c nh dv."""
    c, H, nh = recipe.compute_bytes, cfg.d_model, cfg.n_heads
    Q, C, r, dv = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    d = cfg.qk_nope_head_dim + r
    autocast = c != recipe.residual_bytes
    inputs = (2 if autocast else 1) * c * H
    q_norm = (4 * Q + 4 * Q + 4 + c * Q) if Q else 0
    kv_norm = (4 * C if autocast else 4 * (C + r)) + 4 * C + 4 + c * C
    rope = r * c if autocast else 0
    core_out = c * nh * d + 4 * nh
    return (inputs + q_norm + kv_norm + rope + 3 * c * nh * d + (core_out if checkpointing != "selective" else 0)
            + c * nh * dv)


def megatron_lean_bytes(cfg: ModelConfig, recipe: Recipe, layer: int) -> tuple[float, float, float]:
    """Bytes per token a block of Megatron-Core (Transformer Engine's modules) keeps fewer than trainwise's, as
    (its two norms, its MoE layer's routing, its experts): a fused RMSNorm keeps its input and rsigma, not also
    x * rsqrt (sH each; a LayerNorm the same as trainwise's); a MoE layer weights each routed copy in its experts'
    fused activation, before the down projection, so its unpermute keeps no expert outputs (top_k x cH), and its
    router keeps its compute-dtype input, not an fp32 copy ((4 - c) H); that fused activation keeps only its input
    (and the weights) and computes the rest again in backward, so gpt-oss's clamped SwiGLU keeps no act(gate)
    (top_k x cF; a SwiGLU's fused kernel keeps what trainwise's does)."""
    c, s, H = recipe.compute_bytes, recipe.residual_bytes, cfg.d_model
    norms = 2 * s * H if cfg.norm == "rmsnorm" else 0
    if not cfg.is_moe_layer(layer):
        return norms, 0.0, 0.0
    F = cfg.expert_ffn_hidden
    experts = cfg.top_k * (unit_saved_bytes(cfg, c, F) - unit_saved_bytes(cfg, c, F, fused=True))
    return norms, cfg.top_k * c * H + (4 - c) * H, experts


def moe_saved_bytes(cfg: ModelConfig, recipe: Recipe, expert_mlp: float) -> float:
    """Bytes per token trainwise.model.moe.MoE saves for backward (training mode, shared experts not
    included), read off torch.autograd.graph.saved_tensors_hooks; the same for the torch._grouped_mm
    and the loop-over-experts dispatch. c = compute bytes, k = top_k, E = n_experts:
      router: its fp32 input 4H (tokens.float(): a copy unless the norm output is fp32 already; then it
        is that output, which nothing else in a MoE layer saves), the fp32 logits 4E (logsumexp of the
        z-loss, computed also when its coefficient is 0) and the softmax probabilities 4E, logsumexp's
        output 4;
      routing indices, int64: the top-k choices, the dispatch order and the token of each assignment,
        8k each = 24k; renormalize_top_k: the top-k weights 4k and their sum 4; the weights gathered
        in dispatch order ck;
      dispatch: the grouped expert input (the dispatch buffer, or its cast under autocast) kcH and the
        expert outputs before weighting (saved by the weighting multiply) kcH (the combine, model.moe.CombineRows,
        keeps only its index); each assignment's expert MLP: k x expert_mlp.
    With a capacity limit (dropless=False) the k terms are an upper bound: dropped assignments save
    nothing. Sigmoid gating saves a little more (sigmoid output and its normalisation, O(E)). Groups as
    routed: a CPU's padded ones (model.moe.GROUP_SIZES) save more, uncounted (tests/test_moe_memory.py)."""
    c, H, E, k = recipe.compute_bytes, cfg.d_model, cfg.n_experts, cfg.top_k
    router = 4 * H + 8 * E + 4
    routing = 24 * k + (4 * k + 4 if cfg.renormalize_top_k else 0) + c * k
    return router + routing + 2 * k * c * H + k * expert_mlp


def matmul_weight_params(cfg: ModelConfig, layer: int) -> int:
    """Matmul weights of one block that autocast casts to the compute dtype: attention + the MLP, or for
    a MoE layer every routed expert's weights (torch._grouped_mm takes the stacked weights whole, the
    loop casts each expert's slice) + the shared experts; the router runs in fp32 (no copy)."""
    if not cfg.is_moe_layer(layer):
        return attention_params(cfg) + mlp_params(cfg.d_model, cfg.ffn_hidden, cfg.gated, bias=False)
    F = cfg.expert_ffn_hidden
    experts = cfg.n_experts * mlp_params(cfg.d_model, F, cfg.gated, bias=False)
    shared = mlp_params(cfg.d_model, cfg.n_shared_experts * F, cfg.gated, bias=False) if cfg.n_shared_experts else 0
    return attention_params(cfg) + experts + shared


def block_matmul_params(cfg: ModelConfig) -> int:
    """The matmul weights of every block (matmul_weight_params summed over the layers): what autocast casts, and
    what an FP8 recipe multiplies in FP8."""
    return sum(matmul_weight_params(cfg, i) for i in range(cfg.n_layers))


def autocast_weight_bytes(cfg: ModelConfig, recipe: Recipe, checkpointing: str = "none") -> int:
    """Under autocast each Linear's weight is cast to the compute dtype once per forward, and the copy is
    saved for backward: c x (matmul weights) of every block (none under full checkpointing: a block's
    are recast when it is recomputed, see recompute_bytes) plus the LM head's V x H. 0 without autocast."""

    c = recipe.compute_bytes
    if c == recipe.residual_bytes:
        return 0
    blocks = 0 if checkpointing in ("full", "op") else block_matmul_params(cfg)
    return c * (blocks + cfg.vocab_size * cfg.d_model)


def op_saved_bytes(cfg: ModelConfig, recipe: Recipe) -> float:
    """Bytes per token one dense block keeps under op-level selective checkpointing
    (runtime.parallelize._op_policy): the block's input sH (the checkpointed region's input); the outputs of
    its odd matmuls, the projections run unfused: q cq and v c kv (k, the 2nd, and the output projection,
    the 4th, are recomputed), gate cF and down cH (gated; up, the 6th, recomputed) or the MLP's first
    matrix cF (plain: its second, the 6th, recomputed); attention's output cq and logsumexp 4nh.
    Everything else, the autocast weight copies included, is recomputed in backward."""
    c, s, H, F = recipe.compute_bytes, recipe.residual_bytes, cfg.d_model, cfg.ffn_hidden
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return s * H + c * (q + kv) + c * q + 4 * cfg.n_heads + c * (F + (H if cfg.gated else 0))


def compiled_block_bytes_per_token(cfg: ModelConfig, recipe: Recipe, layer: int, seq_len: int,
                                   checkpointing: str = "none") -> float:
    """What a whole-model torch.compile (inductor, default min-cut partitioner) saves per token of one
    dense block on a CPU, read off saved_tensors_hooks on the compiled graph: the partitioner recomputes
    the cheap pointwise work (norms, RoPE, SiLU) in backward and saves the matmul operands instead:
      attention (explicit_attention, used on CPU under compile): q and the kv heads repeated to nh heads
        c(q + 2 nh hd), and the fp32 softmax probabilities 4 nh T (a T x T term, unlike SDPA's flash;
        selective checkpointing recomputes them);
      MLP: the fused gate|up output 2cF and the product cF (plain MLP: act input and output 2cF);
      the residual stream and norm outputs: 3 sH + 3 cH.
    Autocast's weight casts are saved as in eager mode (autocast_weight_bytes).
    MoE layers and MLA break the graph or keep eager kernels: their eager bytes
    (activation_bytes_per_token_layer)."""
    if cfg.is_moe_layer(layer) or cfg.attention == "mla":
        return activation_bytes_per_token_layer(cfg, recipe, layer, checkpointing)
    c, s, H, nh, hd = recipe.compute_bytes, recipe.residual_bytes, cfg.d_model, cfg.n_heads, cfg.head_dim
    attn = c * 3 * nh * hd + (4 * nh * seq_len if checkpointing == "none" else 0)
    mlp = (3 if cfg.gated else 2) * c * cfg.ffn_hidden
    return attn + mlp + 3 * s * H + 3 * c * H


def activation_bytes(cfg: ModelConfig, recipe: Recipe, micro_batch: int, seq_len: int,
                     checkpointing: str = "none", tp: int = 1, compiled: bool = False,
                     loss_kernel: str | None = None) -> int:
    """Per micro-batch activation bytes on one device.

    none/selective: sum over layers of the per-token-layer bytes x B x T.
    full: each block keeps only its input (s x B x T x H) (Chen et al. 2016; Korthikanti et al. 2022
      section 4.3); one block's activations while it is recomputed in backward are in peak_bytes.
    Always: token ids and targets (int64, 16 bytes/token); the final norm; the LM head input cH; the
      fp32 log-softmax output B x T x V (4V) that cross-entropy saves, or with model.loss_chunk_tokens
      only the fp32 logsumexp (4 bytes/token), or compiled or another stack's `loss_kernel` its own
      (cost.loss.loss_saved_bytes_per_token); under autocast, the weight copies (autocast_weight_bytes).
    With pipeline parallelism under 1F1B the first stage holds pp micro-batches of L/pp layers, i.e. the
    same L-layer total (Korthikanti section 4.2.3); tensor parallelism with sequence parallelism
    divides everything by tp."""
    if checkpointing not in ("none", "selective", "op", "full"):
        raise TrainwiseError(f"--checkpointing '{checkpointing}' must be none, selective, op or full.")
    tokens = micro_batch * seq_len
    if checkpointing == "full":
        layers = cfg.n_layers * recipe.residual_bytes * cfg.d_model
    elif compiled and checkpointing != "op":
        layers = sum(compiled_block_bytes_per_token(cfg, recipe, i, seq_len, checkpointing)
                     for i in range(cfg.n_layers))
    else:
        layers = sum(activation_bytes_per_token_layer(cfg, recipe, i, checkpointing) for i in range(cfg.n_layers))
    head = 16 + norm_saved_bytes(cfg, recipe.residual_bytes) + recipe.compute_bytes * cfg.d_model
    head += L.loss_saved_bytes_per_token(cfg, recipe, L.loss_kernel(cfg, compiled, loss_kernel))
    weights = autocast_weight_bytes(cfg, recipe, checkpointing)
    return math.ceil((tokens * (layers + head) + weights) / tp)


def mlp_backward_bytes(cfg: ModelConfig, recipe: Recipe, tokens: int) -> int:
    """The most an MLP's backward holds beside the saved activations at the step's peak: the gradient of its
    down projection's input and one more as wide (the next gradient of GatedUnit or of the plain activation),
    c F each per token (measured: tests/test_chunked_ce.py, where the loss's scratch is smaller); a MoE
    layer's routed experts top_k of them per token at their width."""
    c = recipe.compute_bytes
    return max(tokens * 2 * c * (cfg.top_k * cfg.expert_ffn_hidden if cfg.is_moe_layer(i) else cfg.ffn_hidden)
               for i in _distinct_layers(cfg))


def recompute_bytes(cfg: ModelConfig, recipe: Recipe, tokens: int, tp: int = 1, checkpointing: str = "full") -> int:
    """Full checkpointing: one block's activations (and, under autocast, its weight copies) rebuilt in
    backward while that block's gradients are computed; op-level: the part of them it did not keep."""
    weights = recipe.compute_bytes if recipe.compute_bytes != recipe.residual_bytes else 0
    kept = op_saved_bytes(cfg, recipe) if checkpointing == "op" else 0
    if checkpointing == "op" and cfg.gated and cfg.activation != "clamped_swiglu":  # model.layers.MLP.act_recomputed:
        kept -= recipe.compute_bytes * cfg.ffn_hidden  # autograd's two nodes, which keep act(gate) as well
    return math.ceil(max(tokens * (activation_bytes_per_token_layer(cfg, recipe, i) - kept)
                         + weights * matmul_weight_params(cfg, i)
                         for i in _distinct_layers(cfg)) / tp)


def eval_peak_bytes(cfg: ModelConfig, recipe: Recipe, resident: int, micro_batch: int, seq_len: int) -> int:
    """Peak of an evaluation forward (no_grad: nothing is saved for backward) beside the `resident` bytes
    (params + optimizer states between steps): the loss's N x V tensors at once, N = B x T: the logits
    cV, their fp32 copy 4V when c is not fp32 (logits.float()) and the fp32 log-softmax 4V, plus the
    final hidden states (the LM head input) sH and, under autocast, the LM head's weight cast cVH. The
    chunked loss holds one chunk's fp32 logits instead."""
    tokens, V, c, s = micro_batch * seq_len, cfg.vocab_size, recipe.compute_bytes, recipe.residual_bytes
    cast = c * V * cfg.d_model if c != s else 0
    if cfg.loss_chunk_tokens:
        return resident + cast + tokens * s * cfg.d_model + 8 * V * min(cfg.loss_chunk_tokens, tokens)
    return resident + cast + tokens * (c * V + (4 * V if c != 4 else 0) + 4 * V + s * cfg.d_model)


def kv_cache_bytes(cfg: ModelConfig, batch: int, dtype_bytes: int) -> int:
    """trainwise.model.KVCache of every layer for max_seq_len positions, allocated whole on first use:
    keys and values, 2 x L x B x n_kv_heads x max_seq_len x head_dim x bytes; MLA keeps the compressed
    latent and the one rotated key head instead, L x B x max_seq_len x (kv_lora_rank + qk_rope_head_dim)
    x bytes (DeepSeek-V2 section 2.1.2: 576 numbers per token and layer for DeepSeek-V3)."""
    per_position = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla"
                    else 2 * cfg.n_kv_heads * cfg.head_dim)
    return cfg.n_layers * batch * cfg.max_seq_len * per_position * dtype_bytes


def sample_peak_bytes(cfg: ModelConfig, resident: int, batch: int, prompt_tokens: int, dtype_bytes: int = 4) -> int:
    """Peak of Transformer.generate beside the `resident` bytes: the KV cache + the prefill's logits,
    which the LM head computes for every prompt position (4V per token, fp32 weights) beside its input."""
    tokens = batch * min(prompt_tokens, cfg.max_seq_len)
    return resident + kv_cache_bytes(cfg, batch, dtype_bytes) + tokens * dtype_bytes * (cfg.vocab_size + cfg.d_model)


def _distinct_layers(cfg: ModelConfig) -> list[int]:
    """One dense and one MoE layer index (their per-token bytes differ), whichever exist."""
    out = {}
    for i in range(cfg.n_layers):
        out.setdefault(cfg.is_moe_layer(i), i)
        if len(out) == 2:
            break
    return list(out.values())


@dataclass(frozen=True)
class TensorSize:
    shape: tuple[int, ...]
    dtype: str
    bytes: int

    @property
    def mb(self) -> float:
        return self.bytes / 1e6

    @property
    def mib(self) -> float:
        return self.bytes / 2**20


def tensor_bytes(shape: tuple[int, ...] | list[int], dtype: str) -> TensorSize:
    """numel x element size. (8,1024,4096) bf16 = 67,108,864 bytes = 64 MiB = 67.1 MB."""
    if dtype not in DTYPE_BYTES:
        raise TrainwiseError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPE_BYTES)}.")
    shape = tuple(int(d) for d in shape)
    if not shape or any(d <= 0 for d in shape):
        raise TrainwiseError(f"shape {shape} must be one or more positive sizes, e.g. 8,1024,4096.")
    return TensorSize(shape, dtype, math.prod(shape) * DTYPE_BYTES[dtype])
