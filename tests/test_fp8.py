"""FP8 training as the cluster planner prices it (cost.memory's fp8 recipes, cost.gpu's FP8 rate,
planner.cluster_step._fp8, cost.memory.fp8_weight_bytes): where it runs, what it costs, what it holds."""

import json

import pytest
from runs import run_of

from trainwise.cli import main
from trainwise.config import ModelConfig
from trainwise.cost.gpu import attention_rate, matmul_rate
from trainwise.cost.layout import make_layout
from trainwise.cost.rank import rank_params
from trainwise.cost.rank_memory import layer_bytes_per_token, rank_peak
from trainwise.cost.recipe import get_recipe, with_fp8_params
from trainwise.cost.run import Run
from trainwise.errors import TrainwiseError
from trainwise.hardware.table import ACCELERATORS
from trainwise.planner.cluster_step import rank_work
from trainwise.planner.plan import plan_run

MODEL = ModelConfig(name="fp8-test", vocab_size=32000, d_model=1024, n_layers=4, n_heads=16, n_kv_heads=4,
                    ffn_hidden=4096, max_seq_len=4096)


def plan(precision: str, gpu: str = "h100-sxm", **kw):
    return plan_run(run_of(MODEL, tokens=1e10, seq_len=4096, micro_batch=1, grad_accum=4, gpus=8, zero=1,
                           precision=precision, gpu=gpu, **kw))


@pytest.mark.parametrize("gpu", ["h100-sxm", "h200", "h800", "b200", "gb200", "b300", "gb300"])
def test_fp8_plans_time_and_memory_on_gpus_with_fp8_tensor_cores(gpu):
    fp8, bf16 = plan("fp8", gpu), plan("megatron", gpu)  # the same states: bf16 weights, fp32 grads/master/moments
    assert 0 < fp8.step_seconds < bf16.step_seconds
    assert fp8.peak_bytes > bf16.peak_bytes  # the FP8 weight copies it keeps
    acc = ACCELERATORS[gpu]
    t = fp8.to_json()["time"]
    # MFU against the FP8 peak, and against the bf16 peak (published FP8 tables use the latter)
    assert t["mfu_bf16_peak"] == pytest.approx(t["mfu"] * acc.peak("fp8") / acc.peak("bf16"))
    assert "mfu_bf16_peak" not in bf16.to_json()["time"]


def test_the_blocks_gemms_run_in_fp8_and_their_inputs_are_cast():
    """Every bf16 GEMM of a block moves to FP8 (the LM head and attention stay); each forward GEMM's input
    and each input-gradient GEMM's output gradient is cast: read 2 bytes, write the FP8 copy and its
    transpose (4), and under current scaling read once more for the amax (6)."""
    lay = make_layout(1)
    plain = rank_work(MODEL, lay, 1, 512, "bf16-pure", "none")
    for scaling, per_element in (("current", 6), ("delayed", 4), ("blockwise", 4)):
        work = rank_work(MODEL, lay, 1, 512, "bf16-pure", "none", fp8=scaling)
        gemms = [o for o in work.layer if o.cls == "matmul"]
        assert gemms and all(o.dtype == "fp8" for o in gemms)
        assert all(o.dtype == "bf16" for o in work.ends if o.cls == "matmul")  # the LM head
        casts = sum(o.bytes for o in work.layer if o.name == "fp8 cast")
        reads = sum(o.shape[0] * o.shape[1] * o.shape[2] for o in plain.layer if o.cls == "matmul"
                    and (o.phase == "forward" or not o.layout.startswith("T")))
        assert casts == per_element * reads
    # FP8 GEMMs at the bf16 MAMF's share of the FP8 peak
    h100 = ACCELERATORS["h100-sxm"]
    assert matmul_rate(h100, "fp8") == pytest.approx(794.5e12 * 1979 / 989.4)


