"""Topics of compute: matmul, einsum, dtype, roofline, MFU."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainwise.config import ModelConfig, TrainConfig
from trainwise.cost.flops import einsum_flops, flops_per_token_train, linear_train_flops, matmul_flops
from trainwise.cost.memory import tensor_bytes
from trainwise.cost.time import attainable_flops, model_flops_utilization, ridge_point, roofline_seconds
from trainwise.errors import TrainwiseError
from trainwise.explain.render import Doc, num
from trainwise.explain.topic import Arg, Topic, ints, positive
from trainwise.measure.flopcount import flop_counter
from trainwise.runtime.precision import DTYPES


def _counted(fn) -> int:
    """FLOPs of fn() by the one FLOP counter the trainer's measurements use (trainwise.measure.flopcount)."""
    with flop_counter() as counter:
        fn()
    return int(counter.get_total_flops())


# ---------------------------------------------------------------------------------------------------
MM = {
    "en": dict(title="Matrix multiplication: output shape and FLOPs", out="output shape", fwd="FLOPs",
               counted="counted by FlopCounterMode", train="training, as a Linear layer",
               counted_train="counted (fwd+bwd)",
               why="Each of the M x N outputs is a dot product of length K: K multiplies + K adds = 2K FLOPs. "
                   "Backward needs two matmuls of the same size (dX = dY W^T, dW = X^T dY), so training is 3x forward.",
               run=["Almost all of a Transformer's FLOPs are matmuls like this: with M = tokens and K x N = the "
                    "layer's parameters, 6MKN summed over layers is the 6ND of `trainwise plan`.",
                    "`trainwise verify` counts the matmuls of a real step with the same FlopCounterMode."]),
    "zh": dict(title="矩阵乘法：输出形状与浮点运算量 (FLOPs)", out="输出形状", fwd="前向 FLOPs",
               counted="FlopCounterMode 计数", train="训练（作为线性层）", counted_train="计数（前向+反向）",
               why="M x N 个输出中每个都是长度为 K 的点积：K 次乘法 + K 次加法 = 2K FLOPs。"
                   "反向传播需要两个同样大小的矩阵乘法（dX = dY W^T, dW = X^T dY），所以训练是前向的 3 倍。",
               run=["Transformer 的浮点运算几乎都是这样的矩阵乘法：M = token 数，K x N = 该层参数量，"
                    "对各层求和的 6MKN 就是 `trainwise plan` 中的 6ND。",
                    "`trainwise verify` 用同一个 FlopCounterMode 统计真实训练步的矩阵乘法。"]),
}


def matmul(a: list[int] | None = None, b: list[int] | None = None, lang: str = "en") -> Doc:
    t = MM[lang]
    a, b = a or [2, 3], b or [3, 4]
    if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
        raise TrainwiseError(f"--a {a} and --b {b} must be (M,K) and (K,N) with the same K.")
    M, K, N = a[0], a[1], b[1]
    x = torch.empty(M, K, device="meta", requires_grad=True)
    lin = nn.Linear(K, N, bias=False, device="meta")
    out_shape = tuple((x @ lin.weight.T).shape)
    fwd = matmul_flops(M, K, N)
    counted = _counted(lambda: x @ lin.weight.T)
    train = linear_train_flops(M, K, N)
    counted_train = _counted(lambda: lin(x).sum().backward())
    d = Doc(t["title"], lang)
    d.step(t["out"], "(M,K) x (K,N) -> (M,N)", f"({M},{K}) x ({K},{N})", str(out_shape))
    d.step(t["fwd"], "2 M K N", f"2 x {M} x {K} x {N}", f"{num(fwd)} FLOPs")
    d.step(t["counted"], "torch.utils.flop_counter", "", f"{num(counted)} FLOPs")
    d.step(t["train"], "6 M K N = 2MKN + 4MKN", f"6 x {M} x {K} x {N}", f"{num(train)} FLOPs")
    d.step(t["counted_train"], "FlopCounterMode(linear(x).backward)", "", f"{num(counted_train)} FLOPs")
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(a=[M, K], b=[K, N], output_shape=list(out_shape), flops=fwd, flops_counted=counted,
                    train_flops=train, train_flops_counted=counted_train)
    return d


