"""Topic of mixed precision: what autocast runs in which dtype on this device, why fp16 needs a GradScaler,
and the bytes per parameter of the planner's precision recipes (trainwise.cost.recipe.RECIPES)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainwise.config import ModelConfig
from trainwise.cost.memory import activation_bytes, state_bytes
from trainwise.cost.recipe import RECIPES
from trainwise.errors import TrainwiseError
from trainwise.explain.render import Doc, num
from trainwise.explain.topic import Arg, Topic
from trainwise.runtime.precision import DTYPE_NAMES, autocast, resolve_device, resolve_precision

ACT_BATCH, ACT_SEQ = 8, 256  # the activation column: trainwise-small at micro-batch 8, T = 256

AMP = {
    "en": dict(title="Automatic mixed precision: autocast dtypes, loss scaling, bytes per parameter",
               device="device", auto="train.precision = auto here", shown="autocast dtype shown",
               measured="Under autocast({dt}) on {dev}, measured:",
               cols=["op", "input", "output"], weight="weight (the parameter)", grad="weight.grad after backward",
               under_head="An fp16 gradient too small for fp16, without and with a GradScaler (h = Linear(x) under "
                          "fp16 autocast, dL/dh = g reaches h's backward in fp16):",
               tiny="smallest fp16 (subnormal)", g="gradient g", no_scale="w.grad, fp16 autocast, no scaler",
               bf16="w.grad, bf16 autocast, no scaler", scale="scale S (GradScaler init_scale)",
               scaled="w.grad, fp16 autocast, loss x S",
               unscaled="w.grad after unscale_", err="relative error",
               recipes_head="Bytes per parameter of the planner's recipes with AdamW (trainwise.cost.memory), and "
                            "the activations they save for trainwise-small at B = {b}, T = {t}:",
               rcols=["recipe", "params", "grads", "m + v", "master", "total B/param", "activations MB", "MiB"],
               why="Autocast runs matmuls (Linear, attention) in the low precision and keeps reductions that lose "
                   "accuracy (losses, and on GPUs softmax and norms) in fp32; the weights and their gradients stay "
                   "fp32. fp16 has only 5 exponent bits: nothing below 2^-24 (its smallest subnormal) is representable "
                   "and gradients under half of it round to 0. GradScaler multiplies the loss by S before backward and "
                   "divides the gradients by S before the optimizer step, skipping steps whose gradients overflowed. "
                   "bf16 has fp32's range and needs no scaling.",
               run=["train.precision = auto picks {p} here ({why}); bf16 is the planner's 'amp' recipe: model states "
                    "stay 16 B/param with AdamW, only activations shrink.",
                    "On a GPU without bf16 the trainer uses fp16 with torch.amp.GradScaler, as here; "
                    "`trainwise plan --precision amp` predicts the memory of either."]),
    "zh": dict(title="自动混合精度：autocast 的数据类型、损失缩放、每个参数的字节数",
               device="设备", auto="此处 train.precision = auto 的选择", shown="展示的 autocast 类型",
               measured="在 {dev} 上 autocast({dt}) 下实测：",
               cols=["运算", "输入", "输出"], weight="权重（参数本身）", grad="反向传播后的 weight.grad",
               under_head="一个对 fp16 来说太小的梯度，不用与使用 GradScaler（h = Linear(x) 在 fp16 autocast 下计算，"
                          "dL/dh = g 以 fp16 进入 h 的反向传播）：",
               tiny="fp16 最小正数（非正规数）", g="梯度 g", no_scale="w.grad，fp16 autocast，不缩放",
               bf16="w.grad，bf16 autocast，不缩放", scale="缩放因子 S（GradScaler init_scale）",
               scaled="w.grad，fp16 autocast，损失 x S",
               unscaled="unscale_ 之后的 w.grad", err="相对误差",
               recipes_head="规划器各精度方案在 AdamW 下每个参数的字节数 (trainwise.cost.memory)，以及 trainwise-small "
                            "在 B = {b}、T = {t} 时保存的激活值：",
               rcols=["方案", "参数", "梯度", "m + v", "主权重", "合计 B/参数", "激活值 MB", "MiB"],
               why="autocast 让矩阵乘法（Linear、注意力）用低精度计算，把会损失精度的归约（损失函数，GPU 上还有 "
                   "softmax 和归一化）保留在 fp32；权重和梯度仍是 fp32。"
                   "fp16 只有 5 个指数位：小于 2^-24（最小的非正规数）的值无法表示，小于它一半的梯度会舍入为 0。"
                   "GradScaler（梯度缩放器）在反向传播前把损失乘以 S、在优化器更新前把梯度除以 S，并跳过梯度溢出的步。"
                   "bf16 的范围与 fp32 相同，不需要缩放。",
               run=["train.precision = auto 在这里选择 {p}（{why}）；bf16 就是规划器的 amp 方案：AdamW 下模型状态仍是 "
                    "16 B/参数，只有激活值变小。",
                    "在不支持 bf16 的 GPU 上训练器使用 fp16 和 torch.amp.GradScaler，正如这里所示；"
                    "`trainwise plan --precision amp` 预测两者的显存。"]),
}


def _measured_dtypes(device: torch.device, dt: str) -> dict[str, tuple[str, str]]:
    """(input dtype, output dtype) of a Linear, a softmax and a loss under the trainer's autocast, and of the
    weight and its gradient: measured, since the autocast op lists differ between CPU and CUDA."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4, device=device)
    x = torch.randn(2, 8, device=device)
    y = torch.tensor([0, 1], device=device)
    with autocast(device, dt):
        h = lin(x)
        p = torch.softmax(h, dim=-1)
        loss = F.cross_entropy(h, y)
    loss.backward()
    s = lambda t: DTYPE_NAMES.get(t.dtype, str(t.dtype))  # noqa: E731
    return {"linear": (s(x), s(h)), "softmax": (s(h), s(p)), "cross_entropy": (s(h), s(loss)),
            "weight": (s(lin.weight), s(lin.weight)), "weight_grad": (s(loss), s(lin.weight.grad))}


