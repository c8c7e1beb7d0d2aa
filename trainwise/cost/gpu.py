"""Operator times on a GPU from published kernel figures (trainwise.hardware.table), no GPU needed:

    matmul      waves of output tiles over the SMs, each SM at the MAMF rate: tiles = batch x ceil(M/tm) x
                ceil(N/tn) for cuBLAS's tiles, 256 x 128 either way round or 128 x 128 (NVIDIA, "Matrix
                Multiplication Background User's Guide" section 2.3), whichever finishes first; a tile takes
                2 tm tn (K + GEMM_K_OVERHEAD) / (MAMF / SMs), its prologue and epilogue counted as extra K; a
                call takes GEMM_LAUNCH_S more, and at least its operands' bytes at the copy bandwidth. The
                wave term is what makes a 1024^3 bf16 matmul on an A100 run at a third of a 8192^3 one
                (NVIDIA's cuBLAS curve, "CUDA 11 Features Revealed" Fig. 6: 88 vs 291 TFLOP/s); the K term
                is what makes an H100's 4096 x 4096 x 256 run at half its 4096^3 rate (XLA's sm_90 matmul
                table, 392 vs 783 TFLOP/s). Tests hold the model to both.
    attention   the flash kernel at FlashAttention-2's published forward+backward rate for its sequence
                length and head dim (Dao 2023), counted as that paper counts FLOPs (causal: half of
                4 T^2 hd heads forward; backward 2.5x forward); FlashAttention-3 and cuDNN on Hopper at
                their speed-up over it in one paper's panels; on Blackwell each kernel's own rates measured on the B200
                (cuDNN the default kernel there)
    the rest    bytes moved / (HBM bandwidth x the copy fraction): element-wise kernels, the fused AdamW
                update, casts; under a fusing stack, the bytes its fused kernels move (cost.ops.Op.fused)

Compute dtype fp32 runs on the non-tensor-core rate (trainwise leaves TF32 off), scaled by the same
MAMF share of peak. A GPU without published FlashAttention-2 rates takes the A100's, scaled by its
MAMF over the A100's (an inference, said in the op's rule). A GPU held under its datasheet's power (its
clock_share below 1) runs every tensor-core kernel at that share of these rates.
A device without a published core count (the TPUs) runs every matmul at the large-matmul rate, without waves.
"""

from __future__ import annotations

import math

from trainwise.cost.ops import Op
from trainwise.errors import TrainwiseError
from trainwise.hardware.table import (ACCELERATORS, ATTENTION_TFLOPS, DEFAULT_ATTENTION, FP8_ATTENTION_TFLOPS,
                                      HOPPER_ATTENTION_TFLOPS, KERNEL_ATTENTION_TFLOPS, Accelerator,
                                      measured_on, table_gpus)

TILES = ((256, 128), (128, 256), (128, 128))  # cuBLAS's tiles (the guide above)
# A tile's prologue and epilogue as K-iterations, and a call's fixed cost: two values fitted at once across two
# published sets, XLA's sm_90 bf16 matmul table (48 shapes, batch 1-4, M, N 1,024-4,096, K 256-4,096:
# openxla/xla gpu/model/matmul_interpolator_data.h; median error 4.9%, worst 9.8%) and NVIDIA's A100 cuBLAS curve
# (4 sizes: within 19%). Both sets are in tests/test_cluster.py.
GEMM_K_OVERHEAD = 88
GEMM_LAUNCH_S = 6e-6
DEFAULT_COPY_FRACTION = 0.75  # where a GPU has no published copy figure: H100 SXM's (hardware.table)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
FP32_AS_BF16_PASSES = 6  # an fp32 matmul on a device with bf16 units only (jax.lax.Precision.HIGHEST on TPUs)


def matmul_rate(acc: Accelerator, dtype: str) -> float:
    """FLOP/s a large well-shaped matmul reaches: MAMF (bf16/fp16), or the fp32 or FP8 peak at MAMF's
    share. FP8: the share carries over where FP8 GEMMs were measured (H100 SXM, cuBLASLt 8192^3 E4M3: 1,609
    TFLOP/s, 81% of 1,979, beside bf16's 80%; H800 block-scaled DeepGEMM: up to 1,550 TFLOP/s, its README), so
    per-tensor and block scaling run at one rate. The MAMF source's own FP8 sweep reads lower (H100 SXM 1,402.6
    TFLOP/s, 70.9%; B200 3,432.5, 76.3%); planned at it, the development set's FP8 rows read slower than
    published and no in-step factor brings the families within their targets together (benchmarks/RESULTS.md,
    "FP8 GEMMs at the MAMF sweep's rate")."""
    half = acc.peak("bf16")
    mamf = (acc.mamf or half * 0.8) * acc.clock_share  # no MAMF published: 80%, the H100's (hardware.table)
    if dtype in ("bf16", "fp16"):
        return mamf
    if dtype == "fp8":
        return acc.peak("fp8") * mamf / half
    if "fp32" not in acc.peak_flops:  # the TPUs: XLA's HIGHEST precision, fp32 as 6 bf16 passes (jax.lax.Precision)
        return mamf / FP32_AS_BF16_PASSES
    return acc.peak("fp32") * mamf / half


