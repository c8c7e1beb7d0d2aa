"""The one table of accelerators: dense peak FLOP/s per dtype, memory bandwidth and capacity; what their
kernels reach in published microbenchmarks (largest matmuls, memory copies, FlashAttention-2); and the
nodes they come in (GPUs per node, NVLink and network bandwidth, NCCL bus bandwidth measured).

Figures are dense (no 2:4 sparsity), per device as PyTorch sees it. Each figure carries its source;
where public tables disagree, the comment beside a figure says which one was taken.
"fp32" is the non-tensor-core FP32 rate; "tf32" the TF32 tensor-core rate where one exists.

Microbenchmark sources, short names used below:
  MAMF      S. Bekman, ml-engineering, compute/accelerator/README.md "Maximum Achievable Matmul FLOPS"
            (torch.mm, best shape of a brute-force search, L2 flushed; commit 744d01e, lines 342-392)
  copy      cuda-samples p2pBandwidthLatencyTest, a GPU's copy to itself (read + write counted), as run in
            ml-engineering network/README.md lines 1315-1362: A100 1,545-1,594 GB/s, H100 SXM 2,495-2,534,
            GB200 5,715-5,821
  NCCL-GTC  NVIDIA GTC 2024 S62129 and GTC 2025 S72583 slides, "NCCL Tests Allreduce / Alltoall Bus
            Bandwidth" (reproduced in ml-engineering network/)
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
    sms: int | None = None  # streaming multiprocessors: matmul tiles run in waves of this many
    mamf: float | None = None  # maximum achievable bf16/fp16 matmul FLOP/s (MAMF)
    copy_fraction: float | None = None  # share of the HBM bandwidth a memory-bound kernel reaches (copy)
    # key of its published attention rates: FlashAttention-2's (ATTENTION_TFLOPS), or each kernel's forward and
    # backward (KERNEL_ATTENTION_TFLOPS: the B200's)
    attention: str | None = None
    node: str | None = None  # the node it usually comes in (NODES)
    mx: bool = False  # tensor cores that take block-scaled MX formats (MXFP8): Blackwell
    # Its tensor-core kernels' rates (MAMF, FP8, attention) over the published ones: under a power limit below the
    # datasheet's TDP the clocks are held down (cost.gpu). 1: the datasheet's.
    clock_share: float = 1.0

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
    # 80 SMs (NVIDIA Tesla V100 GPU architecture whitepaper); comes in the DGX-1 (NODES).
    "v100": Accelerator("V100", {"fp16": 125 * T, "fp32": 15.7 * T}, 900 * GB, 32 * GB, sms=80, node="dgx-1v"),
    # A100 SXM 40GB: NVIDIA A100 datasheet via glennklockwood.com/garden/processors/A100:
    # BF16 312, TF32 156, FP32 19.5 TFLOP/s; 1,555 GB/s HBM2 (upb-pc2 wiki); 40 GB.
    "a100-40gb": Accelerator("A100 40GB", {"bf16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}, 1555 * GB, 40 * GB,
                             sms=108, mamf=271.2 * T, copy_fraction=0.79, attention="fa2-a100", node="dgx-a100"),
    # A100 SXM 80GB: same compute (NVIDIA datasheet); 2,039 GB/s HBM2e (glennklockwood), 80 GB.
    # Kernels (both A100s): 108 SMs (NVIDIA A100 whitepaper); MAMF 271.2 TFLOP/s bf16 (86.9%, shape
    # 1024x10240x5120); copy 1,545-1,594 GB/s of 2,000: 0.79; FlashAttention-2 on A100 80GB (Dao 2023).
    "a100-80gb": Accelerator("A100 80GB", {"bf16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}, 2039 * GB, 80 * GB,
                             sms=108, mamf=271.2 * T, copy_fraction=0.79, attention="fa2-a100", node="dgx-a100"),
    # H100 SXM: NVIDIA H100 table (hpctech.co.jp copy; "* with sparsity, 1/2 without"): BF16 989.4,
    # TF32 494.7, FP8 1,979, FP32 66.9 TFLOP/s; 3.35 TB/s HBM3; 80 GB.
    # Kernels: 132 SMs; MAMF 794.5 TFLOP/s bf16 (80.3%, 2048x2048x13312); copy 2,495-2,534 GB/s of 3,350:
    # 0.75; FlashAttention-2 on H100 80GB SXM5 (Dao 2023 Fig. 7: PyTorch's SDPA flash kernel is FA2).
    "h100-sxm": Accelerator("H100 SXM", {"bf16": 989.4 * T, "tf32": 494.7 * T, "fp8": 1979 * T, "fp32": 66.9 * T},
                            3.35e12, 80 * GB, sms=132, mamf=794.5 * T, copy_fraction=0.75, attention="fa2-h100",
                            node="dgx-h100"),
    # H100 PCIe: same NVIDIA table: BF16 756, TF32 378, FP8 1,513, FP32 51; 2.0 TB/s HBM2e; 80 GB.
    # 114 SMs (hpctech.co.jp copy of the NVIDIA table).
    "h100-pcie": Accelerator("H100 PCIe", {"bf16": 756 * T, "tf32": 378 * T, "fp8": 1513 * T, "fp32": 51 * T},
                             2.0e12, 80 * GB, sms=114, node="pcie-h100"),
    # H200 SXM: NVIDIA H200 spec (lzwjava copy; scaling-book): BF16 989, FP8 1,979 dense; 4.8 TB/s; 141 GB.
    # Kernels as H100 SXM (MAMF: "H200 is the same"); copy fraction of H100 (no H200 copy figure found).
    "h200": Accelerator("H200", {"bf16": 989 * T, "tf32": 494.7 * T, "fp8": 1979 * T, "fp32": 67 * T},
                        4.8e12, 141 * GB, sms=132, mamf=794.5 * T, copy_fraction=0.75, attention="fa2-h100",
                        node="hgx-h200"),
    # H800 SXM: same GH100 compute as H100 SXM (secondary sources philisun.com; no NVIDIA datasheet
    # read), NVLink cut to 400 GB/s; 3.35 TB/s HBM3, 80 GB.
    "h800": Accelerator("H800", {"bf16": 989 * T, "tf32": 494.7 * T, "fp8": 1979 * T, "fp32": 67 * T},
                        3.35e12, 80 * GB, note="secondary source only", sms=132, mamf=794.5 * T, copy_fraction=0.75,
                        attention="fa2-h100", node="hgx-h800"),
    # B200 (HGX, 1000 W): glennklockwood B200 (NVIDIA figures): BF16 2,250, FP8 4,500, TF32 1,100,
    # FP32 80 TFLOP/s; 8 TB/s; 192 GB HBM3e (another NVIDIA table: 180 GB, 7.7 TB/s). MXFP8 at the FP8 rate
    # (NVIDIA Blackwell architecture technical brief: fifth-generation tensor cores, MX formats).
    # Kernels: 148 SMs (ml-engineering training/performance/README.md); MAMF 1,745 TFLOP/s bf16 (77.6%);
    # copy fraction of GB200 (5,715-5,821 GB/s of 8,000: 0.73); attention: cuDNN's and FlashAttention-2's
    # measured rates (KERNEL_ATTENTION_TFLOPS).
    "b200": Accelerator("B200", {"bf16": 2250 * T, "tf32": 1100 * T, "fp8": 4500 * T, "fp32": 80 * T},
                        8.0e12, 192 * GB, sms=148, mamf=1745 * T, copy_fraction=0.73, attention="b200",
                        node="dgx-b200", mx=True),
    # GB200 (one Blackwell GPU of a GB200 superchip, up to 1,200 W): ml-engineering's table of NVIDIA's figures,
    # per GPU: BF16 2,500, FP8 5,000, TF32 1,250, FP32 80 TFLOP/s; 8 TB/s; 186 GB HBM3e (NVIDIA's GB200 NVL72
    # table, copied on zdszero.github.io, agrees). MXFP8 at the FP8 rate, as on the B200.
    # Kernels: MAMF 1,822 TFLOP/s bf16 (72.9%, 4096x9728x2048); copy 5,715-5,821 GB/s of 8,000: 0.73; 148 SMs, the
    # B200 GPU's (its SM clock 2,062 MHz against the B200's 1,965: ml-engineering); attention: the B200's measured
    # rates (KERNEL_ATTENTION_TFLOPS), none being published on the GB200, not scaled by the clock.
    "gb200": Accelerator("GB200", {"bf16": 2500 * T, "tf32": 1250 * T, "fp8": 5000 * T, "fp32": 80 * T},
                         8.0e12, 186 * GB, sms=148, mamf=1822 * T, copy_fraction=0.73, attention="b200",
                         node="gb200-nvl72", mx=True),
    # B300 (Blackwell Ultra, HGX / DGX B300, 1,000 W): ml-engineering's table (NVIDIA DGX B300 datasheet): BF16
    # 2,250, FP8 4,500, TF32 1,125, FP32 80 TFLOP/s; 8 TB/s; 288 GB HBM3e. Kernels: MAMF 1,769 TFLOP/s bf16 (78.6%,
    # 12288x18432x1024); 148 SMs (its smaller SKU; another has 152: ml-engineering); no copy figure (the H100's
    # fraction); attention: the B200's measured rates, none being published on the B300 (whose exponent units
    # NVIDIA doubled for attention's softmax: these rates may understate it).
    "b300": Accelerator("B300", {"bf16": 2250 * T, "tf32": 1125 * T, "fp8": 4500 * T, "fp32": 80 * T},
                        8.0e12, 288 * GB, sms=148, mamf=1769 * T, attention="b200", node="dgx-b300", mx=True),
    # GB300 (one Blackwell Ultra GPU of a GB300 superchip, up to 1,400 W): ml-engineering's table: BF16 2,500, FP8
    # 5,000, TF32 1,250, FP32 80 TFLOP/s; 8 TB/s; 288 GB (20.7 TB over the NVL72's 72 GPUs, NVIDIA's GB300 NVL72
    # specifications as secondary sources copy them). No MAMF or copy figure published (80% of peak and the H100's
    # fraction, as for any such GPU); 148 SMs as the B300; attention as the B300.
    "gb300": Accelerator("GB300", {"bf16": 2500 * T, "tf32": 1250 * T, "fp8": 5000 * T, "fp32": 80 * T},
                         8.0e12, 288 * GB, note="memory from secondary sources", sms=148, attention="b200",
                         node="gb300-nvl72", mx=True),
    # L4: NVIDIA L4 datasheet (nanochat 121e12; sourcecode.com listing): BF16 121, TF32 60, FP8 242.5,
    # FP32 30.3; 300 GB/s GDDR6; 24 GB.
    # 58 SMs (NVIDIA Ada GPU architecture whitepaper, AD104 as L4).
    "l4": Accelerator("L4", {"bf16": 121 * T, "tf32": 60 * T, "fp8": 242.5 * T, "fp32": 30.3 * T}, 300 * GB, 24 * GB,
                      sms=58, node="pcie-l4"),
    # L40S: NVIDIA L40S datasheet (mullet.se copy): BF16 362.05, TF32 183, FP8 733, FP32 91.6; 864 GB/s; 48 GB.
    # 142 SMs (NVIDIA L40S datasheet).
    "l40s": Accelerator("L40S", {"bf16": 362.05 * T, "tf32": 183 * T, "fp8": 733 * T, "fp32": 91.6 * T},
                        864 * GB, 48 * GB, sms=142, node="pcie-l40s"),
    # RTX 3090: 71 TFLOP/s FP16 with FP32 accumulate (nanochat; GA102 whitepaper not read), FP32 35.6
    # (holynerdvana); 936 GB/s GDDR6X; 24 GB.
    # 82 SMs (NVIDIA Ampere GA102 whitepaper).
    "rtx3090": Accelerator("RTX 3090", {"bf16": 71 * T, "fp32": 35.6 * T}, 936 * GB, 24 * GB,
                           note="bf16 figure from nanochat only", sms=82, node="pcie-rtx3090"),
    # RTX 4090: 165.2 TFLOP/s FP16/BF16 with FP32 accumulate, FP32 82.6 (gigagpu.com, waredb.com);
    # 1,008 GB/s GDDR6X; 24 GB.
    # 128 SMs (NVIDIA Ada GPU architecture whitepaper).
    "rtx4090": Accelerator("RTX 4090", {"bf16": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T}, 1008 * GB, 24 * GB,
                           sms=128, node="pcie-rtx4090"),
    # MI250X per GCD (PyTorch sees each of the 2 GCDs as a device): AMD MI250X table (zexron.com copy)
    # 383 BF16 / 47.9 FP32 vector per OAM, 3.2 TB/s, 128 GB -> halved per GCD (torchtitan 191.5e12).
    # 110 compute units per GCD (AMD CDNA 2 whitepaper: 220 per MI250X).
    "mi250x": Accelerator("MI250X (per GCD)", {"bf16": 191.5 * T, "fp32": 23.95 * T}, 1.6e12, 64 * GB,
                          note="per GCD = half an OAM module", sms=110, node="mi250x-node"),
    # MI300X: AMD spec (nanochat 1.3074e15): BF16 1,307.4, FP8 2,614.9, TF32 653.7, FP32 163.4;
    # 5.3 TB/s HBM3; 192 GB.
    # Kernels: MAMF 668.4 TFLOP/s bf16 (51.4%, TunableOp; AMD's own hipblaslt figure is 708: ROCm blog
    # "measuring max achievable FLOPs part 2"); 304 compute units (AMD CDNA 3 whitepaper).
    "mi300x": Accelerator("MI300X", {"bf16": 1307.4 * T, "tf32": 653.7 * T, "fp8": 2614.9 * T, "fp32": 163.4 * T},
                          5.3e12, 192 * GB, sms=304, mamf=668.4 * T, node="mi300x-platform"),
    # TPU v4: Google Cloud TPU docs (v4): 275 TFLOP/s bf16, 1,200 GB/s, 32 GiB HBM2.
    "tpu-v4": Accelerator("TPU v4", {"bf16": 275 * T}, 1200 * GB, 32 * GiB),
    # TPU v5e: Google Cloud TPU docs (v5e): 197 TFLOP/s bf16, 819 GB/s, 16 GB HBM2.
    "tpu-v5e": Accelerator("TPU v5e", {"bf16": 197 * T}, 819 * GB, 16 * GB),
    # TPU v5p: Google Cloud TPU docs (v5p): 459 TFLOP/s bf16, 2,765 GB/s, 95 GB HBM2e.
    "tpu-v5p": Accelerator("TPU v5p", {"bf16": 459 * T}, 2765 * GB, 95 * GB),
}



@dataclass(frozen=True)
class Node:
    """A server of `gpus` accelerators: per GPU and per direction, its GPU-to-GPU fabric (NVLink, PCIe or
    Infinity Fabric) and network bandwidth, and the NCCL bus bandwidth measured on it (nccl-tests busbw,
    large messages): all-reduce (ring; the same wire for all-gather and reduce-scatter) and all-to-all, inside
    one node and across nodes (all GPUs of each node in the collective: `inter_*` are per node). Cards joined
    in pairs by a bridge (`pair_*`) reach that bandwidth in a group of the two neighbours of a pair only; any
    larger group crosses the fabric."""

    name: str
    gpus: int
    intra_bytes_per_s: float  # GPU-to-GPU line rate per GPU per direction
    inter_bytes_per_s: float  # network per GPU per direction (its share of the node's NICs)
    allreduce_busbw_intra: float
    alltoall_busbw_intra: float
    allreduce_busbw_inter: float  # per node, all its GPUs in the ring
    alltoall_busbw_inter: float  # across nodes all-to-all reaches one NIC's worth (nccl-tests issue #267)
    source: str = ""
    fabric: str = "nvlink"  # what a group inside one node crosses: nvlink | pcie | infinity-fabric
    pair_bytes_per_s: float | None = None  # a bridge between the two cards of a pair, per direction
    pair_busbw: float | None = None  # NCCL bus bandwidth of a 2-GPU group over that bridge


# PCIe x16 line rate per direction: 16 (Gen4) or 32 (Gen5) GT/s x 16 lanes x 128b/130b (PCI-SIG).
PCIE4_BYTES_PER_S, PCIE5_BYTES_PER_S = 31.5 * GB, 63 * GB
# NCCL's share of a link's line rate: 370 GB/s busbw on NVLink4's 450 ("protocol overhead ~20%", NCCL
# maintainer, nccl-tests issue #212). Over PCIe 4 RTX 4090s reached 25.9 GB/s all-reduce busbw at 1-2 GiB
# on Gen4 x16 (tinygrad/open-gpu-kernel-modules issue #36): the same 0.82 of 31.5. Used where a node has no
# measured busbw of its own; a PCIe box whose CPU root complex is the limit reaches less (8 RTX 5090s on
# Gen5: 28 GB/s, NVIDIA/nccl issue #1639): --intra-node-bw describes such a box.
NCCL_LINK_SHARE = 0.82
# Across nodes NCCL reaches ~24 GB/s per 200 Gb/s NIC, ~12 per 100 Gb/s (NCCL maintainer, nccl-tests
# issue #119): 0.96 of the NIC's line rate.
NIC_SHARE = 0.96


def node_from_line_rates(name: str, gpus: int, fabric: str, line: float, nic_per_node: float, source: str,
                         pair: float | None = None, pair_busbw: float | None = None) -> Node:
    """A node without published NCCL figures: busbw = NCCL_LINK_SHARE x the fabric's line rate inside it,
    NIC_SHARE x its NICs across nodes (all-to-all across nodes: each GPU's share of the NICs)."""
    nic = NIC_SHARE * nic_per_node
    return Node(name, gpus, line, nic_per_node / gpus, NCCL_LINK_SHARE * line, NCCL_LINK_SHARE * line, nic,
                nic / gpus, source, fabric, pair, pair_busbw or (pair and NCCL_LINK_SHARE * pair))


NODES: dict[str, Node] = {
    # DGX A100: NVLink3 300 GB/s per direction per GPU, 8x HDR 200 Gb/s compute NICs (Korthikanti et al.
    # 2022 section 6); busbw: all-reduce 235 GB/s in a node (nccl-tests sweep, 16 GiB; ml-engineering
    # network/README.md l.1216-1283), across nodes 192 GB/s; all-to-all 210 in a node, 24 across (NCCL-GTC).
    "dgx-a100": Node("DGX A100", 8, 300 * GB, 25 * GB, 235 * GB, 210 * GB, 192 * GB, 24 * GB,
                     "NVLink3 + 8x HDR 200 Gb/s; busbw measured (nccl-tests, NVIDIA GTC)"),
    # DGX H100 / HGX H100: NVLink4 450 GB/s per direction, 8x ConnectX-7 NDR 400 Gb/s (DGX BasePOD RA);
    # busbw: ring all-reduce ~370 in a node (NCCL maintainer, nccl-tests issue #212; 367 measured on H200),
    # 370 across nodes; all-to-all 320 in a node, 48 across (NCCL-GTC 2025).
    "dgx-h100": Node("DGX H100", 8, 450 * GB, 50 * GB, 370 * GB, 320 * GB, 370 * GB, 48 * GB,
                     "NVLink4 + 8x NDR 400 Gb/s; busbw measured (nccl-tests, NVIDIA GTC)"),
    "hgx-h200": Node("HGX H200", 8, 450 * GB, 50 * GB, 367 * GB, 320 * GB, 370 * GB, 48 * GB,
                     "NVLink4 + 8x NDR 400 Gb/s; ring all-reduce 367.2 GB/s measured (ml-engineering l.974)"),
    # H800: NVLink cut to 400 GB/s bidirectional; DeepSeek-V3 report section 3.2.2: "NVLink offers 160 GB/s,
    # roughly 3.2 times that of IB (50 GB/s)" (measured, usable): those two as the bus bandwidths.
    "hgx-h800": Node("HGX H800", 8, 200 * GB, 50 * GB, 160 * GB, 160 * GB, 8 * 50 * GB, 50 * GB,
                     "NVLink 400 GB/s bidirectional + 8x 400 Gb/s (DeepSeek-V3 report)"),
    # DGX B200: NVLink5 900 GB/s per direction, 8x ConnectX-7 400 Gb/s (DGX BasePOD RA); ring all-reduce
    # 682 GB/s in a node (8 GiB, NVLS off; ml-engineering l.933-941), all-to-all 640 (NCCL-GTC 2025);
    # across nodes as DGX H100 (same NICs).
    "dgx-b200": Node("DGX B200", 8, 900 * GB, 50 * GB, 682 * GB, 640 * GB, 370 * GB, 48 * GB,
                     "NVLink5 + 8x ConnectX-7 400 Gb/s; busbw measured (nccl-tests, NVIDIA GTC)"),
    # GB200 NVL72: 72 GPUs in one NVLink5 domain, 900 GB/s per direction per GPU, one ConnectX-7 400 Gb/s per GPU
    # (DGX GB200 user guide, networking: four per compute tray of four GPUs); busbw over the NVLink domain, 32
    # GPUs: ring all-reduce 680 GB/s (NVLS off), all-to-all 640 (NCCL-GTC 2025). Across domains: the NICs at
    # NIC_SHARE, every GPU's (no measured figure), a ring held to its in-domain hops (cost.comm.group_tier).
    "gb200-nvl72": Node("GB200 NVL72", 72, 900 * GB, 50 * GB, 680 * GB, 640 * GB, NIC_SHARE * 72 * 50 * GB,
                        NIC_SHARE * 50 * GB,
                        "NVLink5 domain of 72 + 72x ConnectX-7 400 Gb/s; busbw in the domain measured (NVIDIA GTC)"),
    # DGX B300: NVLink5 900 GB/s per direction, 8x ConnectX-8 800 Gb/s (DGX B300 datasheet, as ml-engineering
    # network/README.md gives it); no NCCL figure published: busbw derived from the line rates.
    "dgx-b300": node_from_line_rates("DGX B300", 8, "nvlink", 900 * GB, 8 * 100 * GB,
                                     "NVLink5 + 8x ConnectX-8 800 Gb/s; busbw derived from the line rates"),
    # GB300 NVL72: the GB200 NVL72's NVLink5 domain of 72, a ConnectX-8 800 Gb/s per GPU; no NCCL figure published
    # on it: busbw derived from the line rates, a ring across domains held to its in-domain hops.
    "gb300-nvl72": node_from_line_rates("GB300 NVL72", 72, "nvlink", 900 * GB, 72 * 100 * GB,
                                        "NVLink5 domain of 72 + 72x ConnectX-8 800 Gb/s; busbw derived from the "
                                        "line rates"),
    # MI300X platform: Infinity Fabric, 7 links x 64 GB/s per direction per GPU (AMD); all-reduce 313 GB/s
    # on 8 GPUs (4 GiB, ml-engineering network/README.md l.230); NICs not published: 8x 400 Gb/s assumed.
    "mi300x-platform": Node("MI300X platform", 8, 448 * GB, 50 * GB, 313 * GB, 313 * GB, 370 * GB, 48 * GB,
                            "Infinity Fabric; NICs assumed 8x 400 Gb/s", "infinity-fabric"),
    # DGX-1 with V100 SXM2: 6 NVLink2 links x 25 GB/s per direction per GPU in a hybrid cube-mesh, 4x EDR
    # InfiniBand 100 Gb/s per node (NVIDIA DGX-1 system architecture whitepaper); no busbw figure found.
    "dgx-1v": node_from_line_rates(
        "DGX-1 (V100)", 8, "nvlink", 150 * GB, 4 * 12.5 * GB,
        "NVLink2 cube-mesh + 4x EDR 100 Gb/s; busbw derived from the line rates"),
    # 8-card PCIe servers, one NIC per node. H100 PCIe: Gen5 x16; NVLink bridges join pairs of cards at
    # 600 GB/s bidirectional (NVIDIA H100 PCIe product brief), 116 GB/s all-reduce busbw measured on a
    # bridged pair (NVIDIA/nccl issue #1161). NIC assumed: 200 Gb/s.
    "pcie-h100": node_from_line_rates(
        "8x H100 PCIe server", 8, "pcie", PCIE5_BYTES_PER_S, 25 * GB,
        "PCIe Gen5 x16, NVLink bridge per pair; one 200 Gb/s NIC assumed", 300 * GB, 116 * GB),
    # L40S: Gen4 x16, no NVLink; AWS g6e.48xlarge: 8 L40S and 400 Gb/s of network.
    "pcie-l40s": node_from_line_rates(
        "8x L40S server", 8, "pcie", PCIE4_BYTES_PER_S, 50 * GB,
        "PCIe Gen4 x16, no NVLink; 400 Gb/s network (AWS g6e.48xlarge)"),
    # L4: Gen4 x16, no NVLink; Google Cloud g2-standard-96: 8 L4 and 100 Gb/s of network.
    "pcie-l4": node_from_line_rates(
        "8x L4 server", 8, "pcie", PCIE4_BYTES_PER_S, 12.5 * GB,
        "PCIe Gen4 x16, no NVLink; 100 Gb/s network (Google Cloud g2-standard-96)"),
    # RTX 3090: Gen4 x16; an NVLink bridge joins pairs at 112.5 GB/s bidirectional (NVIDIA GA102
    # whitepaper). NIC assumed: 100 Gb/s.
    "pcie-rtx3090": node_from_line_rates(
        "8x RTX 3090 server", 8, "pcie", PCIE4_BYTES_PER_S, 12.5 * GB,
        "PCIe Gen4 x16, NVLink bridge per pair; one 100 Gb/s NIC assumed", 56.25 * GB),
    # RTX 4090: Gen4 x16, no NVLink and no peer-to-peer: NCCL passes through host memory, which the measured
    # PCIe share (NCCL_LINK_SHARE, 4 RTX 4090s) already includes. NIC assumed: 100 Gb/s.
    "pcie-rtx4090": node_from_line_rates(
        "8x RTX 4090 server", 8, "pcie", PCIE4_BYTES_PER_S, 12.5 * GB,
        "PCIe Gen4 x16 through host memory (no P2P); one 100 Gb/s NIC assumed"),
    # MI250X node (HPE Cray EX235a, OLCF Frontier User Guide): 4 MI250X = 8 GCDs; the two GCDs of one MI250X
    # joined at 200 GB/s, GCDs of different MI250X by 50-100 GB/s links (a ring over 8 GCDs at its slowest
    # hop, 50); 4 Slingshot-11 200 Gb/s NICs per node. No RCCL busbw figure found.
    "mi250x-node": node_from_line_rates(
        "MI250X node (4 OAM, 8 GCD)", 8, "infinity-fabric", 50 * GB, 4 * 25 * GB,
        "Infinity Fabric + 4x Slingshot 200 Gb/s; busbw derived from the line rates", 200 * GB),
}


def get_node(name: str) -> Node:
    key = _key(name)
    if key not in NODES:
        raise TrainwiseError(f"unknown node '{name}'. Known: {', '.join(NODES)}; or give --gpus-per-node, "
                             "--intra-node-bw and --inter-node-bw.")
    return NODES[key]


# FlashAttention-2 forward+backward TFLOP/s by head dim and sequence length, causal, as its papers count
# FLOPs (forward 4 T^2 hd heads, halved for causal; backward 2.5x forward). Dao 2023 (arXiv 2307.08691)
# Fig. 4 (A100 80GB SXM4) and Fig. 7 (H100 80GB SXM5), the labels printed on the bars; batch x T = 16k
# tokens, hidden 2048.
ATTENTION_TFLOPS: dict[str, dict[int, dict[int, float]]] = {
    "fa2-a100": {64: {512: 88, 1024: 119, 2048: 140, 4096: 156, 8192: 165, 16384: 171},
                 128: {512: 99, 1024: 133, 2048: 155, 4096: 173, 8192: 182, 16384: 189}},
    "fa2-h100": {64: {512: 141, 1024: 192, 2048: 232, 4096: 257, 8192: 273, 16384: 284},
                 128: {512: 163, 1024: 221, 2048: 265, 4096: 294, 8192: 308, 16384: 328}},
}


# Attention kernels on the H100 80GB SXM5, bf16, head dim 128, batch x T = 16k tokens, hidden 2048: (forward,
# backward) TFLOP/s by sequence length, Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608) Figures 5 and 6,
# the labels printed on the bars as a secondary transcription gives them (not read from the paper itself; the
# two transcriptions seen disagree on which of cuDNN and FlashAttention-3 is 497 / 467 at 512 tokens: taken as
# cuDNN 497, the faster at short sequences in every other panel). cost.gpu.attention_rate uses only each
# kernel's speed-up over FlashAttention-2 in these same panels.
HOPPER_ATTENTION_TFLOPS: dict[str, tuple[dict[int, float], dict[int, float]]] = {
    "flash2": ({512: 309, 1024: 350, 2048: 362, 4096: 368, 8192: 370, 16384: 370},
               {512: 214, 1024: 260, 2048: 291, 4096: 310, 8192: 318, 16384: 322}),
    "cudnn": ({512: 497, 1024: 574, 2048: 617, 4096: 609, 8192: 600, 16384: 595},
              {512: 305, 1024: 408, 2048: 465, 4096: 499, 8192: 518, 16384: 516}),
    "flash3": ({512: 467, 1024: 565, 2048: 625, 4096: 638, 8192: 646, 16384: 648},
               {512: 316, 1024: 424, 2048: 501, 4096: 542, 8192: 559, 16384: 561}),
}


# Attention kernels on the B200, bf16, causal, head dim 128, one sequence of 128 query and 8 key-value heads per
# call: (forward, backward) TFLOP/s by sequence length, counted as FlashAttention's papers count FLOPs. NVIDIA's
# cudnn-frontend, benchmark/sdpa_benchmark_training/artifacts/sdpa_bf16_benchmark_results_NVIDIA_B200.csv and its
# sample_b200_bf16_run.txt (torch 2.9.0 nv25.09, cuDNN 9.13.0, flash-attn 2.7.4.post1): cuDNN's fused attention
# through PyTorch's SDPA (pyt_cudnn) and the flash-attn package's FlashAttention-2 (flash_attention), whose kernels
# are Ampere's (no Blackwell code of their own). At 2,048 tokens and fewer a call holds fewer tokens than a
# training step's (16k in FlashAttention-2's panels): the rates there are low. Only head dim 128 is published.
KERNEL_ATTENTION_TFLOPS: dict[str, dict[str, tuple[dict[int, float], dict[int, float]]]] = {"b200": {
    "flash2": ({512: 64, 1024: 154, 2048: 254, 4096: 343, 8192: 400, 16384: 425, 32768: 436, 65536: 441,
                131072: 444},
               {512: 81, 1024: 105, 2048: 199, 4096: 273, 8192: 318, 16384: 337, 32768: 346, 65536: 349,
                131072: 348}),
    "cudnn": ({512: 84, 1024: 255, 2048: 479, 4096: 856, 8192: 1171, 16384: 1332, 32768: 1419, 65536: 1382,
               131072: 1355},
              {512: 134, 1024: 309, 2048: 371, 4096: 701, 8192: 943, 16384: 1075, 32768: 1109, 65536: 1073,
               131072: 1048}),
}}
# cuDNN's fused attention in FP8 (Transformer Engine's FP8 dot-product attention) against bf16 in the same run:
# ((bf16 forward, bf16 backward), (FP8 forward, FP8 backward)) TFLOP/s by sequence length, causal, head dim 128,
# one sequence per call. Hopper: NVIDIA cudnn-frontend, benchmark/sdpa_benchmark_training/results/
# h200_919_only_cudnn/llama3.1_20260227_034703.csv (H200, cuDNN 9.19.1, 64 query and 8 key-value heads; FP8's
# backward is slower than bf16's past 8K there); Blackwell: artifacts/sdpa_fp8_benchmark_results_NVIDIA_B200.csv
# (cuDNN 9.13.1, 128 and 8 heads). The planner takes each pass's FP8 / bf16 ratio (cost.gpu.attention_rate).
FP8_ATTENTION_TFLOPS: dict[str, tuple[tuple[dict[int, float], dict[int, float]], ...]] = {
    "hopper": (({2048: 484, 4096: 591, 8192: 644, 16384: 673, 32768: 688},
                {2048: 370, 4096: 474, 8192: 541, 16384: 579, 32768: 581}),
               ({2048: 698, 4096: 854, 8192: 964, 16384: 1010, 32768: 1042},
                {2048: 393, 4096: 471, 8192: 430, 16384: 374, 32768: 370})),
    "b200": (({512: 244, 1024: 561, 2048: 908, 4096: 1141, 8192: 1384, 16384: 1475, 32768: 1515, 65536: 1494,
               131072: 1422},
              {512: 201, 1024: 377, 2048: 545, 4096: 833, 8192: 995, 16384: 1152, 32768: 1180, 65536: 1236,
               131072: 1128}),
             ({512: 196, 1024: 516, 2048: 974, 4096: 1231, 8192: 1502, 16384: 1692, 32768: 1781, 65536: 1815,
               131072: 1830},
              {512: 170, 1024: 377, 2048: 556, 4096: 972, 8192: 1255, 16384: 1469, 32768: 1582, 65536: 1627,
               131072: 1616})),
}
def table_gpus(has) -> str:
    """The table's GPUs for which `has(accelerator)` holds, by key, for the errors that name where to plan instead."""
    return ", ".join(key for key, acc in ACCELERATORS.items() if has(acc))


def measured_on(acc: Accelerator) -> str:
    """The GPU a table GPU's measured attention rates (KERNEL_ATTENTION_TFLOPS) were taken on, as the plan says it:
    its own name, or that GPU's and that none are published on this one."""
    source = ACCELERATORS[acc.attention].name
    return source if source == acc.name else f"{source}, taken for the {acc.name} (none published on the {acc.name})"


# The fused kernel a stack runs by default (--attention-impl flash) where it is not FlashAttention-2: on Blackwell,
# cuDNN's (Transformer Engine's FusedAttention; PyTorch's SDPA puts cuDNN first on sm90 / sm100 from cuDNN 9.15,
# check_prefer_cudnn_attention in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp). Ampere and Hopper keep
# FlashAttention-2, what the development set's Hopper runs used.
DEFAULT_ATTENTION = {"b200": "cudnn"}


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
    ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("h200", "h200"), ("h800", "h800"), ("gb200", "gb200"),
    ("b200", "b200"), ("gb300", "gb300"), ("b300", "b300"),
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
