"""Precision recipes: the bytes per parameter of each model state (parameters, gradients, fp32 master copy,
optimizer moments), the dtypes the forward pass works in, and the optimizers' moment counts. cost.memory sizes
the states and activations from them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainwise.errors import TrainwiseError


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter of each model state, and the dtypes the forward pass works in."""

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int  # fp32 master copy kept beside low-precision params
    moment_bytes: int  # bytes of ONE optimizer moment per parameter
    compute_bytes: int  # matmul inputs/outputs saved for backward
    residual_bytes: int  # the residual stream and norm inputs
    compute_dtype: str  # selects the peak FLOP/s
    description: str
    fp8: str = ""  # the linear layers' GEMMs in FP8, scaled: current | delayed | blockwise | mx ("": none)
    reduce_bytes: int = 0  # bytes per gradient the data-parallel reduction moves (0: grad_bytes)
    fp8_params: bool = False  # the FP8 linear weights are the parameters, 1 byte each (with_fp8_params)

    def record_precision(self, gathered: bool = False) -> str:
        """How a step of this recipe is recorded (measure.record): 16-bit weights and activations ("bf16-pure",
        "fp16-pure": Megatron-LM's, bf16-mixed, the FP8 recipes, whose GEMMs the cluster step then moves to FP8;
        and any recipe whose weights are `gathered` in the compute dtype, FSDP2's mixed-precision policy, under
        which the activations and the residual stream are 16-bit too, as cost.rank_memory prices them), autocast
        over fp32 weights (amp in one process or under DDP), or fp32."""
        if self.compute_dtype == "fp32":
            return "fp32"
        if self.fp8:
            return "bf16-pure"
        return f"{self.compute_dtype}-pure" if self.param_bytes == 2 or gathered else self.compute_dtype


RECIPES = {
    "fp32": Recipe("fp32", 4, 4, 0, 4, 4, 4, "fp32", "fp32 params, grads and optimizer states"),
    "amp": Recipe("amp", 4, 4, 0, 4, 2, 4, "bf16",
                  "fp32 params/grads/states, bf16 autocast matmuls (what trainwise's trainer does for bf16)"),
    "bf16-mixed": Recipe("bf16-mixed", 2, 2, 4, 4, 2, 2, "bf16",
                         "bf16 params and grads + fp32 master weights + fp32 moments (ZeRO paper: 2+2+12)"),
    "bf16-pure": Recipe("bf16-pure", 2, 2, 0, 2, 2, 2, "bf16", "everything bf16, optimizer moments included"),
    # Megatron-LM reduces the 16-bit gradients and copies them to its fp32 main gradients after (without
    # --accumulate-allreduce-grads-in-fp32, as its published fp16 runs ran: examples/academic_paper_scripts/sc21/
    # CONFIG.sh)
    "megatron": Recipe("megatron", 2, 4, 4, 4, 2, 2, "fp16", "Megatron-LM's mixed precision: 16-bit weights and "
                       "activations, fp32 main gradients, master weights and Adam moments (2+4+4+8 = 18 bytes)",
                       reduce_bytes=2),
}
# FP8 training as Megatron-Core runs it with Transformer Engine: the transformer blocks' linear layers compute
# in FP8 (forward and both backward GEMMs), everything else (attention, the LM head, the states) as in bf16
# mixed precision: bf16 weights and activations, fp32 main gradients, master weights and Adam moments.
FP8_SCALINGS = {
    "current": "per-tensor current scaling (TE Float8CurrentScaling, torchao float8's default)",
    "delayed": "per-tensor delayed scaling from an amax history (TE DelayedScaling)",
    "blockwise": "1 x 128 activation and 128 x 128 weight blocks (DeepSeek-V3)",
}
for _scaling, _how in FP8_SCALINGS.items():
    _name = "fp8" if _scaling == "current" else f"fp8-{_scaling}"
    RECIPES[_name] = Recipe(_name, 2, 4, 4, 4, 2, 2, "fp8", f"FP8 linear layers, {_how}, over bf16 weights and "
                            "activations; fp32 main gradients, master weights and Adam moments", fp8=_scaling)
RECIPES["mxfp8"] = Recipe("mxfp8", 2, 4, 4, 4, 2, 2, "fp8", "MXFP8 linear layers (1 x 32 blocks, E8M0 scales: "
                          "Blackwell tensor cores) over bf16 weights and activations; fp32 main gradients, master "
                          "weights and Adam moments", fp8="mx")
RECIPE_ALIASES = {"bf16": "bf16-mixed", "mixed": "bf16-mixed", "fp16": "bf16-mixed", "fp16-mixed": "bf16-mixed",
                  "pure-bf16": "bf16-pure", "autocast": "amp", "auto": "amp", "float32": "fp32"}
OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


def get_recipe(name: str) -> Recipe:
    key = RECIPE_ALIASES.get(name, name)
    if key not in RECIPES:
        raise TrainwiseError(f"unknown precision '{name}'; choose one of "
                             f"{', '.join(list(RECIPES) + list(RECIPE_ALIASES))}.")
    return RECIPES[key]


# The dtype a recipe's main gradients accumulate and are reduced in (with_grad_dtype)
GRAD_DTYPES = {"fp32": 4, "bf16": 2}


def with_grad_dtype(recipe: Recipe, dtype: str) -> Recipe:
    """`recipe` with its main gradients in `dtype`: the buffer the micro-batches accumulate into and the
    data-parallel reduction moves (Megatron-Core's --grad-reduce-in-bf16, which Megatron-Bridge's performance
    recipes set as grad_reduce_in_fp32 = False; the optimizer steps the fp32 master with them). Only a recipe with
    16-bit weights and an fp32 master keeps gradients apart from its parameters; under fp32, amp or bf16-pure the
    gradients are the parameters' own, in their dtype."""
    if dtype not in GRAD_DTYPES:
        raise TrainwiseError(f"--grad-dtype {dtype}: choose one of {', '.join(GRAD_DTYPES)}.")
    if GRAD_DTYPES[dtype] == recipe.grad_bytes == (recipe.reduce_bytes or recipe.grad_bytes):
        return recipe
    if not recipe.master_bytes:
        raise TrainwiseError(
            f"--grad-dtype {dtype}: under --precision {recipe.name} the gradients are the parameters' own, in their "
            f"dtype ({recipe.grad_bytes} bytes); main gradients of another dtype need 16-bit weights with an fp32 "
            "master copy: --precision megatron, bf16-mixed, fp8 or mxfp8, or drop --grad-dtype.")
    return replace(recipe, grad_bytes=GRAD_DTYPES[dtype], reduce_bytes=0,
                   description=f"{recipe.description}; main gradients in {dtype} instead (accumulated and reduced "
                               f"in {dtype})")


def with_fp8_params(recipe: Recipe) -> Recipe:
    """`recipe` with its FP8 GEMMs' weights kept as FP8 parameters (Megatron-Core's --fp8-param-gather, Transformer
    Engine's fp8_model_init; Megatron-Bridge's FP8 current-scaling recipe sets fp8_param_gather): each such weight
    is its 1-byte FP8 cast, written from the optimizer's fp32 master after each step and gathered by data
    parallelism in FP8, with no bf16 copy beside it; the other parameters (embeddings, norms, the router, the LM
    head) stay in the recipe's dtype. cost.memory.fp8_weight_bytes keeps the transpose alone."""
    if not recipe.fp8:
        raise TrainwiseError(
            f"--fp8-params keeps the FP8 linear layers' weights as FP8 parameters, but the precision is {recipe.name}, "
            "which has no FP8 GEMMs: add --precision fp8 (or mxfp8 on Blackwell), or drop --fp8-params.")
    return replace(recipe, fp8_params=True, description=f"{recipe.description}; the FP8 linear weights kept as FP8 "
                                                        "parameters (1 byte), gathered in FP8")


def optimizer_moments(optimizer: str) -> int:
    """AdamW keeps two moments (m, v), SGD with momentum one, plain SGD none."""
    if optimizer not in OPTIMIZER_MOMENTS:
        raise TrainwiseError(f"unknown optimizer '{optimizer}'; choose one of {', '.join(OPTIMIZER_MOMENTS)}.")
    return OPTIMIZER_MOMENTS[optimizer]


def fsdp2_zero2_recipe(recipe: Recipe) -> Recipe:
    """ZeRO-2 as FSDP2 runs it (fully_shard with reshard_after_forward=False, trainwise's zero2): the
    parameters rest as fp32 shards, which are the optimizer's master copy (4 B, sharded); the copy gathered
    for forward, in the compute dtype, is kept until backward on every rank: ZeRO-2's replicated params;
    gradients are reduce-scattered and kept in fp32 (4 B, sharded). With the "amp" recipe that is the
    ZeRO paper's mixed-precision layout but for fp32 gradients: 2 + (4 + 4 + 8) / dp bytes per parameter."""
    return replace(recipe, name=f"{recipe.name}, FSDP2 zero2", param_bytes=recipe.compute_bytes, grad_bytes=4,
                   reduce_bytes=0, master_bytes=4, description=f"{recipe.description}; FSDP2 zero2 layout")