EIN = {
    "en": dict(title="einsum: output shape and FLOPs of any contraction", sizes="index sizes", out="output shape",
               flops="FLOPs", counted="counted by FlopCounterMode", summed="summed indices",
               why="One pass over every combination of the indices: (operands - 1) multiplies, + 1 add when an "
                   "index is summed away. Two operands with a contraction: 2 x product of all sizes, i.e. 2MNK.",
               run=["The default is the attention score matmul q k^T of trainwise-small at T = 256 "
                    "(B=1, shapes (B, nh, T, hd)): the planner's attention core counts it "
                    "(and the matching A V) per layer.",
                    "Attention in the model is written with SDPA; `trainwise.measure.flopcount` adds the FLOP "
                    "formula the CPU kernel lacks, so its count equals this one."]),
    "zh": dict(title="爱因斯坦求和 (einsum)：任意缩并的输出形状与 FLOPs", sizes="各下标大小", out="输出形状",
               flops="FLOPs", counted="FlopCounterMode 计数", summed="被求和的下标",
               why="对所有下标组合遍历一次：(操作数 - 1) 次乘法，有下标被求和时再加 1 次加法。"
                   "两个操作数且有缩并时：2 x 所有下标大小之积，即 2MNK。",
               run=["默认例子是 trainwise-small 在 T = 256 时的注意力分数 q k^T（B=1，形状为 (B, nh, T, hd)）："
                    "规划器在每层的注意力核心部分计入它（以及对应的 A V）。",
                    "模型中的注意力用 SDPA 实现；`trainwise.measure.flopcount` 补上了 CPU 内核缺失的 FLOP 公式，"
                    "因此计数与这里一致。"]),
}


def einsum(equation: str = "bhtd,bhsd->bhts", shapes: list[list[int]] | None = None, lang: str = "en") -> Doc:
    t = EIN[lang]
    if shapes is None:  # trainwise-small's q and k (B=1): the defaults of the config, not a copy of them
        model_cfg, seq_len = ModelConfig(), TrainConfig().seq_len
        shapes = [[1, model_cfg.n_heads, seq_len, model_cfg.head_dim]] * 2
    try:
        out_shape, flops = einsum_flops(equation, *shapes)
    except ValueError as err:
        raise TrainwiseError(f"einsum '{equation}': {err}.") from None
    ops = [torch.empty(s, device="meta") for s in shapes]
    torch_shape = tuple(torch.einsum(equation, *ops).shape)
    counted = _counted(lambda: torch.einsum(equation, *ops))
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    sizes = {}
    for term, s in zip(lhs.split(","), shapes):
        sizes.update(zip(term, s))
    out_idx = rhs if arrow else "".join(sorted(i for i in sizes if lhs.count(i) == 1))
    summed = [i for i in sizes if i not in out_idx]
    factor = flops // math.prod(sizes.values())
    d = Doc(t["title"], lang)
    d.step(t["sizes"], equation, "  ".join(str(tuple(s)) for s in shapes),
           ", ".join(f"{k}={v}" for k, v in sizes.items()))
    d.step(t["summed"], "", "", ", ".join(summed) or "-")
    d.step(t["out"], "torch.einsum(...).shape", "", str(torch_shape))
    d.step(t["flops"], f"{factor} x prod(sizes)", f"{factor} x " + " x ".join(map(str, sizes.values())),
           f"{num(flops)} FLOPs")
    d.step(t["counted"], "torch.utils.flop_counter", "", f"{num(counted)} FLOPs")
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(equation=equation, shapes=shapes, sizes=sizes, summed=summed, output_shape=list(torch_shape),
                    flops=flops, flops_counted=counted)
    assert list(out_shape) == list(torch_shape)
    return d