def copy_bandwidth(acc: Accelerator) -> float:
    """Bytes/s a memory-bound kernel moves: HBM bandwidth x the copy fraction."""
    return acc.bandwidth_bytes_per_s * (acc.copy_fraction or DEFAULT_COPY_FRACTION)


def matmul_seconds(batch: int, m: int, k: int, n: int, acc: Accelerator, dtype: str) -> float:
    """One (batched) matmul (batch, M, K) x (batch, K, N): tile waves at the MAMF rate, each tile's K
    lengthened by its prologue and epilogue, plus the call's fixed cost (module docstring); at least its
    operands and result moved once at the copy bandwidth."""
    if acc.sms is None:  # no published count of its cores (the TPUs): no waves, the rate throughout
        compute = 2.0 * batch * m * k * n / matmul_rate(acc, dtype)
    else:
        per_sm = matmul_rate(acc, dtype) / acc.sms
        tile_flops = min(math.ceil(batch * math.ceil(m / tm) * math.ceil(n / tn) / acc.sms) * tm * tn
                         for tm, tn in TILES)  # the waves' output elements per SM
        compute = 2.0 * tile_flops * (k + GEMM_K_OVERHEAD) / per_sm + GEMM_LAUNCH_S
    nbytes = ELEMENT_BYTES.get(dtype, 4) * batch * (m * k + k * n + m * n)
    return max(compute, nbytes / copy_bandwidth(acc))


def check_attention(impl: str, acc: Accelerator | None) -> None:
    """A TrainwiseError unless `acc` has published rates for the attention kernel `impl`: FlashAttention-3
    runs on Hopper only, and cuDNN's fused attention is published on Hopper and Blackwell (the B200) only."""
    key = acc.attention if acc is not None else None
    cudnn = key in ("fa2-h100", "b200")
    where = f"the {acc.name}" if acc is not None else "a device priced by its calibration or a given peak"
    if impl == "cudnn-fp8" and not (cudnn and "fp8" in acc.peak_flops):
        raise TrainwiseError(
            f"--fp8-attention runs cuDNN's FP8 attention, whose rates are published for Hopper (H100, H200, H800) "
            f"and Blackwell (measured on the B200) only, and this plan is on {where}. Drop --fp8-attention "
            "(attention in bf16) or plan one of them.")
    if (impl == "flash3" and key != "fa2-h100") or (impl == "cudnn" and not cudnn):
        what = "FlashAttention-3 runs on Hopper GPUs only" if impl == "flash3" else (
            "cuDNN's fused attention has published rates on Hopper and Blackwell (measured on the B200) only")
        raise TrainwiseError(
            f"--attention-impl {impl}: {what}, and this plan is on {where}. Use --attention-impl flash (the "
            "GPU's default fused kernel) or plan a table H100, H200, H800"
            + (f" or a Blackwell ({table_gpus(lambda a: a.attention == 'b200')})." if impl == "cudnn" else "."))


def _interpolate(by_t: dict[int, float], seq_len: int) -> float:
    """A rate published at a few sequence lengths, interpolated in log T, held at the ends."""
    ts = sorted(by_t)
    t = min(max(seq_len, ts[0]), ts[-1])
    for lo, hi in zip(ts, ts[1:]):
        if lo <= t <= hi:
            w = math.log(t / lo) / math.log(hi / lo)
            return by_t[lo] * (1 - w) + by_t[hi] * w
    return by_t[ts[0]]


def _forward_backward(tables: tuple[dict[int, float], dict[int, float]], seq_len: int) -> float:
    """An attention kernel's forward+backward TFLOP/s from its published (forward, backward) rates: the FLOPs of
    both over their times, backward 2.5x the forward's FLOPs."""
    forward, backward = (_interpolate(table, seq_len) for table in tables)
    return 3.5 / (1 / forward + 2.5 / backward)


