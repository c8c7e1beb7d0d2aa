"""Topics of a training run: gradient accumulation, activation checkpointing, MoE, the full budget."""

from __future__ import annotations

import torch

from trainwise.config import ModelConfig, TrainConfig
from trainwise.cost import flops as FL
from trainwise.cost import memory as M
from trainwise.cost.layout import make_layout
from trainwise.cost.params import mlp_params, params
from trainwise.cost.recipe import OPTIMIZER_MOMENTS, get_recipe, optimizer_moments
from trainwise.cost.run import Machine, Run
from trainwise.cost.time import DEFAULT_MFU, SECONDS_PER_DAY
from trainwise.errors import TrainwiseError
from trainwise.explain.render import Doc, num
from trainwise.explain.topic import Arg, Topic
from trainwise.hardware.table import get_accelerator
from trainwise.measure.flopcount import flop_counter
from trainwise.planner.layouts import fit_run_layouts
from trainwise.planner.plan import plan_run
from trainwise.presets import get_preset
from trainwise.runtime.step import build_model, build_step, random_batches
from trainwise.units import fmt_bytes

CPU = torch.device("cpu")


def tiny_config(d_model: int = 64, n_layers: int = 2, vocab_size: int = 256, max_seq_len: int = 64) -> ModelConfig:
    """A trainwise-small-shaped model (RMSNorm, RoPE, SwiGLU, GQA) small enough to run in a second."""
    return ModelConfig(name="tiny", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=4,
                       n_kv_heads=2, max_seq_len=max_seq_len)


def _batches(cfg: ModelConfig, micro_batch: int, seq_len: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return random_batches(cfg.vocab_size, micro_batch, seq_len, k, CPU, seed=0)


# ---------------------------------------------------------------------------------------------------
GA = {
    "en": dict(title="Gradient accumulation: a big batch from small micro-batches", beff="effective batch",
               tokens="tokens per optimizer step", big="big batch", acc="accumulated", diff="max |difference|",
               loss="loss", big_desc="one backward of the {b} sequences", acc_desc="{k} x backward(loss_i / {k})",
               why="Gradients add up in .grad across backward calls. Dividing each micro-batch's mean loss by K makes "
                   "the sum equal the gradient of the mean loss over all B_micro x K sequences, so the update is the "
                   "big batch's (up to float rounding) with the memory of one micro-batch.",
               run=["train.micro_batch x train.grad_accum_steps is your batch per step; the trainer's step "
                    "(trainwise.runtime.step, used here) divides each loss by K before backward.",
                    "`trainwise plan --fit` trades micro-batch against accumulation steps to fit memory."]),
    "zh": dict(title="梯度累积：用小的微批次凑出大批次", beff="等效批大小", tokens="每次优化器更新的 token 数",
               big="大批次", acc="梯度累积", diff="最大绝对差", loss="损失",
               big_desc="{b} 条序列一次反向传播", acc_desc="{k} 次 backward(loss_i / {k})",
               why="多次 backward 时梯度在 .grad 中累加。每个微批次的平均损失除以 K，累加结果就等于全部 "
                   "B_micro x K 条序列平均损失的梯度；参数更新与大批次相同（只差浮点舍入），显存只需一个微批次。",
               run=["train.micro_batch x train.grad_accum_steps 就是每步的批大小；训练器的一步 "
                    "(trainwise.runtime.step，这里直接调用) 在 backward 前把损失除以 K。",
                    "`trainwise plan --fit` 在微批次大小与累积步数之间权衡以放进显存。"]),
}


def grad_accum(micro_batch: int = 2, steps: int = 4, seq_len: int = 16, lang: str = "en") -> Doc:
    t = GA[lang]
    if micro_batch < 1 or steps < 1 or not 1 <= seq_len <= 64:
        raise TrainwiseError("--micro-batch and --steps must be >= 1 and --seq-len between 1 and 64.")
    cfg = tiny_config()
    torch.manual_seed(0)
    step = build_step(build_model(cfg), TrainConfig(), CPU, "fp32", optimizer=False)
    model = step.model
    micro = _batches(cfg, micro_batch, seq_len, steps)
    big = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))]

    def grads(batches) -> tuple[list[torch.Tensor], float]:
        model.zero_grad(set_to_none=True)
        loss = step(batches).loss  # no optimizer: the gradients stay in .grad
        return [p.grad.clone() for p in model.parameters()], loss.item()

    g_big, loss_big = grads(big)
    g_acc, loss_acc = grads(micro)
    diff = max((a - b).abs().max().item() for a, b in zip(g_big, g_acc))
    scale = max(a.abs().max().item() for a in g_big)
    b_eff = micro_batch * steps
    d = Doc(t["title"], lang)
    d.step(t["beff"], "B_eff = B_micro x K", f"{micro_batch} x {steps}", f"{b_eff} sequences")
    d.step(t["tokens"], "B_eff x T", f"{b_eff} x {seq_len}", f"{b_eff * seq_len:,} tokens")
    d.step(t["big"] + " " + t["loss"], t["big_desc"].format(b=b_eff), "", f"{loss_big:.6f}")
    d.step(t["acc"] + " " + t["loss"], t["acc_desc"].format(k=steps), "", f"{loss_acc:.6f}")
    d.step(t["diff"], "max |g_big - g_accum|", f"({sum(p.numel() for p in model.parameters()):,} gradients)",
           f"{diff:.2e}  (max |g| = {scale:.2e})")
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(micro_batch=micro_batch, grad_accum_steps=steps, seq_len=seq_len, effective_batch=b_eff,
                    tokens_per_step=b_eff * seq_len, loss_big=loss_big, loss_accumulated=loss_acc,
                    max_abs_grad_diff=diff, max_abs_grad=scale)
    return d