# ---------------------------------------------------------------------------------------------------
DT = {
    "en": dict(title="Floating-point formats: bits, range and precision (torch.finfo)",
               cols=["dtype", "bits", "sign", "exponent", "mantissa", "max finite", "smallest normal", "epsilon"],
               over="overflow", under="underflow", round="rounding",
               why="The exponent bits set the range (max, smallest normal); the mantissa bits set the precision "
                   "(epsilon = 2^-mantissa, the gap after 1.0). bf16 keeps fp32's range with fewer mantissa bits; "
                   "fp16 has more precision but overflows above 65504 and flushes small values to 0.",
               run=["train.precision = bf16 runs the matmuls under autocast in bf16 and keeps fp32 weights "
                    "(the planner's 'amp' recipe); fp16 needs loss scaling because small gradients underflow.",
                    "Bytes per element (4, 2, 1) are what `trainwise plan` multiplies parameters and activations by."]),
    "zh": dict(title="浮点数据类型：位布局、范围与精度 (torch.finfo)",
               cols=["数据类型", "位数", "符号位", "指数位", "尾数位", "最大有限值", "最小正规数", "机器精度 eps"],
               over="上溢", under="下溢", round="舍入",
               why="指数位决定范围（最大值、最小正规数）；尾数位决定精度（eps = 2^-尾数位，1.0 之后的间隔）。"
                   "bf16 保留 fp32 的范围但尾数位更少；fp16 精度更高，但超过 65504 会上溢、很小的数会下溢为 0。",
               run=["train.precision = bf16 时矩阵乘法在 autocast 下用 bf16 计算、权重保持 fp32（规划器的 amp 方案）；"
                    "fp16 需要损失缩放 (loss scaling)，因为小梯度会下溢。",
                    "每个元素的字节数（4、2、1）就是 `trainwise plan` 计算参数和激活值内存时乘的系数。"]),
}


def _formats() -> dict[str, torch.dtype]:
    out = {name: DTYPES[name] for name in ("fp32", "fp16", "bf16")}
    for name, attr in (("fp8-e4m3", "float8_e4m3fn"), ("fp8-e5m2", "float8_e5m2")):
        if hasattr(torch, attr):
            out[name] = getattr(torch, attr)
    return out


def dtype(overflow: float = 70000.0, underflow: float = 1e-8, lang: str = "en") -> Doc:
    t = DT[lang]
    rows, values = [], {}
    for name, dt in _formats().items():
        fi = torch.finfo(dt)
        mantissa = round(-math.log2(fi.eps))
        exponent = fi.bits - 1 - mantissa
        values[name] = dict(bits=fi.bits, exponent_bits=exponent, mantissa_bits=mantissa, max=fi.max,
                            smallest_normal=fi.smallest_normal, eps=fi.eps)
        rows.append([name, fi.bits, 1, exponent, mantissa, f"{fi.max:.4g}", f"{fi.smallest_normal:.4g}",
                     f"{fi.eps:.4g}"])
    d = Doc(t["title"], lang)
    d.table(t["cols"], rows)
    d.text()
    demo = {}
    for label, value in ((t["over"], overflow), (t["under"], underflow)):
        for name in ("fp16", "bf16"):
            got = torch.tensor(value, dtype=torch.float32).to(_formats()[name]).item()
            demo[f"{'overflow' if label == t['over'] else 'underflow'}_{name}"] = got
            d.step(label, f"torch.tensor({num(value)}).to({name})", "", num(got))
    for name in ("fp32", "bf16"):
        eps = torch.finfo(_formats()[name]).eps
        got = (torch.tensor(1.0, dtype=_formats()[name]) + eps / 2).item()
        demo[f"one_plus_half_eps_{name}"] = got
        d.step(t["round"], f"1 + eps/2 in {name}", f"1 + {num(eps / 2)}", num(got, 10))
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(formats=values, demo=demo)
    return d


