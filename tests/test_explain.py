"""`trainwise explain`: every topic's default numbers (hand-worked, issue text), its Chinese output, the
listing; and the small pure cost functions the topics added (einsum FLOPs, roofline, MFU)."""

import json
import math

import pytest

from trainwise.cli import main as cli_main
from trainwise.cost.flops import einsum_flops, linear_train_flops
from trainwise.cost.time import attainable_flops, model_flops_utilization, ridge_point, roofline_seconds
from trainwise.explain import topics


def main(argv: list[str]) -> int:
    """`trainwise explain ...`."""
    return cli_main(["explain", *argv])

# Topics that build and run a model: their zh check uses smaller numbers to keep the suite fast.
SMALL = {"grad-accum": ["--steps", "2", "--seq-len", "4"], "checkpointing": ["--seq-len", "8"]}


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- the pure functions added to trainwise.cost --------------------------------------------------------


def test_einsum_flops():
    assert einsum_flops("mk,kn->mn", (2, 3), (3, 4)) == ((2, 4), 48)  # 2MNK
    assert einsum_flops("ij,jk", (2, 3), (3, 4)) == ((2, 4), 48)  # implicit output
    assert einsum_flops("bhtd,bhsd->bhts", (1, 8, 256, 32), (1, 8, 256, 32)) == (
        (1, 8, 256, 256), 2 * 8 * 256 * 256 * 32)
    assert einsum_flops("ij,ij->ij", (3, 4), (3, 4)) == ((3, 4), 12)  # elementwise: one multiply each
    with pytest.raises(ValueError):
        einsum_flops("ij,jk->ik", (2, 3), (4, 5))


def test_linear_train_flops_is_three_forwards():
    assert linear_train_flops(2, 3, 4) == 144


def test_roofline_and_mfu_functions():
    assert ridge_point(100e12, 1e12) == 100
    assert attainable_flops(20, 100e12, 1e12) == 20e12
    assert attainable_flops(150, 100e12, 1e12) == 100e12
    assert roofline_seconds(1e12, 1e9, 100e12, 1e12) == pytest.approx(0.01)  # compute-bound: F/P
    assert roofline_seconds(1e9, 1e12, 100e12, 1e12) == pytest.approx(1.0)  # memory-bound: Q/BW
    assert model_flops_utilization(40e12, 100e12) == pytest.approx(0.4)
    assert model_flops_utilization(80e12, 100e12, devices=2) == pytest.approx(0.4)


# --- default numbers of every topic ----------------------------------------------------------------------


def test_gradient_descent_defaults(capsys):
    v = run_json(capsys, "gradient-descent")
    assert v["loss"] == pytest.approx(9)
    assert v["grad_chain_rule"] == pytest.approx(-18) and v["grad_autograd"] == pytest.approx(-18)
    assert v["new_w"] == pytest.approx(1.9)
    assert v["new_prediction"] == pytest.approx(5.7)
    assert v["new_loss"] == pytest.approx(0.09)


def test_cross_entropy_defaults(capsys):
    v = run_json(capsys, "cross-entropy")
    e = [math.exp(z) for z in (2.0, 1.0, 0.1)]
    assert v["probs"][0] == pytest.approx(e[0] / sum(e))
    assert v["loss"] == pytest.approx(0.4170, abs=1e-4) == v["loss_torch"]
    assert v["loss_by_p"]["0.1"] == pytest.approx(2.3026, abs=1e-4)
    assert v["loss_by_p"]["0.9"] == pytest.approx(0.1054, abs=1e-4)
    assert v["uniform_loss_default_vocab"] == pytest.approx(math.log(4096))


def test_embedding_defaults(capsys):
    v = run_json(capsys, "embedding")
    assert v["output_shape"] == [2, 4, 256]
    assert v["params"] == v["params_planner"] == 4096 * 256
    assert v["table_bytes"] == 4096 * 256 * 4