# ---------------------------------------------------------------------------------------------------
CK = {
    "en": dict(title="Activation checkpointing: memory for recompute", model="model",
               saved="activations saved for backward", none="no checkpointing", mode="{m} checkpointing",
               measured="measured", planner="planner", saving="memory saved", flops="FLOPs of forward + backward",
               recompute="recompute", per_block="per block, per token", hfu="extra work",
               why="Backward needs the tensors the forward computed. Full checkpointing keeps only each block's input "
                   "and runs the block's forward again during backward; selective recomputes only the attention core. "
                   "Memory falls, FLOPs rise: recompute counts in hardware FLOPs (HFU), not in MFU.",
               run=["train.activation_checkpointing = none | selective | full; trainwise applies it from outside the "
                    "model (trainwise.runtime.parallelize.apply_activation_checkpointing, used here).",
                    "`trainwise plan --checkpointing full` predicts the same two numbers for your model; "
                    "`trainwise plan --fit` turns it on only when the run does not fit otherwise."]),
    "zh": dict(title="激活检查点：用重计算换显存", model="模型",
               saved="为反向传播保存的激活值", none="不使用检查点", mode="{m} 激活检查点",
               measured="实测", planner="规划器", saving="节省的显存", flops="前向 + 反向的 FLOPs",
               recompute="重计算", per_block="每个块、每个 token", hfu="额外计算量",
               why="反向传播需要前向算出的张量。全量激活检查点只保存每个块的输入，在反向时重新执行该块的前向；"
                   "选择性检查点只重计算注意力核心。显存下降、计算量上升：重计算计入硬件算力利用率 (HFU)，不计入 MFU。",
               run=["train.activation_checkpointing = none | selective | full；trainwise 从模型外部施加它"
                    "（trainwise.runtime.parallelize.apply_activation_checkpointing，这里直接调用）。",
                    "`trainwise plan --checkpointing full` 对你的模型预测同样的两个数；"
                    "`trainwise plan --fit` 只在放不下时才打开它。"]),
}


def measure_checkpointing(cfg: ModelConfig, micro_batch: int, seq_len: int, mode: str) -> tuple[int, int]:
    """(bytes of the unique storages autograd saves for backward, parameters excluded; FLOPs of forward +
    backward counted by the one FLOP counter) of a real trainwise Transformer under `mode`."""
    torch.manual_seed(0)
    model = build_step(build_model(cfg), TrainConfig(activation_checkpointing=mode), CPU, "fp32",
                       optimizer=False).model
    (x, y), = _batches(cfg, micro_batch, seq_len, 1)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x, y)
    with flop_counter() as counter:
        model(x, y).backward()
    return sum(saved.values()), int(counter.get_total_flops())