# ---------------------------------------------------------------------------------------------------
RL = {
    "en": dict(title="Roofline: compute-bound or memory-bound?", ridge="ridge point", point="I = {i}",
               mem="memory-bound", comp="compute-bound", ex="examples, {dt} on this hardware",
               mm="matmul {n}x{n}x{n}", add="elementwise add of {n} values (fp32)",
               why="A kernel doing F FLOPs on Q bytes has arithmetic intensity I = F/Q. It cannot run faster than "
                   "the peak P nor than the bandwidth lets bytes arrive, I x BW: attainable = min(P, I x BW). "
                   "Below the ridge point P/BW it waits for memory.",
               run=["`trainwise roofline --model ...` places every operator of one of your training steps on this "
                    "roofline: the big matmuls sit right of the ridge, "
                    "norms, activations and the optimizer left of it.",
                    "Memory-bound operators are why MFU stays below 100% even when the GPU is busy."]),
    "zh": dict(title="屋顶线模型：计算受限还是访存受限？", ridge="脊点 (ridge point)", point="算术强度 I = {i}",
               mem="访存受限", comp="计算受限", ex="例子（{dt}，此硬件）",
               mm="矩阵乘法 {n}x{n}x{n}", add="{n} 个数的逐元素加法 (fp32)",
               why="一个内核在 Q 字节上做 F 次浮点运算，其算术强度 I = F/Q。"
                   "它既不能超过峰值 P，也不能超过带宽供数的速度 I x BW：可达性能 = min(P, I x BW)。"
                   "算术强度低于脊点 P/BW 时，它在等待内存。",
               run=["`trainwise roofline --model ...` 把你一步训练中的每个算子画在这条屋顶线上：大矩阵乘法在脊点右侧，"
                    "归一化、激活函数和优化器在左侧。",
                    "访存受限的算子正是 GPU 很忙时 MFU 仍低于 100% 的原因。"]),
}


def roofline(peak_flops: float = 100e12, bandwidth: float = 1e12, intensity: list[float] | None = None,
             lang: str = "en") -> Doc:
    t = RL[lang]
    positive(peak_flops, "--peak-flops")
    positive(bandwidth, "--bandwidth")
    intensity = intensity if intensity is not None else [20.0, 150.0]
    for i in intensity:
        positive(i, "--intensity")  # FLOPs per byte moved: a kernel that runs does some of each
    ridge = ridge_point(peak_flops, bandwidth)
    d = Doc(t["title"], lang)
    d.step(t["ridge"], "P / BW", f"{num(peak_flops)} / {num(bandwidth)}", f"{num(ridge)} FLOPs/byte")
    points = []
    for i in intensity:
        att = attainable_flops(i, peak_flops, bandwidth)
        bound = "memory" if i < ridge else "compute"
        points.append(dict(intensity=i, attainable_flops=att, bound=bound))
        d.step(t["point"].format(i=num(i)), "min(P, I x BW)", f"min({num(peak_flops)}, {num(i)} x {num(bandwidth)})",
               f"{num(att / 1e12)} TFLOP/s, {t['mem'] if bound == 'memory' else t['comp']}")
    d.text()
    d.text(t["ex"].format(dt="bf16"))
    n = 4096
    f_mm = matmul_flops(n, n, n)
    q_mm = 3 * tensor_bytes((n, n), "bf16").bytes  # read A and B, write C
    m = 1 << 20
    f_add, q_add = m, 3 * tensor_bytes((m,), "fp32").bytes
    examples = {}
    for key, label, f, q in (("matmul", t["mm"].format(n=n), f_mm, q_mm), ("add", t["add"].format(n=m), f_add, q_add)):
        i = f / q
        sec = roofline_seconds(f, q, peak_flops, bandwidth)
        examples[key] = dict(flops=f, bytes=q, intensity=i, seconds=sec, bound="memory" if i < ridge else "compute")
        d.step(label, "I = F / Q", f"{num(f)} / {num(q)}",
               f"{num(i)} FLOPs/byte -> {t['mem'] if i < ridge else t['comp']}, t >= max(F/P, Q/BW) = {num(sec)} s")
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(peak_flops=peak_flops, bandwidth_bytes_per_s=bandwidth, ridge_point=ridge, points=points,
                    examples=examples)
    return d


