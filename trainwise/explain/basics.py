"""Topics of the model's arithmetic: gradient descent, cross-entropy, embedding, tensor."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainwise.config import ModelConfig
from trainwise.cost.memory import DTYPE_BYTES, tensor_bytes
from trainwise.cost.params import embedding_params
from trainwise.errors import TrainwiseError
from trainwise.explain.render import Doc, num
from trainwise.explain.topic import Arg, Topic, floats, ints

# ---------------------------------------------------------------------------------------------------
GD = {
    "en": dict(title="Gradient descent: one step on y_hat = w x with squared error",
               pred="prediction", loss="loss", grad="gradient (chain rule)", auto="gradient (autograd)",
               update="update", new_pred="new prediction", new_loss="new loss",
               fell="The loss fell from {a} to {b}: the step moved w against the gradient.",
               run=["trainwise's trainer does this for every parameter at every step: loss.backward() "
                    "computes the gradients by autograd, the optimizer (AdamW by default) applies the update.",
                    "train.lr is the step size; too large and the loss jumps instead of falling "
                    "(try --lr 0.3 here)."]),
    "zh": dict(title="梯度下降：对 y_hat = w x 和平方误差走一步",
               pred="预测", loss="损失", grad="梯度（链式法则）", auto="梯度（自动求导）", update="参数更新",
               new_pred="新预测", new_loss="新损失",
               fell="损失从 {a} 降到 {b}：沿负梯度方向更新了 w。",
               run=["训练器在每一步对每个参数都这样做：loss.backward() 用自动求导算出梯度，"
                    "优化器（默认 AdamW）执行参数更新。",
                    "train.lr 就是学习率（步长）；太大时损失会震荡而不是下降（可在这里试 --lr 0.3）。"]),
}


def gradient_descent(w: float = 1.0, x: float = 3.0, y: float = 6.0, lr: float = 0.05, lang: str = "en") -> Doc:
    t = GD[lang]
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    y_hat = wt * x
    loss = (y_hat - y) ** 2
    loss.backward()
    grad_chain = 2 * (w * x - y) * x  # dL/dy_hat x dy_hat/dw
    opt = torch.optim.SGD([wt], lr=lr)  # the update rule, by the optimizer the trainer also uses
    opt.step()
    new_w = wt.item()
    new_pred = new_w * x
    new_loss = (new_pred - y) ** 2
    d = Doc(t["title"], lang)
    d.step(t["pred"], "y_hat = w x", f"{num(w)} x {num(x)}", num(y_hat.item()))
    d.step(t["loss"], "L = (y_hat - y)^2", f"({num(y_hat.item())} - {num(y)})^2", num(loss.item()))
    d.step(t["grad"], "dL/dw = 2 (y_hat - y) x", f"2 x ({num(y_hat.item() - y)}) x {num(x)}", num(grad_chain))
    d.step(t["auto"], "torch: loss.backward(); w.grad", "", num(wt.grad.item()))
    d.step(t["update"], "w <- w - lr dL/dw", f"{num(w)} - {num(lr)} x ({num(wt.grad.item())})", num(new_w))
    d.step(t["new_pred"], "y_hat = w x", f"{num(new_w)} x {num(x)}", num(new_pred))
    d.step(t["new_loss"], "L = (y_hat - y)^2", f"({num(new_pred)} - {num(y)})^2", num(new_loss))
    d.text()
    d.text(t["fell"].format(a=num(loss.item()), b=num(new_loss)))
    d.where(*t["run"])
    d.values = dict(w=w, x=x, y=y, lr=lr, prediction=y_hat.item(), loss=loss.item(), grad_chain_rule=grad_chain,
                    grad_autograd=wt.grad.item(), new_w=new_w, new_prediction=new_pred, new_loss=new_loss)
    return d


# ---------------------------------------------------------------------------------------------------
CE = {
    "en": dict(title="Cross-entropy: the loss of a next-token prediction", logits="logits z",
               exp="exp", softmax="softmax p_i", loss="loss", torch="F.cross_entropy",
               falls="How the loss falls as the probability of the correct class rises:",
               run=["The model's last layer gives V logits per position; Transformer.forward computes "
                    "F.cross_entropy(logits, targets), the mean of -ln p_c over the B x T positions.",
                    "At initialisation p_c is about 1/V, so the first loss is about ln V = ln {V} = {lnV} "
                    "for the default vocabulary; a model that has learned something is well below it."]),
    "zh": dict(title="交叉熵：下一个 token 预测的损失", logits="logits z", exp="指数", softmax="softmax 概率 p_i",
               loss="交叉熵损失", torch="F.cross_entropy",
               falls="正确类别的概率 p_c 升高时，损失如何下降：",
               run=["模型最后一层对每个位置输出 V 个 logits；Transformer.forward 计算 "
                    "F.cross_entropy(logits, targets)，即 B x T 个位置上 -ln p_c 的平均。",
                    "初始化时 p_c 约为 1/V，所以第一步的损失约为 ln V = ln {V} = {lnV}（默认词表）；"
                    "学到东西的模型会明显低于它。"]),
}


def cross_entropy(logits: list[float] | None = None, target: int = 0, lang: str = "en") -> Doc:
    t = CE[lang]
    logits = logits or [2.0, 1.0, 0.1]
    if not 0 <= target < len(logits):
        raise TrainwiseError(f"--target {target} must index one of the {len(logits)} logits (0..{len(logits) - 1}).")
    z = torch.tensor(logits, dtype=torch.float64)
    p = torch.softmax(z, dim=-1)
    exps = [math.exp(v) for v in logits]
    loss_manual = -math.log(p[target].item())
    loss_torch = F.cross_entropy(z[None], torch.tensor([target])).item()  # what Transformer.forward calls
    d = Doc(t["title"], lang)
    d.step(t["logits"], "", "", ", ".join(num(v) for v in logits) + f"   (c = {target})")
    d.step(t["exp"], "e^z_i", "", ", ".join(num(v) for v in exps))
    d.step(t["softmax"], "p_i = e^z_i / sum_j e^z_j", f"e^z_i / {num(sum(exps))}",
           ", ".join(num(v) for v in p.tolist()))
    d.step(t["loss"], "L = -ln p_c", f"-ln {num(p[target].item())}", f"{num(loss_manual)} nats")
    d.step(t["torch"], "F.cross_entropy(z, c)", "", f"{num(loss_torch)} nats")
    d.text()
    d.text(t["falls"])
    curve = [(pc / 10, -math.log(pc / 10)) for pc in range(1, 10)]
    d.table(["p_c", "-ln p_c"], [[f"{pc:.1f}", f"{v:.3f}"] for pc, v in curve])
    V = ModelConfig().vocab_size
    d.where(*(line.format(V=V, lnV=f"{math.log(V):.3f}") for line in t["run"]))
    d.values = dict(logits=logits, target=target, probs=p.tolist(), loss=loss_manual, loss_torch=loss_torch,
                    loss_by_p={f"{pc:.1f}": v for pc, v in curve}, uniform_loss_default_vocab=math.log(V))
    return d


# ---------------------------------------------------------------------------------------------------
EMB = {
    "en": dict(title="Embedding: token ids (B, T) -> vectors (B, T, H)", ids="token ids", table="table",
               out="output", params="parameters", bytes="table bytes (fp32)", row="row lookup",
               run=["Transformer.embed is this nn.Embedding(V, H); with tie_embeddings the LM head reuses it, "
                    "so V x H is counted once (trainwise plan reports it as params_embedding).",
                    "A lookup costs no FLOPs (the planner counts 0 for it); its gradient only touches the "
                    "rows of the ids in the batch."]),
    "zh": dict(title="词嵌入：token id (B, T) -> 向量 (B, T, H)", ids="token id", table="嵌入表",
               out="输出", params="参数量", bytes="嵌入表字节数 (fp32)", row="按行查表",
               run=["Transformer.embed 就是这个 nn.Embedding(V, H)；tie_embeddings 时输出层（LM head）复用它，"
                    "V x H 只计一次（trainwise plan 中的 params_embedding）。",
                    "查表不需要浮点运算（规划器记为 0 FLOPs）；它的梯度只更新批次中出现的 id 对应的行。"]),
}


def embedding(batch: int = 2, seq_len: int = 4, vocab_size: int = 4096, d_model: int = 256, lang: str = "en") -> Doc:
    t = EMB[lang]
    torch.manual_seed(0)
    emb = nn.Embedding(vocab_size, d_model)
    ids = torch.randint(0, vocab_size, (batch, seq_len))
    out = emb(ids)  # (B, T, H)
    n = sum(p.numel() for p in emb.parameters())
    planner = embedding_params(ModelConfig(vocab_size=vocab_size, d_model=d_model, n_heads=1, n_kv_heads=1))
    size = tensor_bytes(emb.weight.shape, "fp32")
    same = torch.equal(out[0, 0], emb.weight[ids[0, 0]])
    d = Doc(t["title"], lang)
    d.step(t["ids"], "(B, T)", f"({batch}, {seq_len})",
           str(ids.tolist()[0][:8]) + (" ..." if batch > 1 or seq_len > 8 else ""))
    d.step(t["table"], "weight (V, H)", f"({vocab_size}, {d_model})", str(tuple(emb.weight.shape)))
    d.step(t["out"], "embed(ids): (B, T) -> (B, T, H)", f"({batch}, {seq_len}) -> ({batch}, {seq_len}, {d_model})",
           str(tuple(out.shape)))
    d.step(t["row"], "embed(ids)[0,0] == weight[ids[0,0]]", "", str(same))
    d.step(t["params"], "V x H", f"{vocab_size} x {d_model}", f"{n:,} (planner: {planner:,})")
    d.step(t["bytes"], "V x H x 4 B", f"{n:,} x 4", f"{size.bytes:,} B = {size.mb:.2f} MB = {size.mib:.2f} MiB")
    d.where(*t["run"])
    d.values = dict(batch=batch, seq_len=seq_len, vocab_size=vocab_size, d_model=d_model, ids_shape=list(ids.shape),
                    output_shape=list(out.shape), params=n, params_planner=planner, table_bytes=size.bytes)
    return d


# ---------------------------------------------------------------------------------------------------
TENSOR = {
    "en": dict(title="Tensor: shape, strides and bytes", shape="shape", ndim="ndim", numel="numel",
               dtype="dtype", elem="element size", stride="stride", contig="contiguous", transpose="transpose(-2,-1)",
               bytes="bytes",
               note="A transpose is a view: the same storage read with swapped strides, so it is not contiguous; "
                    ".contiguous() copies it into a new storage of the same bytes.",
               run=["This tensor is one activation of B=8, T=1024, H=4096 in bf16; autograd keeps tensors like it "
                    "for backward, which is what `trainwise plan` adds up as activations_bytes.",
                    "`trainwise mem --shape 8,1024,4096 --dtype bf16` prints the same bytes."]),
    "zh": dict(title="张量：形状、步长与字节数", shape="形状", ndim="维数", numel="元素个数", dtype="数据类型",
               elem="元素字节数", stride="步长 (stride)", contig="是否连续", transpose="转置 transpose(-2,-1)",
               bytes="字节数",
               note="转置只是视图：同一块存储、交换后的步长，因此不再连续；.contiguous() 会复制出同样字节数的新存储。",
               run=["这个张量相当于 B=8, T=1024, H=4096 的一份 bf16 激活值；反向传播需要保存这样的张量，"
                    "`trainwise plan` 把它们累加为 activations_bytes。",
                    "`trainwise mem --shape 8,1024,4096 --dtype bf16` 给出同样的字节数。"]),
}

TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8": torch.float8_e4m3fn, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64}


def tensor(shape: list[int] | None = None, dtype: str = "bf16", lang: str = "en") -> Doc:
    t = TENSOR[lang]
    shape = shape or [8, 1024, 4096]
    if dtype not in TORCH_DTYPES:
        raise TrainwiseError(f"--dtype '{dtype}': choose one of {', '.join(TORCH_DTYPES)}.")
    x = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")  # shape and strides, no memory
    xt = x.transpose(-2, -1) if x.ndim >= 2 else x
    size = tensor_bytes(shape, dtype)  # the planner's formula
    assert size.bytes == x.numel() * x.element_size() and DTYPE_BYTES[dtype] == x.element_size()
    d = Doc(t["title"], lang)
    d.step(t["shape"], "x.shape", "", str(tuple(x.shape)))
    d.step(t["ndim"], "x.ndim", "", str(x.ndim))
    d.step(t["numel"], "prod(shape)", " x ".join(map(str, shape)), f"{x.numel():,}")
    d.step(t["dtype"], "x.dtype", "", f"{x.dtype} ({dtype})")
    d.step(t["elem"], "x.element_size()", "", f"{x.element_size()} B")
    d.step(t["stride"], "x.stride()", "", str(x.stride()))
    d.step(t["contig"], "x.is_contiguous()", "", str(x.is_contiguous()))
    d.step(t["transpose"], "xt.shape, xt.stride()", "", f"{tuple(xt.shape)}, {xt.stride()}")
    d.step(t["contig"], "xt.is_contiguous()", "", str(xt.is_contiguous()))
    d.step(t["bytes"], "prod(shape) x element size", f"{x.numel():,} x {x.element_size()}",
           f"{size.bytes:,} B = {size.mb:,.2f} MB = {size.mib:,.2f} MiB")
    d.text()
    d.text(t["note"])
    d.where(*t["run"])
    d.values = dict(shape=list(shape), dtype=dtype, ndim=x.ndim, numel=x.numel(), element_size=x.element_size(),
                    stride=list(x.stride()), contiguous=x.is_contiguous(), transpose_shape=list(xt.shape),
                    transpose_stride=list(xt.stride()), transpose_contiguous=xt.is_contiguous(), bytes=size.bytes,
                    MB=size.mb, MiB=size.mib)
    return d


TOPICS = [
    Topic("gradient-descent", "梯度下降",
          {"en": "one update of y_hat = w x: loss, gradient by chain rule and autograd, new w",
           "zh": "对 y_hat = w x 做一次更新：损失、链式法则与自动求导得到的梯度、新的 w"},
          gradient_descent,
          [Arg("--w", dict(type=float, default=1.0, help="initial weight")),
           Arg("--x", dict(type=float, default=3.0, help="input")),
           Arg("--y", dict(type=float, default=6.0, help="target")),
           Arg("--lr", dict(type=float, default=0.05, help="learning rate"))],
          "trainwise explain gradient-descent --lr 0.3"),
    Topic("cross-entropy", "交叉熵",
          {"en": "softmax over logits and -ln p_c; how the loss falls as p_c rises",
           "zh": "logits 的 softmax 与 -ln p_c；p_c 升高时损失如何下降"},
          cross_entropy,
          [Arg("--logits", dict(type=floats, default=None, help="comma-separated logits (default 2,1,0.1)")),
           Arg("--target", dict(type=int, default=0, help="index of the correct class"))],
          "trainwise explain cross-entropy --logits 3,1,0.2 --target 1"),
    Topic("embedding", "词嵌入",
          {"en": "(B,T) token ids -> (B,T,H) vectors with nn.Embedding; parameters V x H",
           "zh": "用 nn.Embedding 把 (B,T) 的 token id 变成 (B,T,H) 向量；参数量 V x H"},
          embedding,
          [Arg("--batch", dict(type=int, default=2, help="B")), Arg("--seq-len", dict(type=int, default=4, help="T")),
           Arg("--vocab-size", dict(type=int, default=4096, help="V")),
           Arg("--d-model", dict(type=int, default=256, help="H"))],
          "trainwise explain embedding --vocab-size 50257 --d-model 768"),
    Topic("tensor", "张量",
          {"en": "shape, ndim, numel, dtype, stride, contiguity of a tensor and its transpose; bytes in B, MB, MiB",
           "zh": "张量及其转置的形状、维数、元素个数、数据类型、步长、连续性；字节数（B、MB、MiB）"},
          tensor,
          [Arg("--shape", dict(type=ints, default=None, help="comma-separated sizes (default 8,1024,4096)")),
           Arg("--dtype", dict(default="bf16", help=", ".join(TORCH_DTYPES)))],
          "trainwise explain tensor --shape 2,3,4 --dtype fp32"),
]