def checkpointing(mode: str = "full", micro_batch: int = 2, seq_len: int = 32, d_model: int = 64, n_layers: int = 2,
                  lang: str = "en") -> Doc:
    t = CK[lang]
    if mode not in ("full", "selective"):
        raise TrainwiseError(f"--mode '{mode}' must be full or selective.")
    cfg = tiny_config(d_model=d_model, n_layers=n_layers)
    if not 1 <= seq_len <= cfg.max_seq_len or micro_batch < 1 or d_model % 4:
        raise TrainwiseError(f"--seq-len must be 1..{cfg.max_seq_len}, --micro-batch >= 1, --d-model a multiple of 4.")
    recipe, tokens = get_recipe("fp32"), micro_batch * seq_len
    bytes_none, flops_none = measure_checkpointing(cfg, micro_batch, seq_len, "none")
    bytes_ck, flops_ck = measure_checkpointing(cfg, micro_batch, seq_len, mode)
    pred_none = M.activation_bytes(cfg, recipe, micro_batch, seq_len, "none")
    pred_ck = M.activation_bytes(cfg, recipe, micro_batch, seq_len, mode)
    fwd = FL.forward_flops_per_token(cfg, seq_len)
    pred_recompute = FL.recompute_flops_per_token(fwd, mode, cfg) * tokens
    per_block = M.activation_bytes_per_token_layer(cfg, recipe, 0, "none")
    d = Doc(t["title"], lang)
    d.text(f"{t['model']}: L={cfg.n_layers}, H={cfg.d_model}, nh={cfg.n_heads}, V={cfg.vocab_size}, "
           f"B={micro_batch}, T={seq_len}, fp32")
    d.step(t["per_block"] + f" ({t['none']})", "memory.activation_bytes_per_token_layer", "", f"{num(per_block)} B")
    d.step(t["per_block"] + f" ({t['mode'].format(m='full')})", "s x H (block input)", f"4 x {cfg.d_model}",
           f"{4 * cfg.d_model} B")
    d.step(t["saved"] + f", {t['none']}", f"{t['measured']}", "",
           f"{fmt_bytes(bytes_none)}   {t['planner']} {fmt_bytes(pred_none)}")
    d.step(t["saved"] + f", {t['mode'].format(m=mode)}", f"{t['measured']}", "",
           f"{fmt_bytes(bytes_ck)}   {t['planner']} {fmt_bytes(pred_ck)}")
    d.step(t["saving"], "1 - with / without", f"1 - {num(bytes_ck)} / {num(bytes_none)}",
           f"{1 - bytes_ck / bytes_none:.1%}")
    d.step(t["flops"] + f", {t['none']}", "FlopCounterMode", "", f"{num(flops_none)} FLOPs")
    d.step(t["flops"] + f", {t['mode'].format(m=mode)}", "FlopCounterMode", "", f"{num(flops_ck)} FLOPs")
    d.step(t["recompute"], "with - without", f"{num(flops_ck)} - {num(flops_none)}",
           f"{num(flops_ck - flops_none)} FLOPs   {t['planner']} {num(pred_recompute)}")
    d.step(t["hfu"], "recompute / without", f"{num(flops_ck - flops_none)} / {num(flops_none)}",
           f"+{(flops_ck - flops_none) / flops_none:.1%}")
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(mode=mode, micro_batch=micro_batch, seq_len=seq_len, d_model=d_model, n_layers=n_layers,
                    activation_bytes_none_measured=bytes_none, activation_bytes_none_planner=pred_none,
                    activation_bytes_checkpointed_measured=bytes_ck, activation_bytes_checkpointed_planner=pred_ck,
                    flops_none=flops_none, flops_checkpointed=flops_ck, recompute_flops_measured=flops_ck - flops_none,
                    recompute_flops_planner=pred_recompute, per_token_layer_bytes_planner=per_block)
    return d


