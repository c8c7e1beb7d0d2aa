"""Device and precision recipe: which one a run uses and why."""

from __future__ import annotations

import contextlib
import platform

import torch

from trainwise.errors import TrainwiseError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise TrainwiseError(f"train.device = '{requested}' is not a device; use auto, cpu or cuda.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainwiseError("train.device = 'cuda' but this PyTorch sees no CUDA GPU; use train.device=cpu.")
    return device


def cpu_has_fast_bf16() -> bool:
    """True where the CPU multiplies bf16 natively, about 2x its fp32 speed: on x86 AVX512-BF16 or AMX tiles.
    oneDNN also runs bf16 on an x86 CPU with plain AVX-512, converting to fp32 on the way, and reports it as
    supported; there a bf16 matmul is several times slower than fp32 (benchmarks/RESULTS.md), so that CPU's
    fast recipe is fp32. Elsewhere (Arm), oneDNN's own answer."""
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        cpu = torch.cpu
        if hasattr(cpu, "_is_avx512_bf16_supported") and hasattr(cpu, "_is_amx_tile_supported"):
            return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """(recipe, reason). auto: bf16 autocast where the device multiplies bf16 fast, fp16 + GradScaler on
    CUDA GPUs without bf16, else fp32. Reads the device's type and, on CUDA, the capability of `device` (the
    current device when it has no index), so it can be asked before torchrun's rank selects its GPU."""
    if requested == "fp16" and device.type != "cuda":
        return "fp16", "set in the config (on a CPU fp16 runs as it does on a GPU, loss scaler included, but " \
            "slowly: few CPUs multiply fp16 natively; bf16 is the CPU's fast format)"
    if requested != "auto":
        return requested, "set in the config"
    if device.type == "cuda":
        # is_bf16_supported asks the current device: make it `device` for the question
        with torch.cuda.device(device) if device.index is not None else contextlib.nullcontext():
            bf16 = torch.cuda.is_bf16_supported()
        if bf16:
            return "bf16", "this GPU supports bf16"
        return "fp16", "this GPU has no bf16; fp16 with loss scaling"
    if cpu_has_fast_bf16():
        return "bf16", "this CPU has native bf16 matmuls (AVX512-BF16/AMX)"
    return "fp32", "this CPU has no native bf16 matmuls"


def autocast(device: torch.device, precision: str):
    """Mixed precision context: matmuls in bf16/fp16, weights and the residual stream in fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])
