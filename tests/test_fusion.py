"""Element-wise work as a fusing stack runs it (measure.record's fused bytes, cost.ops.Op.fused), and the
cluster step that prices it for Megatron's, Transformer Engine's and torch.compile's stacks."""

from dataclasses import replace

import torch
from runs import run_of

from trainwise.config import ModelConfig
from trainwise.cost.gpu import op_seconds
from trainwise.cost.layout import make_layout
from trainwise.hardware.table import ACCELERATORS
from trainwise.measure.fake import fake_step_mode
from trainwise.measure.record import _Recorder, block_ops
from trainwise.planner.cluster_step import rank_work
from trainwise.planner.plan import plan_run

LLAMA = ModelConfig(name="fusion-llama", vocab_size=1000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=768, max_seq_len=512)
GPT = ModelConfig(name="fusion-gpt", vocab_size=1000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4,
                  ffn_hidden=1024, activation="gelu", norm="layernorm", position="learned", bias=True,
                  max_seq_len=512, tie_embeddings=True)


def test_a_chain_moves_only_its_input_and_its_output():
    """Worked by hand: x -> mul -> add -> relu -> mm. Fused, the mul reads x (in memory: no op wrote it)
    and writes nothing (the add reads it in the same pass), the add moves nothing, the relu writes its
    output (a matmul reads it); the matmul moves all it moves eager."""
    rec = _Recorder()
    with fake_step_mode():
        x, w = torch.empty(64, 32), torch.empty(32, 16)
        with rec:
            torch.mm(torch.relu(x * 2 + 1), w)
    got = {key[0].split(".")[-1]: (nbytes, fused) for key, (_, _, nbytes, fused, *_) in rec.records().items()}
    size = 64 * 32 * 4
    assert got["mul"] == (2 * size, size)
    assert got["add"] == (2 * size, 0)
    assert got["relu"] == (2 * size, size)
    assert got["mm"][1] == got["mm"][0] == size + (32 * 16 + 64 * 16) * 4


def test_what_is_kept_for_backward_stays_in_memory():
    """A tensor the backward reads (autograd saved it) is written in the forward pass even when only
    element-wise ops read it there: with a gradient, the same chain moves more than without."""
    def fused_bytes(grad: bool) -> float:
        rec = _Recorder()
        with fake_step_mode():
            x = torch.empty(64, 32, requires_grad=grad)
            with rec:
                y = torch.sigmoid(x * 3).sum()
                if grad:
                    rec.hook("forward")
                    y.backward()
        return sum(r[3] for k, r in rec.records().items() if k[1] == "forward")

    assert fused_bytes(True) > fused_bytes(False)


def test_fusion_saves_most_where_eager_runs_most_element_wise_kernels():
    """RMSNorm, RoPE and SwiGLU run as chains of small kernels eager (the Llama block); LayerNorm and GELU
    are one kernel each already (the GPT block): fusing saves far more of the first's element-wise traffic.
    Matmuls and attention move the same bytes either way, and no op moves more fused."""
    def ratio(cfg: ModelConfig) -> float:
        ops = block_ops(cfg, 1, 256, "bf16-pure", "none", "adamw", "flash")["layer"]
        assert all(o.moved(True) <= o.bytes for o in ops)
        assert all(o.moved(True) == o.bytes for o in ops if o.cls in ("matmul", "attention"))
        ew = [o for o in ops if o.cls not in ("matmul", "attention") and o.phase != "optimizer"]
        return sum(o.moved(True) for o in ew) / sum(o.bytes for o in ew)

    llama, gpt = ratio(LLAMA), ratio(GPT)
    assert llama < 0.5 < 0.8 < gpt < 1.0


def test_fusing_stacks_are_priced_fused():
    """The megatron and FP8 recipes (Megatron's and Transformer Engine's kernels) and a compiled run price
    element-wise work at its fused bytes; an eager amp run at its eager bytes."""
    lay, h100 = make_layout(1), ACCELERATORS["h100-sxm"]
    work = rank_work(LLAMA, lay, 1, 512, "bf16-pure", "none", fused=True)
    assert work.fused
    fused = sum(op_seconds(o, h100, True)[0] for o in work.layer)
    eager = sum(op_seconds(o, h100)[0] for o in work.layer)
    assert fused < eager

    def step(precision: str, compiled: bool = False) -> float:
        run = run_of(LLAMA, tokens=1e9, seq_len=512, micro_batch=1, grad_accum=1, gpus=1, precision=precision,
                     gpu="h100-sxm")
        return plan_run(replace(run, compiled=compiled)).cluster.breakdown["compute_s"]

    assert step("amp", compiled=True) < step("amp")
    assert step("megatron") < step("bf16-pure")
