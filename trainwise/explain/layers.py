"""Topics of the model's layers: activations and the MLP they sit in, and einops reshapes."""

from __future__ import annotations

import math

import torch

from trainwise.config import ModelConfig, default_ffn_hidden
from trainwise.cost.flops import mlp_flops
from trainwise.cost.params import mlp_params
from trainwise.errors import TrainwiseError
from trainwise.explain.compute import _counted
from trainwise.explain.render import Doc, num
from trainwise.explain.topic import Arg, Topic, floats, ints
from trainwise.model.layers import ACTIVATION_FNS, MLP

# ---------------------------------------------------------------------------------------------------
ACT = {
    "en": dict(title="Activations: ReLU, GELU, SiLU, SwiGLU and the MLP around them", values="f(x)",
               grads="f'(x) by autograd", fn="function", at1="at x = 1", swiglu="SwiGLU(g, u) = SiLU(g) u",
               mlp_head="The MLP of width F around them, H = {H} (trainwise.model.MLP; parameters and FLOPs "
                        "counted on it, one token, by the trainer's FLOP counter):",
               plain="GELU MLP", gated="SwiGLU MLP",
               same="3 H F = 2 H (4H) -> F = 2/3 x 4H", model="64 ceil(8H/3 / 64), as the model rounds",
               cols=["MLP", "H x F matrices", "parameters", "fwd FLOPs/token", "planner", "train FLOPs/token"],
               why="ReLU cuts negatives to 0 (its derivative is 0 or 1); GELU and SiLU are smooth and let a little "
                   "negative signal through. SwiGLU multiplies a SiLU gate by a second projection, so its MLP has "
                   "three H x F matrices instead of two: F = 2/3 x 4H keeps the parameters (and FLOPs) of a 4H MLP.",
               run=["model.activation picks the function (trainwise-small: {a}); trainwise.model.MLP is the layer "
                    "counted here, and model.ffn_hidden = 0 means the width derived above.",
                    "`trainwise plan --explain` shows the same MLP FLOPs per layer (2 x parameters per token)."]),
    "zh": dict(title="激活函数：ReLU、GELU、SiLU、SwiGLU 以及它们所在的 MLP", values="f(x)",
               grads="f'(x)（自动求导）", fn="函数", at1="x = 1 时", swiglu="SwiGLU(g, u) = SiLU(g) u",
               mlp_head="它们所在的宽度为 F 的 MLP，H = {H}（trainwise.model.MLP；参数量和 FLOPs 都在它上面"
                        "用训练器的 FLOP 计数器对一个 token 计数）：",
               plain="GELU MLP", gated="SwiGLU MLP",
               same="3 H F = 2 H (4H) -> F = 2/3 x 4H", model="64 ceil(8H/3 / 64)，模型这样向上取整",
               cols=["MLP", "H x F 矩阵", "参数量", "前向 FLOPs/token", "规划器", "训练 FLOPs/token"],
               why="ReLU 把负数截为 0（导数为 0 或 1）；GELU 和 SiLU 是光滑的，允许少量负信号通过。SwiGLU 用 SiLU "
                   "门控乘以第二个投影，所以它的 MLP 有三个 H x F 矩阵而不是两个：F = 2/3 x 4H 时参数量（和 FLOPs）"
                   "与 4H 的普通 MLP 相同。",
               run=["model.activation 选择激活函数（trainwise-small：{a}）；这里计数的就是 trainwise.model.MLP，"
                    "model.ffn_hidden = 0 表示上面推导出的宽度。",
                    "`trainwise plan --explain` 给出同样的每层 MLP FLOPs（每个 token 2 x 参数量）。"]),
}
CURVES = ("relu", "gelu", "gelu_tanh", "silu")


def _phi(x: float) -> float:
    """Standard normal CDF."""
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _curves(inputs: list[float]) -> dict[str, dict[str, list[float]]]:
    """Values and autograd derivatives of the model's own activation functions at the inputs."""
    out = {}
    for name in CURVES:
        x = torch.tensor(inputs, dtype=torch.float64, requires_grad=True)
        y = ACTIVATION_FNS[name](x)
        y.sum().backward()  # elementwise: d sum / dx_i = f'(x_i)
        out[name] = dict(values=y.tolist(), grads=x.grad.tolist())
    return out