def test_tensor_defaults(capsys):
    v = run_json(capsys, "tensor")
    assert v["numel"] == 8 * 1024 * 4096 and v["element_size"] == 2
    assert v["bytes"] == 67_108_864 and v["MiB"] == 64 and v["MB"] == pytest.approx(67.108864)
    assert v["stride"] == [1024 * 4096, 4096, 1] and v["contiguous"]
    assert v["transpose_shape"] == [8, 4096, 1024] and v["transpose_stride"] == [1024 * 4096, 1, 4096]
    assert not v["transpose_contiguous"]


def test_matmul_defaults(capsys):
    v = run_json(capsys, "matmul")
    assert v["output_shape"] == [2, 4]
    assert v["flops"] == v["flops_counted"] == 48
    assert v["train_flops"] == v["train_flops_counted"] == 144


def test_einsum_defaults_and_args(capsys):
    v = run_json(capsys, "einsum")
    # the default is trainwise-small's q k^T: (1, nh, 256, hd) x (1, nh, 256, hd), 2*nh*hd = 2*256 per t,s
    from trainwise.config import ModelConfig

    assert v["output_shape"] == [1, ModelConfig().n_heads, 256, 256] and v["summed"] == ["d"]
    assert v["flops"] == v["flops_counted"] == 33_554_432
    v = run_json(capsys, "einsum", "--equation", "mk,kn->mn", "--shapes", "2,3", "3,4")
    assert v["flops"] == v["flops_counted"] == 48


def test_dtype_defaults(capsys):
    v = run_json(capsys, "dtype")
    f = v["formats"]
    assert (f["fp32"]["exponent_bits"], f["fp32"]["mantissa_bits"]) == (8, 23)
    assert (f["fp16"]["exponent_bits"], f["fp16"]["mantissa_bits"]) == (5, 10)
    assert (f["bf16"]["exponent_bits"], f["bf16"]["mantissa_bits"]) == (8, 7)
    assert f["fp16"]["max"] == 65504 and f["fp16"]["eps"] == 2**-10 and f["bf16"]["eps"] == 2**-7
    assert f["fp32"]["smallest_normal"] == pytest.approx(1.1754943508222875e-38)
    if "fp8-e4m3" in f:
        assert f["fp8-e4m3"]["max"] == 448
    d = v["demo"]
    assert math.isinf(d["overflow_fp16"]) and d["overflow_bf16"] == 70144
    assert d["underflow_fp16"] == 0 and d["underflow_bf16"] == pytest.approx(1e-8, rel=1e-2)
    assert d["one_plus_half_eps_bf16"] == 1


def test_roofline_defaults(capsys):
    v = run_json(capsys, "roofline")
    assert v["ridge_point"] == 100
    low, high = v["points"]
    assert (low["intensity"], low["attainable_flops"], low["bound"]) == (20, 20e12, "memory")
    assert (high["intensity"], high["attainable_flops"], high["bound"]) == (150, 100e12, "compute")
    assert v["examples"]["matmul"]["bound"] == "compute" and v["examples"]["add"]["bound"] == "memory"


def test_mfu_defaults(capsys):
    v = run_json(capsys, "mfu")
    assert v["mfu"] == pytest.approx(0.4)
    assert v["hfu_full"] > v["mfu"]
    assert v["memory_bound_kernel_mfu"] < 0.01


def test_grad_accum_defaults(capsys):
    v = run_json(capsys, "grad-accum")
    assert v["effective_batch"] == 8 and v["tokens_per_step"] == 128
    assert v["loss_big"] == pytest.approx(v["loss_accumulated"], rel=1e-6)
    assert v["max_abs_grad_diff"] < 1e-6 * max(1.0, v["max_abs_grad"])


def test_checkpointing_defaults(capsys):
    v = run_json(capsys, "checkpointing")
    none, full = v["activation_bytes_none_measured"], v["activation_bytes_checkpointed_measured"]
    assert full < none / 3
    # the planner's prediction beside the measurement (trainwise.cost.memory)
    assert none == pytest.approx(v["activation_bytes_none_planner"], rel=0.05)
    assert full == pytest.approx(v["activation_bytes_checkpointed_planner"], rel=0.05)
    # recompute measured by FlopCounterMode equals trainwise.cost.flops.recompute_flops_per_token x tokens
    assert v["recompute_flops_measured"] == v["recompute_flops_planner"] > 0