# ---------------------------------------------------------------------------------------------------
MOE = {
    "en": dict(title="Mixture of experts: total vs active parameters", expert="one expert (gated MLP)",
               total="total (every expert)", active="active (top-k per token)", ratio="active / total",
               c_active="compute, 6 N_active D", c_total="6 N_total D (wrong)", states="model states (memory)",
               exact="exact train FLOPs/token (T={T})",
               why="A token passes through only top_k of the n_experts in each layer, so the FLOPs per token follow "
                   "the active parameters; 6 N_total D would overstate compute by total/active. Memory is the "
                   "opposite: every expert's weights, gradients and optimizer states are kept.",
               run=["`trainwise plan --model mixtral-8x7b` prints params_total and params_active, FLOPs from active "
                    "and memory from total; `trainwise plan --params N` treats N as dense.",
                    "trainwise's own MoE (preset trainwise-moe-small) routes with trainwise.model.moe."]),
    "zh": dict(title="混合专家 (MoE)：总参数量与激活参数量", expert="单个专家（门控 MLP）",
               total="总参数量（全部专家）", active="激活参数量（每个 token 的 top-k）", ratio="激活 / 总",
               c_active="计算量 6 N_active D", c_total="6 N_total D（错误）", states="模型状态（显存）",
               exact="精确训练 FLOPs/token (T={T})",
               why="每个 token 在每层只经过 n_experts 中的 top_k 个专家，所以每 token 的计算量取决于激活参数量；"
                   "用 6 N_total D 会把计算量高估 总/激活 倍。显存相反：所有专家的权重、梯度和优化器状态都要保存。",
               run=["`trainwise plan --model mixtral-8x7b` 给出 params_total 和 params_active，FLOPs 按激活参数、"
                    "显存按总参数计算；`trainwise plan --params N` 把 N 当作稠密模型。",
                    "trainwise 自己的 MoE（预设 trainwise-moe-small）由 trainwise.model.moe 做路由。"]),
}


def moe(model: str = "mixtral-8x7b", tokens: float = 1e12, lang: str = "en") -> Doc:
    t = MOE[lang]
    cfg = get_preset(model)
    if not cfg.n_experts:
        raise TrainwiseError(f"preset '{model}' is dense (n_experts = 0); try mixtral-8x7b, or trainwise-moe-small.")
    counts = params(cfg)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    expert = mlp_params(cfg.d_model, cfg.expert_ffn_hidden, cfg.gated, cfg.bias)
    unused = n_moe * (cfg.n_experts - cfg.top_k) * expert
    seq = min(4096, cfg.max_seq_len)
    exact = FL.flops_per_token_train(cfg, seq)
    states = M.state_bytes(counts.total, get_recipe("bf16-mixed"), "adamw")
    d = Doc(t["title"], lang)
    d.text(f"{cfg.name}: L={cfg.n_layers}, H={cfg.d_model}, n_experts={cfg.n_experts}, top_k={cfg.top_k}, "
           f"expert width F={cfg.expert_ffn_hidden}")
    d.step(t["expert"], f"{3 if cfg.gated else 2} x H x F",
           f"{3 if cfg.gated else 2} x {cfg.d_model} x {cfg.expert_ffn_hidden}", f"{expert:,}")
    d.step(t["total"], "params(cfg).total", "", f"{counts.total:,} = {counts.total / 1e9:.1f} B")
    d.step(t["active"], "total - L_moe x (E - k) x expert",
           f"{num(counts.total)} - {n_moe} x {cfg.n_experts - cfg.top_k} x {num(expert)}",
           f"{counts.active:,} = {counts.active / 1e9:.1f} B")
    d.step(t["ratio"], "", f"{num(counts.active)} / {num(counts.total)}", f"{counts.active / counts.total:.1%}")
    d.step(t["c_active"], "6 x N_active x D", f"6 x {num(counts.active)} x {num(tokens)}",
           f"{num(FL.six_nd(counts.active, tokens))} FLOPs")
    d.step(t["c_total"], "6 x N_total x D", f"6 x {num(counts.total)} x {num(tokens)}",
           f"{num(FL.six_nd(counts.total, tokens))} FLOPs (x{counts.total / counts.active:.2f})")
    d.step(t["exact"].format(T=seq), "3 x forward (incl. attention)", "",
           f"{num(exact)} vs 6 N_active = {num(6 * counts.active)}")
    d.step(t["states"], "N_total x 16 B (bf16 + fp32 master + AdamW)", f"{num(counts.total)} x 16",
           fmt_bytes(states.total))
    assert counts.active == counts.total - unused
    d.text()
    d.text(t["why"])
    d.where(*t["run"])
    d.values = dict(model=cfg.name, n_experts=cfg.n_experts, top_k=cfg.top_k, expert_params=expert,
                    params_total=counts.total, params_active=counts.active, tokens=tokens,
                    flops_6nd_active=FL.six_nd(counts.active, tokens), flops_6nd_total=FL.six_nd(counts.total, tokens),
                    flops_per_token_exact=exact, states_bytes_bf16_mixed_adamw=states.total)
    return d