def _tiny_grad(device: torch.device, dt: str, g: float, scale: float | None) -> tuple[float, float]:
    """w.grad of L = g h with h = Linear(x = 1; w = 1) under autocast(dt): (as backward left it, after the
    scaler's unscale_). scale=None: no GradScaler."""
    w = torch.nn.Parameter(torch.ones(1, 1, device=device))
    x = torch.ones(1, 1, device=device)
    scaler = torch.amp.GradScaler(device.type, init_scale=scale or 1.0, enabled=scale is not None)
    with autocast(device, dt):
        h = F.linear(x, w)  # (1, 1) in dt; its backward runs in dt
    loss = (h.float() * g).sum()
    scaler.scale(loss).backward()
    raw = w.grad.item()
    scaler.unscale_(torch.optim.SGD([w], lr=0.0))
    return raw, w.grad.item()


def _underflow(d: Doc, t: dict, device: torch.device, grad: float, scale: float) -> dict:
    """The small gradient through fp16 without a scaler, through bf16, and through fp16 with a GradScaler."""
    tiny = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps  # 2^-14 x 2^-10
    _, plain = _tiny_grad(device, "fp16", grad, None)
    _, plain_bf16 = _tiny_grad(device, "bf16", grad, None)
    scaled, unscaled = _tiny_grad(device, "fp16", grad, scale)
    d.text()
    d.text(t["under_head"])
    d.step(t["tiny"], "2^-24", "", num(tiny))
    d.step(t["g"], "dL/dh = dL/dw (x = 1)", "", num(grad))
    d.step(t["no_scale"], "fp16(g)", f"fp16({num(grad)})", num(plain))
    d.step(t["bf16"], "bf16(g)", f"bf16({num(grad)})", num(plain_bf16))
    d.step(t["scale"], "S", "", num(scale))
    d.step(t["scaled"], "fp16(g S)", f"fp16({num(grad)} x {num(scale)})", num(scaled))
    d.step(t["unscaled"], "w.grad / S", f"{num(scaled)} / {num(scale)}", num(unscaled))
    d.step(t["err"], "unscaled / g - 1", "", f"{unscaled / grad - 1:.2e}" if grad else "-")
    return dict(grad=grad, fp16_smallest_subnormal=tiny, fp16_no_scaler=plain, bf16_no_scaler=plain_bf16,
                scale=scale, fp16_scaled=scaled, fp16_unscaled=unscaled)