def test_each_recipe_keeps_fp8_weight_copies_and_their_scales():
    """Beside the megatron recipe's states (the same bytes per parameter), an FP8 recipe keeps each block
    linear weight's FP8 copy and transpose: 2 bytes per element; block scaling adds an fp32 per 128 x 128
    block, MXFP8 a byte per 32 elements."""
    lay = make_layout(8, zero=1, micro_batches=4)

    def peak(recipe: str):
        return rank_peak(Run(MODEL, seq_len=4096, grad_accum=4, recipe=get_recipe(recipe), layout=lay))

    linear = sum(p.numel for p in rank_params(MODEL, lay, 0) if isinstance(p.spec.where, int)
                 and len(p.spec.shape) == 2)
    base = peak("megatron")
    # the activations shrink by what the FP8 recipes keep of their GEMMs' inputs (test below)
    assert peak("fp8").peak - base.peak == 2 * linear - (base.activations - peak("fp8").activations)
    assert peak("fp8-delayed").peak == peak("fp8").peak
    for recipe, scales in (("fp8-blockwise", 4 / 128**2), ("mxfp8", 1 / 32)):
        fp8 = peak(recipe)
        assert fp8.peak - base.peak == pytest.approx(2 * linear * (1 + scales) - (base.activations - fp8.activations),
                                                     abs=1)


def test_fp8_parameters_keep_one_byte_each_and_their_transpose_and_gather_in_fp8(capsys):
    """--fp8-params (Megatron-Core's --fp8-param-gather): each block linear weight is its FP8 cast, 1 byte where
    it took the recipe's 2, with its transpose kept (1 byte, the copy itself no longer apart): 2 bytes per such
    weight fewer on the rank; the other parameters as before. ZeRO-1's parameter all-gather moves them in FP8:
    its bytes drop by the FP8 weights' share of a byte. Refused without FP8 GEMMs."""
    lay = make_layout(8, zero=1, micro_batches=4)
    fp8 = get_recipe("fp8")
    kept = [rank_peak(Run(MODEL, seq_len=4096, grad_accum=4, recipe=r, layout=lay)) for r in
            (fp8, with_fp8_params(fp8))]
    held = rank_params(MODEL, lay, 0)
    linear = sum(p.numel for p in held if isinstance(p.spec.where, int) and len(p.spec.shape) == 2)
    total = sum(p.numel for p in held)
    assert kept[0].params - kept[1].params == linear and kept[1].params == 2 * total - linear
    assert kept[0].peak - kept[1].peak == 2 * linear
    gathered = [plan("fp8", **flag).cluster.comm["all_gather"]["bytes"] for flag in ({}, {"fp8_params": True})]
    assert gathered[1] == pytest.approx(gathered[0] * (1 - linear / total / 2))
    assert plan("fp8", fp8_params=True).to_json()["memory"]["fp8_params"] is True
    with pytest.raises(TrainwiseError, match="--fp8-params keeps the FP8 linear layers' weights"):
        with_fp8_params(get_recipe("bf16-mixed"))
    assert main(["plan", "--model", "gpt2", "--fp8-params"]) == 2
    assert "--fp8-params" in capsys.readouterr().err


def test_fp8_recipes_keep_their_gemms_inputs_as_fp8_casts():
    """Transformer Engine keeps an FP8 GEMM's input for the weight gradient as its FP8 cast: per token and
    layer, the qkv's and the MLP's first projection's inputs (H each) and the down projection's (F) at one byte
    instead of two, and the output projection's input (q) once more as a byte beside the attention output the
    attention kernel keeps; block scaling's inputs carry an fp32 per 128 elements, MXFP8's a byte per 32. Worked
    for MODEL (H 1024, q 16 x 64, F 4096; 4 layers, one micro-batch of 4096 tokens in flight)."""
    H, q, F, tokens, layers = 1024, 1024, 4096, 4096, 4
    lay = make_layout(8, zero=1, micro_batches=4)
    acts = {r: rank_peak(Run(MODEL, seq_len=4096, grad_accum=4, recipe=get_recipe(r), layout=lay)).activations
            for r in ("megatron", "fp8", "fp8-blockwise", "mxfp8")}
    for recipe, e in (("fp8", 1), ("fp8-blockwise", 1 + 4 / 128), ("mxfp8", 1 + 1 / 32)):
        per_token_layer = (2 - e) * (2 * H + F) - e * q
        assert acts["megatron"] - acts[recipe] == pytest.approx(tokens * layers * per_token_layer, abs=2)
    assert acts["megatron"] - acts["fp8"] == tokens * layers * 5120
    # under tp 2: with sequence parallelism every input is the rank's share; without it the two gathered inputs of
    # the column-parallel projections are whole on each rank, at one byte
    for sp, whole in ((True, 0), (False, 2 * H)):
        tp = make_layout(2, tp=2, sequence_parallel=sp)
        kept = [layer_bytes_per_token(MODEL, get_recipe(r), 0, tp, 4096, "none", True) for r in ("megatron", "fp8")]
        assert kept[0] - kept[1] == whole + (5120 - whole) / 2