def attention_rate(acc: Accelerator, seq_len: int, head_dim: int, impl: str = "flash") -> tuple[float, str]:
    """(FLOP/s, where from) of causal flash attention, forward+backward, as FlashAttention-2 counts FLOPs:
    its published rate at the nearest head dim (64 or 128), interpolated in log T, held at the ends.
    FlashAttention-3 and cuDNN on Hopper: that rate times the kernel's speed-up over FlashAttention-2 in the
    FlashAttention-3 paper's head-dim-128 panels (same GPU, same shapes), at the same sequence length. The
    Blackwell GPUs: each kernel's rates measured on the B200 (flash: its default, cuDNN's). cudnn-fp8:
    cuDNN's rate times FP8's speed-up over bf16 in one measured run of its generation."""
    if impl == "cudnn-fp8":  # cuDNN's bf16 rate x FP8's speed-up over it, forward and backward, in one run
        check_attention(impl, acc)
        bf16, fp8 = FP8_ATTENTION_TFLOPS["b200" if acc.attention == "b200" else "hopper"]
        rate, how = attention_rate(acc, seq_len, head_dim, "cudnn")
        return rate * _forward_backward(fp8, seq_len) / _forward_backward(bf16, seq_len), (
            f"{how}, x cuDNN's FP8 speed-up over bf16 (NVIDIA cudnn-frontend, "
            f"{'B200' if acc.attention == 'b200' else 'H200'})")
    key, scale, how = acc.attention, 1.0, "FlashAttention-2 published rate"
    if key in KERNEL_ATTENTION_TFLOPS:  # each kernel's own measured rates (head dim 128 only)
        kernel = DEFAULT_ATTENTION.get(key, "flash2") if impl == "flash" else impl
        check_attention(kernel, acc)
        how = (f"{'cuDNN' if kernel == 'cudnn' else 'FlashAttention-2'} measured forward and backward rates "
               f"(NVIDIA cudnn-frontend, {measured_on(acc)}, head dim 128)")
        if acc.clock_share != 1.0:
            how += f" x its clock share {acc.clock_share:.3f}"
        return acc.clock_share * 1e12 * _forward_backward(KERNEL_ATTENTION_TFLOPS[key][kernel], seq_len), how
    if impl in ("flash3", "cudnn"):
        check_attention(impl, acc)
        scale = (_forward_backward(HOPPER_ATTENTION_TFLOPS[impl], seq_len)
                 / _forward_backward(HOPPER_ATTENTION_TFLOPS["flash2"], seq_len))
        how = (f"FlashAttention-2 published rate x the {'FlashAttention-3' if impl == 'flash3' else 'cuDNN'} "
               "speed-up over it (Shah et al. 2024, H100, head dim 128)")
    if key is None:  # (matmul_rate holds the clock share)
        key, scale = "fa2-a100", matmul_rate(acc, "bf16") / matmul_rate(ACCELERATORS["a100-80gb"], "bf16")
        how = "FlashAttention-2 A100 rate x this GPU's MAMF / the A100's (no published rate)"
    elif acc.clock_share != 1.0:
        scale *= acc.clock_share
        how += f" x its clock share {acc.clock_share:.3f}"
    table = ATTENTION_TFLOPS[key]
    by_t = table[min(table, key=lambda hd: abs(hd - head_dim))]
    return scale * 1e12 * _interpolate(by_t, seq_len), how


def op_seconds(op: Op, acc: Accelerator, fused: bool = False) -> tuple[float, str]:
    """Seconds of all calls of one operator on `acc`, and the rule used (module docstring); `fused`: as a
    stack that fuses element-wise work runs it (cost.ops.Op.fused)."""
    if op.cls == "matmul" and op.shape is not None:
        batch, m, k, n = op.shape
        return op.calls * matmul_seconds(batch, m, k, n, acc, op.dtype), "matmul: tile waves at MAMF"
    if op.cls == "attention" and op.shape is not None:
        _, _, _, seq_len, head_dim = op.shape[:5]
        rate, how = attention_rate(acc, seq_len, head_dim, op.kernel or "flash")
        # trainwise's FLOP counter: forward 4 T^2 hd heads (causal not halved), backward 2x forward; the
        # FlashAttention papers: causal halved, backward 2.5x forward
        share = 0.625 if "backward" in op.name else 0.5
        return share * op.flops / rate, how
    return op.moved(fused) / copy_bandwidth(acc), "bytes / copy bandwidth"