# ---------------------------------------------------------------------------------------------------
MFU = {
    "en": dict(title="MFU: model FLOPs utilisation", mfu="MFU", from_tokens="achieved from tokens/s",
               hfu="HFU with full checkpointing", busy="a busy but memory-bound kernel",
               why="MFU counts only the FLOPs the model needs (forward + backward, no recompute) against the peak. "
                   "nvidia-smi's 'GPU utilisation' is the fraction of time some kernel was running: a memory-bound "
                   "kernel keeps it at 100% while doing a fraction of a percent of the peak FLOP/s. Recomputation "
                   "raises hardware FLOPs (HFU) but not MFU.",
               run=["`trainwise train` logs mfu in metrics.jsonl every step: tokens/s x model FLOPs per token / peak.",
                    "`trainwise verify` compares it with the MFU the plan assumed (default 0.4)."]),
    "zh": dict(title="模型算力利用率 (MFU)", mfu="MFU", from_tokens="由 tokens/s 得到的实际算力",
               hfu="全量激活检查点时的 HFU", busy="忙碌但访存受限的内核",
               why="MFU 只统计模型需要的浮点运算（前向 + 反向，不含重计算）占峰值的比例。"
                   "nvidia-smi 的「GPU 利用率」只是有内核在运行的时间比例：访存受限的内核能让它保持 100%，"
                   "实际却只用到峰值算力的零点几个百分点。重计算提高硬件算力利用率 (HFU)，不提高 MFU。",
               run=["`trainwise train` 每步在 metrics.jsonl 中记录 mfu：tokens/s x 每 token 模型 FLOPs / 峰值。",
                    "`trainwise verify` 把它与规划时假设的 MFU（默认 0.4）对比。"]),
}


def mfu(achieved_flops: float = 40e12, peak_flops: float = 100e12, devices: int = 1, lang: str = "en") -> Doc:
    t = MFU[lang]
    positive(peak_flops, "--peak-flops")
    positive(achieved_flops, "--achieved-flops")
    value = model_flops_utilization(achieved_flops, peak_flops, devices)
    if value > 1:
        raise TrainwiseError(
            f"--achieved-flops {num(achieved_flops)} FLOP/s is more than {devices} x --peak-flops {num(peak_flops)}: "
            "no run exceeds its devices' peak, so one of them is in other units (FLOP/s of all devices against one "
            "device's peak: give --devices) or of another dtype.")
    cfg, seq = ModelConfig(), ModelConfig().max_seq_len
    per_token = flops_per_token_train(cfg, seq)
    per_token_hw = flops_per_token_train(cfg, seq, recompute="full")
    tokens_per_s = achieved_flops / per_token
    hfu = value * per_token_hw / per_token
    busy = attainable_flops(1 / 12, peak_flops, 1e12) / peak_flops  # fp32 add (1 FLOP per 12 bytes), 1 TB/s
    d = Doc(t["title"], lang)
    d.step(t["mfu"], "achieved / (G x peak)", f"{num(achieved_flops)} / ({devices} x {num(peak_flops)})",
           f"{value:.1%}")
    d.step(t["from_tokens"], "tokens/s x FLOPs/token", f"{num(tokens_per_s)} x {num(per_token)}",
           f"{num(achieved_flops)} FLOP/s  ({cfg.name}, T={seq})")
    d.step(t["hfu"], "MFU x (train + recompute) / train", f"{value:.3f} x {num(per_token_hw)} / {num(per_token)}",
           f"{hfu:.1%}")
    d.step(t["busy"], "min(P, I x BW) / P, I = 1/12",
           f"min({num(peak_flops)}, {1 / 12:.4f} x 1e12) / {num(peak_flops)}", f"{busy:.3%} (GPU util 100%)")
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(achieved_flops=achieved_flops, peak_flops=peak_flops, devices=devices, mfu=value,
                    model_flops_per_token=per_token, hardware_flops_per_token_full=per_token_hw, hfu_full=hfu,
                    memory_bound_kernel_mfu=busy)
    return d