def _mlp_counts(d_model: int, activation: str) -> tuple[int, int, int, int, float]:
    """(F, parameters, forward FLOPs, training FLOPs) of one token through trainwise.model.MLP, counted on
    the meta device (shapes only, so any width is instant) by the trainer's FLOP counter; and the
    planner's forward FLOPs for the same layer."""
    # only the MLP is built: one head and learned positions put no constraint of their own on H
    cfg = ModelConfig(d_model=d_model, n_heads=1, n_kv_heads=1, position="learned", activation=activation)
    with torch.device("meta"):
        mlp = MLP(cfg)
        x = torch.empty(1, d_model, requires_grad=True)
    n = sum(p.numel() for p in mlp.parameters())
    return (cfg.ffn_hidden, n, _counted(lambda: mlp(x)), _counted(lambda: mlp(x).sum().backward()),
            mlp_flops(cfg, cfg.ffn_hidden))


def _curve_tables(d: Doc, t: dict, inputs: list[float]) -> dict:
    curves = _curves(inputs)
    head = [t["fn"]] + [f"x = {num(x)}" for x in inputs]
    d.text(t["values"] + ":")
    d.table(head, [[n] + [f"{v:.4f}" for v in curves[n]["values"]] for n in CURVES])
    d.text()
    d.text(t["grads"] + ":")
    d.table(head, [[n] + [f"{v:.4f}" for v in curves[n]["grads"]] for n in CURVES])
    return dict(inputs=inputs, curves=curves)


def _by_hand(d: Doc, t: dict, gate: float, up: float) -> dict:
    """The formulas by hand at x = 1 beside what torch computes there; SwiGLU and its two derivatives."""
    at1 = {n: c["values"][0] for n, c in _curves([1.0]).items()}
    k = math.sqrt(2 / math.pi)
    gelu_tanh = 0.5 * (1 + math.tanh(k * (1 + 0.044715)))
    d.step(f"ReLU {t['at1']}", "max(0, x)", "max(0, 1)", f"{max(0.0, 1.0):.4f}   (torch {at1['relu']:.4f})")
    d.step(f"GELU {t['at1']}", "x Phi(x)", f"1 x {_phi(1):.4f}", f"{_phi(1):.4f}   (torch {at1['gelu']:.4f})")
    d.step(f"GELU tanh {t['at1']}", "x/2 (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))",
           f"0.5 (1 + tanh({k * 1.044715:.4f}))", f"{gelu_tanh:.4f}   (torch {at1['gelu_tanh']:.4f})")
    d.step(f"SiLU {t['at1']}", "x sigmoid(x)", f"1 x {_sigmoid(1):.4f}",
           f"{_sigmoid(1):.4f}   (torch {at1['silu']:.4f})")
    g = torch.tensor(gate, dtype=torch.float64, requires_grad=True)
    u = torch.tensor(up, dtype=torch.float64, requires_grad=True)
    s = ACTIVATION_FNS["swiglu"](g) * u  # what MLP.forward computes per element: act(gate) * up
    s.backward()
    silu_grad = _curves([gate])["silu"]["grads"][0]
    d.step("SwiGLU", t["swiglu"], f"SiLU({num(gate)}) x {num(up)}", f"{s.item():.4f}")
    d.step("dSwiGLU/dg", "SiLU'(g) u", f"{silu_grad:.4f} x {num(up)}", f"{g.grad.item():.4f}   (autograd)")
    d.step("dSwiGLU/du", "SiLU(g)", f"SiLU({num(gate)})", f"{u.grad.item():.4f}   (autograd)")
    return dict(at_1=at1, gelu_1_exact=_phi(1), gelu_1_tanh=gelu_tanh, silu_1=_sigmoid(1),
                swiglu=dict(gate=gate, up=up, value=s.item(), d_gate=g.grad.item(), d_up=u.grad.item()))


def _mlp_section(d: Doc, t: dict, H: int) -> dict:
    """Width, parameters and FLOPs per token of a GELU and a SwiGLU MLP of width H, as the model builds them."""
    f_plain, n_plain, fwd_plain, train_plain, planner_plain = _mlp_counts(H, "gelu")
    f_gated, n_gated, fwd_gated, train_gated, planner_gated = _mlp_counts(H, "swiglu")
    assert f_gated == default_ffn_hidden(H, "swiglu") and n_plain == mlp_params(H, f_plain, False, False)
    exact = 8 * H / 3
    d.text(t["mlp_head"].format(H=H))
    d.step(t["plain"], "F = 4H", f"4 x {H}", f"{f_plain:,}")
    d.step(t["gated"], t["same"], "8H/3", f"{num(exact)}")
    d.step("", t["model"], f"64 x ceil({num(exact / 64)})", f"{f_gated:,}")
    d.text()
    d.table(t["cols"], [[t["plain"], f"2 x {H} x {f_plain:,}", f"{n_plain:,}", f"{fwd_plain:,}", num(planner_plain),
                         f"{train_plain:,}"],
                        [t["gated"], f"3 x {H} x {f_gated:,}", f"{n_gated:,}", f"{fwd_gated:,}", num(planner_gated),
                         f"{train_gated:,}"]])
    return dict(d_model=H, ffn_hidden_plain=f_plain, ffn_hidden_swiglu_exact=exact, ffn_hidden_swiglu=f_gated,
                params_plain=n_plain, params_swiglu=n_gated, flops_per_token_plain=fwd_plain,
                flops_per_token_swiglu=fwd_gated, train_flops_per_token_plain=train_plain,
                train_flops_per_token_swiglu=train_gated)