def test_moe_defaults(capsys):
    v = run_json(capsys, "moe")
    assert v["model"] == "mixtral-8x7b"
    assert round(v["params_total"] / 1e9, 1) == 46.7
    assert round(v["params_active"] / 1e9, 1) == 12.9
    assert v["flops_6nd_active"] == pytest.approx(6 * v["params_active"] * 1e12)
    assert v["flops_6nd_total"] / v["flops_6nd_active"] == pytest.approx(v["params_total"] / v["params_active"])


def test_budget_defaults(capsys):
    v = run_json(capsys, "budget")
    assert v["states_bytes"] == 16e9
    assert v["flops"] == pytest.approx(6e19)
    assert v["seconds"] == pytest.approx(1.5e6)
    assert round(v["days"], 2) == 17.36
    # beside the assumed 40%: the MFU the fastest fitting layout of a 1e9-parameter Llama shape is predicted to
    # reach on one A100 80GB (the cluster model), a prediction and not the assumption
    assert v["layout_gpu"] == "a100-80gb" and v["layout"]["tp"] == 1 and v["layout_micro_batch"] >= 1
    assert 0.2 < v["layout_mfu"] < 0.8 and v["layout_mfu"] != pytest.approx(0.4, abs=0.01)


# --- languages, listing, errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(topics()))
def test_zh_output_has_the_term(capsys, name):
    assert main([name, "--lang", "zh", *SMALL.get(name, [])]) == 0
    out = capsys.readouterr().out
    assert topics()[name].term_zh in out
    assert "在你的训练中" in out


def test_text_output_shows_derivation(capsys):
    assert main(["gradient-descent"]) == 0
    out = capsys.readouterr().out
    assert "dL/dw = 2 (y_hat - y) x" in out and "2 x (-3) x 3" in out and "-18" in out
    assert "In your run" in out


def test_listing(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  ")]
    assert [line.split()[0] for line in lines] == list(topics())
    assert main(["--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert all(t.term_zh in out for t in topics().values())


def test_lang_before_topic(capsys):
    assert main(["--lang", "zh", "budget"]) == 0
    assert "训练预算" in capsys.readouterr().out


def test_user_errors(capsys):
    assert main(["matmul", "--a", "2,3", "--b", "4,5"]) == 2
    assert "same K" in capsys.readouterr().err
    assert main(["moe", "--model", "trainwise-small"]) == 2
    assert "dense" in capsys.readouterr().err


def test_registered_in_cli(capsys):

    assert cli_main(["explain", "roofline", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ridge_point"] == 100


def test_values_a_topic_cannot_compute_with_are_one_error(capsys):
    """A topic run with values it cannot compute with: one error naming the values, exit 2, no traceback."""
    for argv, named in ((["embedding", "--vocab-size", "0"], "--vocab-size 0"),
                        (["mfu", "--devices", "0"], "--devices 0"),
                        (["einsum", "--equation", "ij->ijk", "--shapes", "2,3"], "--equation ij->ijk")):
        assert cli_main(["explain", *argv]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"`trainwise explain {argv[0]}` cannot compute with {named}" in err, err
    # values a topic computes with but that describe no machine: they printed a negative attainable FLOP/s and an
    # MFU of 400%
    for argv, text in ((["roofline", "--intensity", "20", "-5"], "--intensity = -5.0 must be positive"),
                       (["mfu", "--achieved-flops", "4e14", "--peak-flops", "1e14"],
                        "--achieved-flops 4e14 FLOP/s is more than 1 x --peak-flops 1e14")):
        assert cli_main(["explain", *argv]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert text in err, err
    assert cli_main(["explain", "mfu", "--achieved-flops", "4e14", "--peak-flops", "1e14", "--devices", "8"]) == 0
    assert "50.0%" in capsys.readouterr().out