def test_fp8_recipe_flag_and_refusals(capsys):
    args = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--seq-len", "8192", "--micro-batch", "1",
            "--global-batch", "64", "--tokens", "1e11"]
    for recipe in ("current", "delayed", "blockwise"):
        assert main(args + ["--gpu", "h100-sxm", "--precision", "fp8", "--fp8-recipe", recipe, "--json"]) == 0
        j = json.loads(capsys.readouterr().out)
        assert j["time"]["step_seconds"] > 0 and j["memory"]["peak_bytes"] > 0
    assert main(args + ["--gpu", "b200", "--precision", "mxfp8", "--json"]) == 0
    capsys.readouterr()
    for bad, says in ((["--gpu", "a100-80gb", "--precision", "fp8"], "no FP8 figure for the A100 80GB"),
                      (["--gpu", "h100-sxm", "--precision", "mxfp8"], "Blackwell"),
                      (["--gpu", "cpu", "--precision", "fp8"], "calibration, which measures no FP8"),
                      (["--gpu", "h100-sxm", "--fp8-recipe", "delayed"], "add --precision fp8")):
        assert main(args + bad) != 0
        err = " ".join(capsys.readouterr().err.split())  # the message is wrapped to the terminal
        assert says in err and "Traceback" not in err


@pytest.mark.parametrize("gpu", ["h100-sxm", "h200", "h800", "b200", "gb200"])
def test_fp8_attention_runs_cudnns_kernel_at_fp8s_speed_up_over_bf16(gpu):
    """--fp8-attention: cuDNN's attention at its bf16 rate times FP8's speed-up over bf16 in one published run (the
    H200's for Hopper, the B200's), forward and backward weighed 1 : 2.5 by FLOPs. At 8K tokens on Hopper the FP8
    backward is the slower one (430 against 541 TFLOP/s), so the kernel gains less than its forward's 1.5x."""
    acc = ACCELERATORS[gpu]
    cudnn = attention_rate(acc, 8192, 128, "cudnn")[0]
    fp8, how = attention_rate(acc, 8192, 128, "cudnn-fp8")
    ratio = ((3.5 / (1 / 964 + 2.5 / 430)) / (3.5 / (1 / 644 + 2.5 / 541)) if gpu not in ("b200", "gb200")
             else (3.5 / (1 / 1502 + 2.5 / 1255)) / (3.5 / (1 / 1384 + 2.5 / 995)))
    assert fp8 == pytest.approx(cudnn * ratio) and "FP8 speed-up" in how
    # the plan's step (4,096 tokens) moves the way the kernel's rate at its length does
    with_fp8, without = plan("fp8", gpu, attention_impl="cudnn-fp8"), plan("fp8", gpu, attention_impl="cudnn")
    faster = attention_rate(acc, 4096, 64, "cudnn-fp8")[0] > attention_rate(acc, 4096, 64, "cudnn")[0]
    assert faster and with_fp8.step_seconds < without.step_seconds


def test_fp8_attention_flag_and_refusals(capsys):
    args = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--seq-len", "8192", "--tokens", "1e11"]
    assert main(args + ["--gpu", "h100-sxm", "--precision", "fp8", "--fp8-attention", "--explain"]) == 0
    assert "cudnn-fp8 attention (" in (out := capsys.readouterr().out) and "FP8 speed-up over bf16" in out
    for bad, says in ((["--gpu", "a100-80gb", "--precision", "fp8", "--fp8-attention"], "no FP8 figure"),
                      (["--gpu", "mi300x", "--precision", "fp8", "--fp8-attention"], "published for Hopper"),
                      (["--gpu", "h100-sxm", "--fp8-attention"], "add --precision fp8"),
                      (["--gpu", "h100-sxm", "--precision", "fp8", "--fp8-attention", "--attention-impl", "flash3"],
                       "names another kernel")):
        assert main(args + bad) != 0
        err = " ".join(capsys.readouterr().err.split())
        assert says in err and "Traceback" not in err