# ---------------------------------------------------------------------------------------------------
BUDGET = {
    "en": dict(title="Training budget: memory, compute and time of a run", params="parameters N", tokens="tokens D",
               p="params", g="grads", o="optimizer", m="master", s="model states", c="compute", time="time",
               days="days",
               run=["`trainwise plan --params {N} --tokens {D} --peak-flops {P} --precision {r} --explain` prints this "
                    "estimate (it is computed by the same plan_run); "
                    "give --model PRESET for exact FLOPs and activations.",
                    "`trainwise train` prints the plan of your run before it starts, and `trainwise verify` holds it "
                    "against the measurement."],
               layout="a concrete layout", shape="a Llama-style shape of N", layout_mfu="MFU it reaches",
               layout_days="days at that MFU",
               layout_note="The assumed MFU is the one number that decides the answer. The line above replaces it "
                           "with a prediction: {model} on {G} x {gpu} ({P} bf16 peak), global batch {gbs} "
                           "sequences of {T}, laid out as `plan --fit` finds fastest ({layout}); each operator at "
                           "published kernel rates, each collective at published NCCL bandwidths "
                           "(`trainwise plan --model FILE --gpu {gpu_key} --gpus {G} --fit --explain` itemises it)."),
    "zh": dict(title="训练预算：一次训练的显存、计算量与时间", params="参数量 N", tokens="训练 token 数 D",
               p="参数", g="梯度", o="优化器状态", m="主权重 (master)", s="模型状态", c="总计算量", time="训练时间",
               days="天数",
               run=["`trainwise plan --params {N} --tokens {D} --peak-flops {P} --precision {r} --explain` "
                    "给出同样的估算（由同一个 plan_run 计算）；用 --model PRESET 可得到精确的 FLOPs 和激活值。",
                    "`trainwise train` 在开始前打印你这次训练的规划，`trainwise verify` 用实测值检验它。"],
               layout="具体的并行布局", shape="规模为 N 的 Llama 式结构", layout_mfu="它达到的 MFU",
               layout_days="按该 MFU 的天数",
               layout_note="假设的 MFU 是决定答案的那个数。"
                           "上一行用预测替换它：{model} 在 {G} x {gpu}（bf16 峰值 {P}）上，"
                           "全局批量 {gbs} 条长度 {T} 的序列，采用 `plan --fit` 找到的最快布局（{layout}）；"
                           "每个算子按已发表的内核速率、每个集合通信按已发表的 NCCL 带宽计时"
                           "（`trainwise plan --model FILE --gpu {gpu_key} --gpus {G} --fit --explain` 逐项列出）。"),
}

# A concrete shape for a bare parameter count: d_model = ASPECT x n_layers (Llama 2 7B: 4096 = 128 x 32; Kaplan
# et al. 2020, section 3.1: loss within a few percent for aspect ratios 20-200), heads of HEAD_DIM, SwiGLU width
# 8/3 d_model rounded up to 256 and Llama 2's 32,000-token vocabulary, untied.
ASPECT, HEAD_DIM, VOCAB = 128, 128, 32000
# The concrete layout's run: sequences of LAYOUT_SEQ tokens, LAYOUT_BATCH_TOKENS per optimizer step (about
# 1M tokens: GPT-3's batch for its 1.3B model, Brown et al. 2020, Table 2.1), on LAYOUT_GPU.
LAYOUT_SEQ, LAYOUT_BATCH_TOKENS, LAYOUT_GPU = 2048, 2**20, "a100-80gb"