def activation(inputs: list[float] | None = None, d_model: int = 256, gate: float = 1.0, up: float = 2.0,
               lang: str = "en") -> Doc:
    t = ACT[lang]
    inputs = inputs or [-2.0, -1.0, 0.0, 1.0, 2.0]
    if d_model < 1:
        raise TrainwiseError(f"--d-model {d_model} must be a positive width, e.g. 256.")
    d = Doc(t["title"], lang)
    values = _curve_tables(d, t, inputs)
    d.text()
    values |= _by_hand(d, t, gate, up)
    d.text()
    values |= _mlp_section(d, t, d_model)
    d.text()
    d.text(t["why"])
    d.where(*(line.format(a=ModelConfig().activation) for line in t["run"]))
    d.values = values
    return d


# ---------------------------------------------------------------------------------------------------
EIN = {
    "en": dict(title="einops: rearrange and reduce on (B, T, H) activations",
               inputs="x = torch.arange(B T H).reshape(B, T, H) with B, T, H = {B}, {T}, {H}; heads h = {h}, head "
                      "dimension d = H / h = {d}; o = an attention output (B, h, T, d), contiguous as SDPA returns it.",
               torch="torch", shape="shape", strides="strides", equal="equal", storage="storage",
               view="shares {src}'s storage: a view, no copy", copy="new storage: a copy",
               why="rearrange names the axes instead of counting them: '(h d)' splits H into heads, 'b h t d' "
                   "moves them, '(b t)' merges. It is a view when the new axes can be read from the old storage with "
                   "strides alone, and a copy when a merge spans axes that are not adjacent in memory. reduce "
                   "applies mean/sum/max over the axes that disappear; it always writes a new tensor.",
               run=["Attention.forward splits q, k, v with rearrange(q, \"b t (h d) -> b h t d\") and merges the "
                    "heads back with \"b h t d -> b t (h d)\" before the output projection: example 1 and 2.",
                    "The loss flattens the (B, T, V) logits to (B T, V) for cross-entropy: "
                    "example 3 (a view, no memory); `trainwise explain tensor` shows strides of any shape."]),
    "zh": dict(title="einops 张量重排：对 (B, T, H) 激活值做 rearrange 与 reduce",
               inputs="x = torch.arange(B T H).reshape(B, T, H)，B, T, H = {B}, {T}, {H}；头数 h = {h}，每头维度 "
                      "d = H / h = {d}；o 是注意力输出 (B, h, T, d)，和 SDPA 返回的一样是连续的。",
               torch="torch 等价写法", shape="形状", strides="步长 (stride)", equal="结果相同", storage="存储",
               view="与 {src} 共享存储：视图，不复制", copy="新的存储：复制",
               why="rearrange 用名字而不是位置来指明维度：'(h d)' 把 H 拆成多个头，'b h t d' 移动维度，"
                   "'(b t)' 合并维度。如果新维度只靠步长就能从原存储读出，结果是视图；"
                   "如果合并的维度在内存中不相邻，就要复制。reduce 对消失的维度做 mean/sum/max，总是写出一个新张量。",
               run=["Attention.forward 用 rearrange(q, \"b t (h d) -> b h t d\") 拆分 q、k、v 的多头，在输出投影前用 "
                    "\"b h t d -> b t (h d)\" 合并回来：即例 1 和例 2。",
                    "损失函数把 (B, T, V) 的 logits 展平为 (B T, V) 再算交叉熵：即例 3（视图，不占内存）；"
                    "`trainwise explain tensor` 显示任意形状的步长。"]),
}


