"""The one table of accelerators: dense peak FLOP/s per dtype, memory bandwidth and capacity.

Figures are dense (no 2:4 sparsity), per device as PyTorch sees it. Each figure carries its source;
the collected evidence (and where public tables disagree) is in shared/reference/accelerators.md.
"fp32" is the non-tensor-core FP32 rate; "tf32" the TF32 tensor-core rate where one exists.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from trainwise.errors import TrainwiseError

T = 1e12
GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s
    bandwidth_bytes_per_s: float | None
    memory_bytes: int | None
    note: str = ""

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype; fp16 falls back to bf16 and vice versa."""
        for key in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype)):
            if key in self.peak_flops:
                return self.peak_flops[key]
        raise TrainwiseError(
            f"no published {dtype} peak for {self.name} (known: {', '.join(self.peak_flops)}); "
            "pass --peak-flops P to give one."
        )


ACCELERATORS: dict[str, Accelerator] = {
    # V100 SXM2 32GB: "up to 125 Tensor TFLOPS" FP16 (developer.nvidia.com "Programming Tensor Cores");
    # FP32 15.7 (Cornell CVW); 900 GB/s, 32 GB (scaling-book gpus.md). No bf16 tensor cores.
    "v100": Accelerator("V100", {"fp16": 125 * T, "fp32": 15.7 * T}, 900 * GB, 32 * GB),
    # A100 SXM 40GB: NVIDIA A100 datasheet via glennklockwood.com/garden/processors/A100:
    # BF16 312, TF32 156, FP32 19.5 TFLOP/s; 1,555 GB/s HBM2 (upb-pc2 wiki); 40 GB.
    "a100-40gb": Accelerator("A100 40GB", {"bf16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}, 1555 * GB, 40 * GB),
    # A100 SXM 80GB: same compute (NVIDIA datasheet); 2,039 GB/s HBM2e (glennklockwood), 80 GB.
    "a100-80gb": Accelerator("A100 80GB", {"bf16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}, 2039 * GB, 80 * GB),
    # H100 SXM: NVIDIA H100 table (hpctech.co.jp copy; "* with sparsity, 1/2 without"): BF16 989.4,
    # TF32 494.7, FP8 1,979, FP32 66.9 TFLOP/s; 3.35 TB/s HBM3; 80 GB.
    "h100-sxm": Accelerator("H100 SXM", {"bf16": 989.4 * T, "tf32": 494.7 * T, "fp8": 1979 * T, "fp32": 66.9 * T},
                            3.35e12, 80 * GB),
    # H100 PCIe: same NVIDIA table: BF16 756, TF32 378, FP8 1,513, FP32 51; 2.0 TB/s HBM2e; 80 GB.
    "h100-pcie": Accelerator("H100 PCIe", {"bf16": 756 * T, "tf32": 378 * T, "fp8": 1513 * T, "fp32": 51 * T},
                             2.0e12, 80 * GB),
    # H200 SXM: NVIDIA H200 spec (lzwjava copy; scaling-book): BF16 989, FP8 1,979 dense; 4.8 TB/s; 141 GB.
    "h200": Accelerator("H200", {"bf16": 989 * T, "tf32": 494.7 * T, "fp8": 1979 * T, "fp32": 67 * T},
                        4.8e12, 141 * GB),
    # H800 SXM: same GH100 compute as H100 SXM (secondary sources philisun.com; no NVIDIA datasheet
    # read), NVLink cut to 400 GB/s; 3.35 TB/s HBM3, 80 GB.
    "h800": Accelerator("H800", {"bf16": 989 * T, "tf32": 494.7 * T, "fp8": 1979 * T, "fp32": 67 * T},
                        3.35e12, 80 * GB, note="secondary source only"),
    # B200 (HGX, 1000 W): glennklockwood B200 (NVIDIA figures): BF16 2,250, FP8 4,500, TF32 1,100,
    # FP32 80 TFLOP/s; 8 TB/s; 192 GB HBM3e (another NVIDIA table: 180 GB, 7.7 TB/s).
    "b200": Accelerator("B200", {"bf16": 2250 * T, "tf32": 1100 * T, "fp8": 4500 * T, "fp32": 80 * T},
                        8.0e12, 192 * GB),
    # L4: NVIDIA L4 datasheet (nanochat 121e12; sourcecode.com listing): BF16 121, TF32 60, FP8 242.5,
    # FP32 30.3; 300 GB/s GDDR6; 24 GB.
    "l4": Accelerator("L4", {"bf16": 121 * T, "tf32": 60 * T, "fp8": 242.5 * T, "fp32": 30.3 * T}, 300 * GB, 24 * GB),
    # L40S: NVIDIA L40S datasheet (mullet.se copy): BF16 362.05, TF32 183, FP8 733, FP32 91.6; 864 GB/s; 48 GB.
    "l40s": Accelerator("L40S", {"bf16": 362.05 * T, "tf32": 183 * T, "fp8": 733 * T, "fp32": 91.6 * T},
                        864 * GB, 48 * GB),
    # RTX 3090: 71 TFLOP/s FP16 with FP32 accumulate (nanochat; GA102 whitepaper not read), FP32 35.6
    # (holynerdvana); 936 GB/s GDDR6X; 24 GB.
    "rtx3090": Accelerator("RTX 3090", {"bf16": 71 * T, "fp32": 35.6 * T}, 936 * GB, 24 * GB,
                           note="bf16 figure from nanochat only"),
    # RTX 4090: 165.2 TFLOP/s FP16/BF16 with FP32 accumulate, FP32 82.6 (gigagpu.com, waredb.com);
    # 1,008 GB/s GDDR6X; 24 GB.
    "rtx4090": Accelerator("RTX 4090", {"bf16": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T}, 1008 * GB, 24 * GB),
    # MI250X per GCD (PyTorch sees each of the 2 GCDs as a device): AMD MI250X table (zexron.com copy)
    # 383 BF16 / 47.9 FP32 vector per OAM, 3.2 TB/s, 128 GB -> halved per GCD (torchtitan 191.5e12).
    "mi250x": Accelerator("MI250X (per GCD)", {"bf16": 191.5 * T, "fp32": 23.95 * T}, 1.6e12, 64 * GB,
                          note="per GCD = half an OAM module"),
    # MI300X: AMD spec (nanochat 1.3074e15): BF16 1,307.4, FP8 2,614.9, TF32 653.7, FP32 163.4;
    # 5.3 TB/s HBM3; 192 GB.
    "mi300x": Accelerator("MI300X", {"bf16": 1307.4 * T, "tf32": 653.7 * T, "fp8": 2614.9 * T, "fp32": 163.4 * T},
                          5.3e12, 192 * GB),
    # TPU v4: Google Cloud TPU docs (v4): 275 TFLOP/s bf16, 1,200 GB/s, 32 GiB HBM2.
    "tpu-v4": Accelerator("TPU v4", {"bf16": 275 * T}, 1200 * GB, 32 * GiB),
    # TPU v5e: Google Cloud TPU docs (v5e): 197 TFLOP/s bf16, 819 GB/s, 16 GB HBM2.
    "tpu-v5e": Accelerator("TPU v5e", {"bf16": 197 * T}, 819 * GB, 16 * GB),
    # TPU v5p: Google Cloud TPU docs (v5p): 459 TFLOP/s bf16, 2,765 GB/s, 95 GB HBM2e.
    "tpu-v5p": Accelerator("TPU v5p", {"bf16": 459 * T}, 2765 * GB, 95 * GB),
}

ALIASES = {
    "a100": "a100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb", "h100": "h100-sxm",
    "rtx-3090": "rtx3090", "rtx-4090": "rtx4090", "3090": "rtx3090", "4090": "rtx4090", "h200-sxm": "h200",
    "v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "tpuv4": "tpu-v4", "tpuv5e": "tpu-v5e", "tpuv5p": "tpu-v5p",
}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get_accelerator(name: str) -> Accelerator:
    """The table entry of a key (h100-sxm), an alias (h100) or a CUDA device name ("NVIDIA H100 80GB HBM3")."""
    key = _key(name)
    key = ALIASES.get(key, key)
    if key not in ACCELERATORS and " " in name.strip() and (found := lookup_cuda_device(name)) is not None:
        return found  # a device name as torch spells it, e.g. in a run's verify.json
    if key not in ACCELERATORS:
        names = list(ACCELERATORS) + list(ALIASES)
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise TrainwiseError(
            f"unknown GPU '{name}'.{hint} Known: {', '.join(ACCELERATORS)}. For another device pass "
            "--peak-flops P (FLOP/s) and optionally --bandwidth BW (bytes/s) and --memory BYTES."
        )
    return ACCELERATORS[key]


# How torch.cuda.get_device_name() spells the devices above (substring -> table key), most specific first.
_CUDA_NAMES = [
    ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("h200", "h200"), ("h800", "h800"), ("b200", "b200"),
    ("a100-sxm4-40gb", "a100-40gb"), ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100-80gb"),
    ("l40s", "l40s"), ("l4", "l4"), ("rtx 4090", "rtx4090"), ("rtx 3090", "rtx3090"), ("v100", "v100"),
    ("mi300x", "mi300x"), ("mi250x", "mi250x"),
]


def lookup_cuda_device(device_name: str) -> Accelerator | None:
    """The table entry for a name such as "NVIDIA H100 80GB HBM3", or None for an unknown device."""
    name = device_name.lower()
    for fragment, key in _CUDA_NAMES:
        if fragment in name:
            return ACCELERATORS[key]
    return None