def llama_shape(params_count: float) -> ModelConfig:
    """A Llama-style model of about `params_count` parameters (the shape above)."""
    layers = max(1, round((params_count / (12 * ASPECT**2)) ** (1 / 3)))
    for _ in range(64):  # adjust the depth until the count is as close as the shape allows
        d = ASPECT * layers
        cfg = ModelConfig(name=f"llama-shaped-{num(params_count)}", vocab_size=VOCAB, d_model=d, n_layers=layers,
                          n_heads=max(1, d // HEAD_DIM), n_kv_heads=max(1, d // HEAD_DIM),
                          ffn_hidden=-(-8 * d // 3 // 256) * 256, max_seq_len=LAYOUT_SEQ, tie_embeddings=False)
        n = params(cfg).total
        if n > 1.1 * params_count and layers > 1:
            layers -= 1
        elif n < params_count / 1.1:
            layers += 1
        else:
            break
    return cfg


def budget(params_count: float = 1e9, tokens: float = 1e10, precision: str = "fp32", optimizer: str = "adamw",
           peak_flops: float = 100e12, mfu: float = DEFAULT_MFU, gpus: int = 1, gpu: str = LAYOUT_GPU,
           lang: str = "en") -> Doc:
    t = BUDGET[lang]
    run = Run(None, recipe=get_recipe(precision), optimizer=optimizer, layout=make_layout(gpus), tokens=tokens,
              machine=Machine(peak_flops=peak_flops))
    p = plan_run(run, mfu=mfu, params_count=params_count)
    r, s, N = p.recipe, p.states, p.counts.total
    k = optimizer_moments(optimizer)
    d = Doc(t["title"], lang)
    d.step(t["params"], "", "", f"{num(N)}")
    d.step(t["tokens"], "", "", f"{num(tokens)}")
    d.step(t["p"], f"N x {r.param_bytes} B", f"{num(N)} x {r.param_bytes}", fmt_bytes(s.params))
    d.step(t["g"], f"N x {r.grad_bytes} B", f"{num(N)} x {r.grad_bytes}", fmt_bytes(s.grads))
    d.step(t["o"], f"N x {k} x {r.moment_bytes} B ({optimizer})", f"{num(N)} x {k * r.moment_bytes}",
           fmt_bytes(s.optimizer))
    d.step(t["m"], f"N x {r.master_bytes} B", f"{num(N)} x {r.master_bytes}", fmt_bytes(s.master))
    d.step(t["s"], "sum", f"{num(N)} x {s.total / N:g}", fmt_bytes(s.total))
    d.step(t["c"], "C = 6 N D", f"6 x {num(N)} x {num(tokens)}", f"{num(p.total_flops)} FLOPs")
    d.step(t["time"], "C / (G x P x MFU)", f"{num(p.total_flops)} / ({gpus} x {num(peak_flops)} x {mfu})",
           f"{num(p.time.seconds)} s")
    d.step(t["days"], "s / 86400", f"{num(p.time.seconds)} / {SECONDS_PER_DAY:.0f}", f"{p.time.days:.2f} days")
    cfg, best = concrete_layout(params_count, tokens, gpus, gpu)
    hw = get_accelerator(gpu)
    layout = best.layout if best else {}
    where = (f"tp {layout['tp']} pp {layout['pp']} dp {layout['dp']} zero {layout['zero']}, micro-batch "
             f"{best.micro_batch}, checkpointing {best.checkpointing}" if best else "none fits")
    d.step(t["layout"], t["shape"], f"d_model {cfg.d_model} = {ASPECT} x {cfg.n_layers} layers, vocab {VOCAB}",
           f"{params(cfg).total:,} params")
    if best:
        days = FL.six_nd(N, tokens) / (gpus * hw.peak_flops["bf16"] * best.mfu) / SECONDS_PER_DAY
        d.step(t["layout_mfu"], "6 N_layout x tokens/s / (G x P_bf16)", f"{gpus} x {hw.name}, {where}",
               f"{best.mfu:.1%} vs assumed {mfu:.0%}")
        d.step(t["layout_days"], "C / (G x P_bf16 x MFU)",
               f"{num(p.total_flops)} / ({gpus} x {num(hw.peak_flops['bf16'])} x {best.mfu:.3f})", f"{days:.2f} days")
    d.text()
    d.text(t["layout_note"].format(model=cfg.name, G=gpus, gpu=hw.name, gpu_key=gpu,
                                   P=f"{num(hw.peak_flops['bf16'])} FLOP/s",
                                   gbs=LAYOUT_BATCH_TOKENS // LAYOUT_SEQ, T=LAYOUT_SEQ, layout=where))
    d.where(*(line.format(N=num(N), D=num(tokens), P=num(peak_flops), r=r.name) for line in t["run"]))
    d.values = dict(layout_model=cfg.name, layout_gpu=gpu, layout=layout,
                    layout_micro_batch=best.micro_batch if best else None,
                    layout_checkpointing=best.checkpointing if best else None,
                    layout_mfu=best.mfu if best else None, params=N, tokens=tokens, precision=r.name,
                    optimizer=optimizer, peak_flops=peak_flops, mfu=mfu,
                    devices=gpus, params_bytes=s.params, grads_bytes=s.grads, optimizer_bytes=s.optimizer,
                    master_bytes=s.master, states_bytes=s.total, flops=p.total_flops, seconds=p.time.seconds,
                    days=p.time.days, device_hours=p.time.device_hours)
    return d


def concrete_layout(params_count: float, tokens: float, gpus: int, gpu: str):
    """(llama_shape(params_count), the fastest layout `plan --fit` finds for it on `gpus` x `gpu`, or None)."""
    cfg = llama_shape(params_count)
    hw = get_accelerator(gpu)
    if not hw.memory_bytes:
        raise TrainwiseError(f"explain budget --gpu '{gpu}': not a GPU of the hardware table; "
                             "see `trainwise hardware`.")
    run = Run(cfg, seq_len=LAYOUT_SEQ, recipe=get_recipe("bf16"), layout=make_layout(gpus), tokens=tokens,
              machine=Machine(gpu=gpu))
    good, _ = fit_run_layouts(run, global_batch=max(gpus, LAYOUT_BATCH_TOKENS // LAYOUT_SEQ),
                              memory_budget=hw.memory_bytes)
    return cfg, (good[0] if good else None)


TOPICS = [
    Topic("grad-accum", "梯度累积",
          {"en": "B_eff = B_micro x K, and accumulated gradients equal the big-batch gradient (measured)",
           "zh": "等效批大小 B_eff = B_micro x K；实测累积梯度等于大批次梯度"},
          grad_accum,
          [Arg("--micro-batch", dict(type=int, default=2, help="B_micro")),
           Arg("--steps", dict(type=int, default=4, help="accumulation steps K")),
           Arg("--seq-len", dict(type=int, default=16, help="T (at most 64)"))],
          "trainwise explain grad-accum --micro-batch 1 --steps 8"),
    Topic("checkpointing", "激活检查点",
          {"en": "activation memory with and without checkpointing, measured, and the recompute FLOPs",
           "zh": "使用与不使用激活检查点时的激活显存（实测）以及重计算的 FLOPs"},
          checkpointing,
          [Arg("--mode", dict(choices=["full", "selective"], default="full")),
           Arg("--micro-batch", dict(type=int, default=2, help="B")),
           Arg("--seq-len", dict(type=int, default=32, help="T (at most 64)")),
           Arg("--d-model", dict(type=int, default=64, help="H")),
           Arg("--n-layers", dict(type=int, default=2, help="L"))],
          "trainwise explain checkpointing --mode selective --seq-len 64"),
    Topic("moe", "混合专家",
          {"en": "total vs active parameters of an MoE model, and why 6ND must use active",
           "zh": "MoE 模型的总参数量与激活参数量，以及为什么 6ND 必须用激活参数量"},
          moe,
          [Arg("--model", dict(default="mixtral-8x7b", help="MoE preset (default mixtral-8x7b)")),
           Arg("--tokens", dict(type=float, default=1e12, help="training tokens D (default 1e12)"))],
          "trainwise explain moe --model trainwise-moe-small"),
    Topic("budget", "训练预算",
          {"en": "the full worked estimate of a run: states, 6ND FLOPs, seconds and days (the planner)",
           "zh": "一次训练的完整估算：模型状态显存、6ND 计算量、秒数与天数（即规划器）"},
          budget,
          [Arg("--params", dict(dest="params_count", type=float, default=1e9, help="parameters N (default 1e9)")),
           Arg("--tokens", dict(type=float, default=1e10, help="training tokens D (default 1e10)")),
           Arg("--precision", dict(default="fp32", help="fp32, amp, bf16-mixed, bf16-pure")),
           Arg("--optimizer", dict(default="adamw", choices=list(OPTIMIZER_MOMENTS))),
           Arg("--peak-flops", dict(type=float, default=100e12, help="peak FLOP/s per device (default 100e12)")),
           Arg("--mfu", dict(type=float, default=DEFAULT_MFU, help=f"model FLOP utilisation (default {DEFAULT_MFU})")),
           Arg("--gpus", dict(type=int, default=1, help="devices G")),
           Arg("--gpu", dict(default=LAYOUT_GPU, help=f"GPU of the concrete layout (default {LAYOUT_GPU})"))],
          "trainwise explain budget --params 7e9 --tokens 2e12 --precision bf16 --peak-flops 989e12 --gpus 256"),
]