def _recipes(d: Doc, t: dict) -> dict:
    """Bytes per parameter (AdamW) and trainwise-small's activation bytes of each planner recipe."""
    d.text()
    d.text(t["recipes_head"].format(b=ACT_BATCH, t=ACT_SEQ))
    recipes, rows = {}, []
    for name in ("fp32", "amp", "bf16-mixed", "bf16-pure"):
        r = RECIPES[name]
        sb = state_bytes(1, r, "adamw")  # one parameter: the bytes per parameter
        act = activation_bytes(ModelConfig(), r, ACT_BATCH, ACT_SEQ)
        recipes[name] = dict(params=sb.params, grads=sb.grads, optimizer=sb.optimizer, master=sb.master,
                             total=sb.total, activation_bytes=act, description=r.description)
        rows.append([name, sb.params, sb.grads, sb.optimizer, sb.master, sb.total, f"{act / 1e6:.1f}",
                     f"{act / 2**20:.1f}"])
    d.table(t["rcols"], rows)
    return recipes


def amp(grad: float = 1e-8, scale: float = 65536.0, dtype: str | None = None, lang: str = "en") -> Doc:
    t = AMP[lang]
    if not scale >= 1:
        raise TrainwiseError(f"--scale {scale} must be >= 1 (GradScaler's default is 65536 = 2^16).")
    device = resolve_device("auto")
    precision, reason = resolve_precision("auto", device)
    dt = dtype or (precision if precision in ("bf16", "fp16") else "bf16")
    if dt not in ("bf16", "fp16"):
        raise TrainwiseError(f"--dtype {dt} must be bf16 or fp16 (the low-precision dtypes autocast runs in).")
    d = Doc(t["title"], lang)
    d.step(t["device"], str(device))
    d.step(t["auto"], precision, "", reason)
    d.step(t["shown"], dt)
    d.text()
    d.text(t["measured"].format(dt=dt, dev=device))
    dts = _measured_dtypes(device, dt)
    names = {"linear": "Linear(x)", "softmax": "softmax(h)", "cross_entropy": "cross_entropy(h, y)",
             "weight": t["weight"], "weight_grad": t["grad"]}
    d.table(t["cols"], [[names[k], a, b] for k, (a, b) in dts.items()])

    underflow = _underflow(d, t, device, grad, scale)
    recipes = _recipes(d, t)
    d.text()
    d.text(t["why"])
    d.where(*(line.format(p=precision, why=reason) for line in t["run"]))
    d.values = dict(device=str(device), precision_auto=precision, precision_reason=reason, autocast_dtype=dt,
                    dtypes={k: dict(input=a, output=b) for k, (a, b) in dts.items()},
                    underflow=underflow, recipes=recipes, activation_batch=ACT_BATCH, activation_seq_len=ACT_SEQ)
    return d


TOPICS = [
    Topic("amp", "自动混合精度",
          {"en": "autocast dtypes on this device (measured); an fp16 gradient lost, then kept by a GradScaler; "
                 "bytes/param",
           "zh": "本设备上的 autocast：各运算的数据类型（实测）；fp16 梯度下溢与 GradScaler；"
                 "fp32/amp/bf16 方案每参数字节数"},
          amp,
          [Arg("--grad", dict(type=float, default=1e-8, help="the small gradient g (default 1e-8)")),
           Arg("--scale", dict(type=float, default=65536.0, help="GradScaler's scale S (default 65536 = 2^16)")),
           Arg("--dtype", dict(choices=["bf16", "fp16"], default=None,
                               help="autocast dtype of the op table (default: what train.precision=auto picks)"))],
          "trainwise explain amp --grad 1e-6 --scale 1024"),
]