TOPICS = [
    Topic("matmul", "矩阵乘法",
          {"en": "output shape and FLOPs of (M,K)x(K,N) = 2MNK; a Linear layer's forward vs training (6MKN)",
           "zh": "(M,K)x(K,N) 的输出形状与 FLOPs = 2MNK；线性层前向与训练 (6MKN) 的对比"},
          matmul,
          [Arg("--a", dict(type=ints, default=None, help="shape M,K (default 2,3)")),
           Arg("--b", dict(type=ints, default=None, help="shape K,N (default 3,4)"))],
          "trainwise explain matmul --a 4096,4096 --b 4096,11008"),
    Topic("einsum", "爱因斯坦求和",
          {"en": "output shape and FLOPs of any einsum expression with given shapes",
           "zh": "任意 einsum 表达式在给定形状下的输出形状与 FLOPs"},
          einsum,
          [Arg("--equation", dict(default="bhtd,bhsd->bhts", help="einsum expression")),
           Arg("--shapes", dict(type=ints, nargs="+", default=None, help="one comma-separated shape per operand"))],
          "trainwise explain einsum --equation mk,kn->mn --shapes 2,3 3,4"),
    Topic("dtype", "数据类型",
          {"en": "FP32/FP16/BF16/FP8 bit layout, max, smallest normal, epsilon; overflow and underflow",
           "zh": "FP32/FP16/BF16/FP8 的位布局、最大值、最小正规数、机器精度；上溢与下溢演示"},
          dtype,
          [Arg("--overflow", dict(type=float, default=70000.0, help="value to cast (overflow demo)")),
           Arg("--underflow", dict(type=float, default=1e-8, help="value to cast (underflow demo)"))],
          "trainwise explain dtype --overflow 1e5"),
    Topic("roofline", "算术强度",
          {"en": "ridge point P/BW and where an arithmetic intensity lands (memory- or compute-bound)",
           "zh": "屋顶线模型：脊点 P/BW，以及某个算术强度落在访存受限还是计算受限区域"},
          roofline,
          [Arg("--peak-flops", dict(type=float, default=100e12, help="peak FLOP/s (default 100e12)")),
           Arg("--bandwidth", dict(type=float, default=1e12, help="memory bandwidth, bytes/s (default 1e12)")),
           Arg("--intensity", dict(type=float, nargs="+", default=None, help="FLOPs/byte (default 20 150)"))],
          "trainwise explain roofline --peak-flops 989e12 --bandwidth 3.35e12 --intensity 50 500"),
    Topic("mfu", "模型算力利用率",
          {"en": "MFU = achieved / peak model FLOP/s, and why GPU utilisation is not MFU",
           "zh": "MFU = 实际模型 FLOP/s / 峰值，以及为什么 GPU 利用率不等于 MFU"},
          mfu,
          [Arg("--achieved-flops", dict(type=float, default=40e12, help="achieved model FLOP/s (default 40e12)")),
           Arg("--peak-flops", dict(type=float, default=100e12, help="peak FLOP/s per device (default 100e12)")),
           Arg("--devices", dict(type=int, default=1, help="number of devices G"))],
          "trainwise explain mfu --achieved-flops 4e14 --peak-flops 989e12"),
]