def _examples(B: int, T: int, H: int, h: int):
    """(name of the input, input, einops call as text, einops result, torch equivalent as text, its result)."""
    from einops import rearrange, reduce

    d = H // h
    x = torch.arange(B * T * H, dtype=torch.float32).reshape(B, T, H)
    o = torch.arange(B * T * H, dtype=torch.float32).reshape(B, h, T, d)  # like SDPA's output: contiguous
    return [
        ("x", x, f'rearrange(x, "b t (h d) -> b h t d", h={h})', rearrange(x, "b t (h d) -> b h t d", h=h),
         f"x.view({B}, {T}, {h}, {d}).permute(0, 2, 1, 3)", x.view(B, T, h, d).permute(0, 2, 1, 3)),
        ("o", o, 'rearrange(o, "b h t d -> b t (h d)")', rearrange(o, "b h t d -> b t (h d)"),
         f"o.transpose(1, 2).reshape({B}, {T}, {H})", o.transpose(1, 2).reshape(B, T, H)),
        ("x", x, 'rearrange(x, "b t h -> (b t) h")', rearrange(x, "b t h -> (b t) h"),
         f"x.view({B * T}, {H})", x.view(B * T, H)),
        ("x", x, 'reduce(x, "b t h -> b h", "mean")', reduce(x, "b t h -> b h", "mean"),
         "x.mean(dim=1)", x.mean(dim=1)),
    ]


def einops(shape: list[int] | None = None, heads: int = 2, lang: str = "en") -> Doc:
    t = EIN[lang]
    shape = shape or [2, 4, 8]
    if len(shape) != 3:
        raise TrainwiseError(f"--shape {','.join(map(str, shape))} must be three sizes B,T,H, e.g. 2,4,8.")
    B, T, H = shape
    if heads < 1 or H % heads:
        raise TrainwiseError(f"--heads {heads} must divide H = {H} (the head dimension is H / heads); e.g. --heads 2.")
    d = Doc(t["title"], lang)
    d.text(t["inputs"].format(B=B, T=T, H=H, h=heads, d=H // heads))
    results = []
    for i, (src, inp, ein_text, ein, torch_text, ref) in enumerate(_examples(B, T, H, heads), 1):
        is_view = ein.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
        equal = torch.equal(ein, ref)
        d.text()
        d.text(f"{i}. {ein_text}")
        d.step(t["shape"], f"{tuple(inp.shape)} -> {tuple(ein.shape)}")
        d.step(t["torch"], torch_text)
        d.step(t["equal"], "torch.equal(einops, torch)", "", str(equal))
        d.step(t["strides"], f"{inp.stride()} -> {ein.stride()}")
        d.step(t["storage"], t["view"].format(src=src) if is_view else t["copy"])
        results.append(dict(einops=ein_text, torch=torch_text, input=src, shape_before=list(inp.shape),
                            shape_after=list(ein.shape), strides_before=list(inp.stride()),
                            strides_after=list(ein.stride()), equal_to_torch=equal, view=is_view))
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(shape=[B, T, H], heads=heads, head_dim=H // heads, examples=results)
    return d


TOPICS = [
    Topic("activation", "激活函数",
          {"en": "ReLU, GELU, SiLU, SwiGLU values and autograd derivatives; SwiGLU's 2/3 x 4H width; MLP FLOPs/token",
           "zh": "ReLU、GELU、SiLU、SwiGLU 的取值与自动求导的导数；SwiGLU 的 2/3 x 4H 宽度；MLP 每 token FLOPs"},
          activation,
          [Arg("--inputs", dict(type=floats, default=None, help="comma-separated x values (default -2,-1,0,1,2)")),
           Arg("--d-model", dict(type=int, default=256, help="H of the MLP (default 256, trainwise-small)")),
           Arg("--gate", dict(type=float, default=1.0, help="SwiGLU gate input g")),
           Arg("--up", dict(type=float, default=2.0, help="SwiGLU up-projection input u"))],
          "trainwise explain activation --d-model 4096 --inputs -3,-0.5,0.5,3"),
    Topic("einops", "einops 张量重排",
          {"en": "rearrange/reduce on (B, T, H): shapes, the view/permute/mean they equal, view or copy (strides)",
           "zh": "对 (B, T, H) 做 rearrange/reduce：形状、等价的 view/permute/mean、视图还是复制（步长）"},
          einops,
          [Arg("--shape", dict(type=ints, default=None, help="B,T,H (default 2,4,8)")),
           Arg("--heads", dict(type=int, default=2, help="heads h splitting H = h x d (default 2)"))],
          "trainwise explain einops --shape 2,16,64 --heads 4"),
]
