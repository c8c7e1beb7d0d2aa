"""The Plan, its JSON contract (docs/ARCHITECTURE.md, "The plan's JSON"), --fit, and the CLI
(`trainwise plan`, `mem`, `hardware`)."""

import json
from dataclasses import replace

import pytest
from runs import run_of

from trainwise.cli import main
from trainwise.config import ModelConfig
from trainwise.cost import loss as L
from trainwise.cost.layout import make_layout
from trainwise.cost.params import params
from trainwise.cost.recipe import get_recipe
from trainwise.cost.run import Machine, Run
from trainwise.cost.time import training_seconds
from trainwise.errors import TrainwiseError
from trainwise.planner.fit import fit_layout, fit_run
from trainwise.planner.plan import plan_run
from trainwise.presets import get_preset

KEYS = {"model": {"name", "params_total", "params_active", "params_embedding", "params_non_embedding"},
        "flops": {"per_token_train", "total", "convention"},
        "memory": {"params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "states_bytes",
                   "activations_bytes", "total_bytes", "per_device_bytes", "fits"},
        "time": {"seconds", "days", "device_hours"},
        "hardware": {"name", "peak_flops", "bandwidth_bytes_per_s", "devices", "mfu"}}


def test_time_worked_example():
    # docs/ARCHITECTURE.md, "The worked example": 1.5e6 s = 17.36 days
    assert training_seconds(6e19, 1, 100e12, 0.4) == 1.5e6


def test_cli_bar_json(capsys):
    rc = main(["plan", "--params", "1e9", "--tokens", "1e10", "--peak-flops", "100e12", "--mfu", "0.4",
               "--precision", "fp32", "--json"])
    assert rc == 0
    j = json.loads(capsys.readouterr().out)
    for section, keys in KEYS.items():
        assert keys <= set(j[section])
    assert j["memory"]["states_bytes"] == 16e9
    assert j["flops"]["total"] == 6e19
    assert j["time"]["seconds"] == 1.5e6
    assert round(j["time"]["days"], 2) == 17.36
    assert j["tokens"] == 1e10


def test_cli_mem(capsys):
    assert main(["mem", "--shape", "8,1024,4096", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "67,108,864 bytes" in out and "64.00 MiB" in out and "67.1 MB" in out


@pytest.mark.parametrize("argv, text", [
    (["plan", "--model", "lama-3-8b", "--tokens", "1e9", "--gpu", "h100"], "llama-3-8b"),
    (["plan", "--model", "llama-3-8b", "--tokens", "1e9", "--gpu", "h1000"], "h100"),
    (["plan", "--params", "-5", "--tokens", "1e9", "--gpu", "h100"], "positive"),
    (["plan", "--params", "1e9", "--tokens", "0", "--gpu", "h100"], "positive"),
    (["mem", "--shape", "8,0", "--dtype", "bf16"], "at least 1"),
    (["train", "--config", "/"], "config file '/' is a folder, not a file"),
    *[(["mem", "--shape", shape], f"--shape '{shape}' must be comma-separated whole numbers") for shape in
      ("inf,2", "8.5,2", "8,,4", "1e400")],
    # found by the slow property test: a zero divisor of the global batch and a negative bandwidth (whose plan
    # printed a negative step time) were not checked before use
    (["plan", "--model", "trainwise-gpt2-small", "--global-batch", "8", "--tp", "0"],
     "--tp: '0' must be a whole number of at least 1"),
    (["plan", "--model", "trainwise-gpt2-small", "--global-batch", "8", "--micro-batch", "0"], "--micro-batch: '0'"),
    # 0 was read as "not given" (--fit then asked for a target; predict took a TOML's tokens), and a negative
    # number in exponent form as an unknown flag
    (["plan", "--model", "trainwise-gpt2-small", "--fit", "--gpu", "h100", "--global-batch", "0"],
     "--global-batch: '0' must be a whole number of at least 1"),
    (["scale", "predict", "--model", "trainwise-gpt2-small", "--tokens", "0"], "--tokens: '0' must be above 0"),
    (["scale", "optimal", "--flops", "-1e9"], "--flops: '-1e9' must be above 0"),
    (["plan", "--params", "-1e9", "--tokens", "1e9"], "--params = -1000000000.0 must be positive"),
    # a plan replays its step's schedule micro-batch by micro-batch: these ran until memory ran out
    *[(["plan", "--model", "trainwise-gpt2-small", "--gpu", "h100", *flags], "more than the 100,000 a plan replays")
      for flags in (["--grad-accum", "1e12"], ["--global-batch", "1e9"], ["--fit", "--global-batch", "1e9"],
                    ["--fit", "--memory-budget", "80GiB", "--global-batch", "1e9"])],
    (["plan", "--model", "trainwise-gpt2-small", "--fit", "--memory-budget", "80GiB", "--global-batch", "1e9"],
     "more than the 100,000 a plan replays"),
    # matplotlib added .png to a name without an extension: the file said written was not there
    (["roofline", "--model", "trainwise-gpt2-small", "--gpu", "h100", "--plot", "roof"],
     "--plot: 'roof' needs the extension of an image format, e.g. roof.png"),
    (["scale", "fit", "runs", "--plot", "fit.xyz"], "--plot: 'fit.xyz' needs the extension of an image format"),
    (["plan", "--model", "deepseek-v3", "--gpu", "v100", "--bandwidth", "-1"], "--bandwidth = -1 must be positive"),
])
def test_cli_errors(capsys, argv, text):
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own check of a flag's value
        code = exit.code
    assert code == 2
    assert text in " ".join(capsys.readouterr().err.split())


def test_flags_a_plan_would_ignore_are_refused_and_named_together(capsys):
    """A flag that changes nothing in the plan it is given to is one error naming each such flag and why, and
    nothing printed to stdout; where it applies, the same flag is taken. --fit's candidates take the layout flags
    wherever they apply, so there only the model decides."""
    from trainwise.cli import build_parser
    from trainwise.commands.plan import flags_not_used
    from trainwise.presets import get_preset

    dense = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "16", "--tokens", "1e9"]
    assert main([*dense, "--etp", "2", "--cp-impl", "a2a", "--pp-overlap", "--params", "1e9"]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert captured.out == "" and err.count("trainwise plan: error:") == 1 and "drop them" in err
    assert "--etp applies to Mixture-of-Experts layers, and the model is llama-3-8b, a dense model" in err
    assert "--cp-impl a2a is how context parallelism exchanges keys and values, and --cp is 1" in err
    assert "--pp-overlap hides the interleaved schedule's sends, and --vpp is 1" in err
    assert "--params 1e+09 counts a model known only by its size" in err
    for flags, text in ((["--fsdp-grad-sync", "step"], "and --zero is 0, not 3"), (["--tp-overlap"], "--tp is 1"),
                        (["--fsdp-prefetch", "post"], "--fsdp-prefetch post is when FSDP gathers in backward, and "
                                                      "--zero is 0, not 3"),
                        (["--sequence-parallel"], "--tp is 1"), (["--moe-imbalance", "1"], "a dense model")):
        assert main([*dense, *flags]) == 2 and text in " ".join(capsys.readouterr().err.split()), flags

    def unused(model: str, *flags: str) -> list[str]:
        argv = ["plan", "--model", model, *flags]
        return flags_not_used(build_parser(argv).parse_args(argv), get_preset(model))

    assert unused("mixtral-8x7b", "--ep-overlap") == ["--ep-overlap hides expert-parallel all-to-alls, and --ep is 1"]
    for flags in (["--ep", "2", "--ep-overlap", "--etp", "1", "--ep-dispatch", "alltoall", "--moe-imbalance", "1"],
                  ["--cp", "2", "--cp-impl", "a2a"], ["--vpp", "2", "--pp-overlap"], ["--tp", "2", "--tp-overlap"],
                  ["--tp", "2", "--sequence-parallel"], ["--zero", "3", "--fsdp-grad-sync", "step"],
                  ["--zero", "3", "--fsdp-prefetch", "post"]):
        assert unused("mixtral-8x7b", *flags) == [], flags
    assert unused("llama-3-8b", "--fit", "--pp-overlap", "--cp-impl", "allgather", "--tp-overlap") == []
    assert unused("llama-3-8b", "--fit", "--etp", "2") != []


def test_cli_tables_and_explain(capsys, tmp_path):
    assert main(["hardware"]) == 0
    assert "H100" in capsys.readouterr().out
    assert main(["plan", "--model", "mixtral-8x7b", "--tokens", "1e12", "--gpu", "h100", "--gpus", "64",
                 "--zero", "3", "--explain", "--price", "2"]) == 0
    out = capsys.readouterr().out
    assert "Time per step" in out and "cluster model" in out and "MAMF" in out and "active" in out
    assert "nccl all_gather (dp)" in out and "ZeRO-3" in out  # FSDP over 64 GPUs gathers its parameters
    assert main(["plan", "--model", "mixtral-8x7b", "--tokens", "1e12", "--gpu", "h100", "--mfu", "0.4",
                 "--explain"]) == 0
    assert "C / (G x peak x MFU)" in capsys.readouterr().out  # --mfu stays a what-if
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nd_model = 128\nn_heads = 4\n[train]\nseq_len = 128\nmicro_batch = 4\n")
    assert main(["plan", "--model", str(toml), "--tokens", "1e8", "--peak-flops", "1e12", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["run"]["micro_batch"] == 4 and j["run"]["seq_len"] == 128


def test_a_plan_whose_step_peak_is_over_the_budget_says_so_beside_fits(capsys):
    """`fits` holds states + activations to the budget; when the highest rank's step peak (with the step's
    transient buffers: the loss's B x T x V scratch, gathered FSDP blocks) is over it, the table, the
    derivation and the JSON say so instead of a bare yes."""
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--precision", "fp8", "--seq-len",
            "8192", "--micro-batch", "1", "--global-batch", "128", "--zero", "3", "--tokens", "1e9",
            "--memory-budget", "60GB"]
    assert main([*argv, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["per_device_bytes"] < memory["budget_bytes"] < memory["peak_bytes"] and memory["fits"] is True
    assert memory["peak_over_budget_bytes"] == memory["peak_bytes"] - memory["budget_bytes"]
    over = f"does not fit by {memory['peak_over_budget_bytes'] / 2**30:.2f} GiB"
    for extra in ([], ["--explain"]):
        assert main([*argv, *extra]) == 0
        out = capsys.readouterr().out
        assert "yes by states + activations, but the step peak" in out and over in out, out
    # states + activations just over the budget: the step peak's far larger excess is said beside it
    argv[-1] = f"{memory['per_device_bytes'] - 2**20}B"
    assert main([*argv, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["fits"] is False and memory["over_budget_bytes"] == 2**20
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("NO: does not fit by 0.00 GiB (0.00 GB) per device by states + activations; the step peak (the highest "
            f"rank's, with the step's transient buffers) does not fit by {memory['peak_over_budget_bytes'] / 2**30:.2f}"
            in out), out


def test_each_stack_s_loss_keeps_what_its_kernel_keeps(capsys):
    """--loss-kernel, worked by hand on one device under bf16 autocast (c = 2), N = B x T tokens, V words. torch's
    F.cross_entropy saves the fp32 log-softmax (4V a token) and its backward holds two fp32 N x V buffers (8V);
    flash-attn's fused kernel (as llm-foundry calls it) saves the logits and their logsumexp (cV + 4) and writes
    one gradient as wide (cV); Transformer Engine's writes the gradient over the logits in forward, so it saves
    cV and its backward holds nothing of its own (the MLP's backward, 2 x N x c x F, is then the widest buffer);
    Megatron's vocab_parallel_cross_entropy saves the fp32 softmax (4V) and makes its gradient over it, which
    autograd casts to the logits' dtype (cV). With a vocabulary this large the loss's scratch is the backward's
    widest buffer, so the backward high point moves by the saved bytes and the scratch; the states and the step
    time do not move. Unsaid, a run trainwise trains keeps its own loss, any other Megatron's."""
    cfg = ModelConfig(vocab_size=32000, d_model=64, n_layers=2, n_heads=4, ffn_hidden=256, max_seq_len=512)
    V, c, N = cfg.vocab_size, 2, 4 * 512
    plans = {k: plan_run(run_of(cfg, tokens=1e6, seq_len=512, micro_batch=4, precision="amp", gpu="h100-sxm",
                                loss_kernel=k)) for k in (None, "flash-attn", "te", "megatron")}
    torch_, fused, te, megatron = (plans[k] for k in (None, "flash-attn", "te", "megatron"))
    assert [p.loss_kernel for p in plans.values()] == ["torch", "flash-attn", "te", "megatron"]
    assert torch_.activations_bytes - fused.activations_bytes == N * (4 * V - c * V - 4)
    assert torch_.activations_bytes - te.activations_bytes == N * (4 * V - c * V)
    assert torch_.activations_bytes == megatron.activations_bytes
    high = {k: p.peak_rank[1].backward for k, p in plans.items()}
    assert high[None] - high["flash-attn"] == N * (4 * V - c * V - 4) + N * (8 * V - c * V)
    assert high[None] - high["te"] == N * (4 * V - c * V) + N * 8 * V - N * 2 * c * 256
    assert high[None] - high["megatron"] == N * (8 * V - c * V)
    assert len({p.states for p in plans.values()}) == 1 and len({p.step_seconds for p in plans.values()}) == 1
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--gpus", "8", "--zero", "3", "--tokens", "1e9"]
    for extra, kernel in (([], "megatron"), (["--precision", "amp"], "torch"), (["--loss-kernel", "flash-attn"],
                                                                               "flash-attn"),
                          (["--loss-kernel", "te"], "te"), (["--precision", "amp", "--loss-kernel", "megatron"],
                                                            "megatron")):
        assert main([*argv, *extra, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["memory"]["loss_kernel"] == kernel
        assert main([*argv, *extra, "--explain"]) == 0
        assert f"incl. {L.LOSS_KERNELS[kernel]})" in capsys.readouterr().out
    with pytest.raises(TrainwiseError, match="loss_kernel 'somewhere'"):
        plan_run(run_of(cfg, tokens=1e6, seq_len=512, loss_kernel="somewhere"))
    assert main(["plan", "--params", "1e9", "--tokens", "1e10", "--loss-kernel", "te", "--explain"]) == 0  # no model


def test_a_data_parallel_plan_prints_the_highest_ranks_states_and_activations():
    """Over data-parallel ranks the plan's states and activations are the highest rank's (cost.rank_memory, what
    verify holds each rank to), as under model parallelism: ZeRO-2 and ZeRO-3 run as FSDP2 (its parameters
    sharded, its forward on gathered compute-dtype weights, the residual stream in that dtype), which the
    one-device closed form does not know (DDP and ZeRO-1: the two agree); a run's per-device bytes and its peak
    now describe one rank (llm-foundry's MPT-7b at 6 x 2048 tokens ran in 80 GB; its plan had said 81 GiB per
    device beside a 66 GiB peak)."""
    for zero in (0, 1, 2, 3):
        p = plan_run(run_of(get_preset("llama-3-8b"), tokens=1e9, seq_len=4096, micro_batch=2, precision="amp",
                            gpus=8, zero=zero, gpu="h100-sxm"))
        high = p.peak_rank[1]
        assert (p.states.params, p.states.grads, p.states.optimizer, p.states.master) == (
            high.params, high.grads, high.optimizer, high.master)
        assert p.activations_bytes == high.activations and p.per_device_bytes <= p.peak_bytes


@pytest.mark.parametrize("extra", [[], ["--gpu", "h100", "--gpus", "8"], ["--simulate"]])
def test_sequences_longer_than_the_models_are_planned_on_the_model_stretched_to_them(capsys, extra):
    """--seq-len past the config's max_seq_len: the plan of the model configured for it (a learned table that
    long), said in a note; the cluster step's and --simulate's fake steps run at that length too."""
    assert main(["plan", "--model", "gpt2", "--seq-len", "2048", "--micro-batch", "1", "--tokens", "1e9", *extra]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "seq_len 2048 > the model's max_seq_len 1024: planned with max_seq_len 2048" in out
    if not extra:
        assert f"{params(replace(get_preset('gpt2'), max_seq_len=2048)).total:,}" in out


def test_moe_flops_active_memory_total():
    p = plan_run(Run(get_preset("mixtral-8x7b"), seq_len=4096, recipe=get_recipe("fp32"), tokens=1e9,
                     machine=Machine(gpu="h100")))
    assert p.counts.active < p.counts.total
    assert p.states.total == 16 * p.counts.total
    assert p.flops_per_token < 6 * p.counts.total


def test_fits_and_budget():
    small = plan_run(Run(get_preset("trainwise-small"), micro_batch=16, seq_len=256, tokens=1e6,
                         machine=Machine(peak_flops=1e12)), memory_budget=10**9)
    assert small.fits is True
    big = plan_run(run_of(get_preset("llama-3-70b"), tokens=1e9, gpu="h100"))
    assert big.fits is False


def test_bad_parallel_layout():
    with pytest.raises(TrainwiseError, match="multiple"):
        plan_run(run_of(get_preset("gpt2"), tokens=1e9, gpu="a100", gpus=6, tp=4))


def test_fit_prefers_no_recompute_when_it_fits():
    run = Run(get_preset("llama-3-8b"), seq_len=8192, recipe=get_recipe("bf16"), layout=fit_layout(8),
              machine=Machine(gpu="h100"))
    good, bad = fit_run(run, global_batch=64, memory_budget=80 * 2**30)
    assert good and good[0].checkpointing == "none" and good[0].zero >= 2  # states need sharding
    assert all(c.per_device_bytes <= 80 * 2**30 for c in good)
    assert any("budget" in c.reason for c in bad)
    # a tight budget forces recomputation
    tight, _ = fit_run(run, global_batch=64, memory_budget=30 * 2**30)
    assert tight and tight[0].checkpointing == "full"


def test_plan_of_a_run_config_uses_its_run_length_and_this_cpu(tmp_path):
    """A trainwise TOML carries the run: tokens = max_steps x micro_batch x grad_accum x seq_len."""
    import trainwise
    from trainwise.config import RunConfig, apply_overrides, save_config

    cfg = apply_overrides(RunConfig(), ["train.max_steps=10", "train.micro_batch=2", "train.seq_len=64"])
    save_config(cfg, tmp_path / "config.toml")
    plan = trainwise.plan(str(tmp_path / "config.toml"), peak_flops=1e12)
    assert plan.to_json()["tokens"] == 10 * 2 * 64


def test_plan_without_hardware_prints_everything_but_time(capsys, tmp_path):
    """`plan --model config.json --tokens D` with no device: parameters, FLOPs and memory as with one,
    time null in --json (same keys) and said so in the table and --explain."""
    from trainwise.hf_config import PUBLISHED

    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLISHED["qwen3-30b-a3b"]))
    argv = ["plan", "--model", str(path), "--tokens", "1e12", "--seq-len", "4096"]
    assert main(argv + ["--json"]) == 0
    bare = json.loads(capsys.readouterr().out)
    for section, keys in KEYS.items():
        assert keys <= set(bare[section])
    assert bare["time"]["seconds"] is None and "no hardware" in bare["time"]["note"]
    assert bare["hardware"]["peak_flops"] is None and bare["memory"]["fits"] is None
    assert main(argv + ["--gpu", "h100", "--json"]) == 0
    with_gpu = json.loads(capsys.readouterr().out)
    for section in ("model", "flops"):
        assert bare[section] == with_gpu[section]
    for key in ("states_bytes", "activations_bytes", "per_device_bytes", "peak_bytes"):
        assert bare["memory"][key] == with_gpu["memory"][key]
    assert with_gpu["time"]["seconds"] > 0
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "30,532,122,624" in table and "no hardware given" in table
    assert main(argv + ["--explain"]) == 0
    assert "no hardware given" in capsys.readouterr().out
    assert main(argv + ["--memory", "80GiB", "--json"]) == 0  # a capacity alone still answers "fits?"
    assert json.loads(capsys.readouterr().out)["memory"]["fits"] is False


@pytest.mark.parametrize("kw, want", [(dict(tokens=4e6), 488), (dict(tokens=4 * 8192), 4), (dict(tokens=100), 1),
                                      (dict(sequences=10, dp=4), 12), (dict(sequences=12, dp=4), 12)])
def test_global_batch_rounds_to_whole_sequences(kw, want):
    from trainwise.planner.fit import global_batch_sequences

    dp = kw.pop("dp", 1)
    sequences, note = global_batch_sequences(8192, dp, **kw)
    assert sequences == want and sequences % dp == 0
    exact = kw.get("sequences", 0) == want or kw.get("tokens", 0) == want * 8192
    assert (note is None) == exact
    if note:
        assert "rounded" in note and f"{want * 8192:,} tokens" in note


def test_fit_takes_a_global_batch_in_tokens_that_is_not_whole_sequences(capsys):
    """`--global-batch-tokens 4e6` at seq 8192 is rounded to 488 sequences (and says so), no hardware needed."""
    argv = ["plan", "--model", "llama-3-8b", "--fit", "--global-batch-tokens", "4e6", "--seq-len", "8192",
            "--gpus", "8", "--memory-budget", "80GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rounded to 488 sequences = 3,997,696 tokens" in out and "ranked by step FLOPs" in out
    assert main(argv + ["--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["global_batch"]["sequences"] == 488 and j["global_batch"]["tokens"] == 3_997_696
    assert j["best"] and all(c["step_seconds"] is None for c in j["best"])


def test_fit_uses_the_plans_memory_model():
    """Every candidate --fit keeps is one that `plan` with the same settings says fits, with the same bytes;
    and its ranking is the same with and without hardware."""
    model, budget = get_preset("llama-3-8b"), 40 * 2**30
    run = run_of(model, seq_len=4096, gpus=8)
    good, bad = fit_run(run, global_batch=32, memory_budget=budget)
    timed, _ = fit_run(replace(run, machine=Machine(gpu="h100")), global_batch=32, memory_budget=budget)
    assert [(c.micro_batch, c.checkpointing, c.zero) for c in good] == [(c.micro_batch, c.checkpointing, c.zero)
                                                                       for c in timed]
    for c in good[:3] + [c for c in bad if not c.fits][:5]:
        p = plan_run(replace(run, micro_batch=c.micro_batch, grad_accum=c.grad_accum, checkpointing=c.checkpointing,
                             layout=make_layout(8, zero=c.zero, micro_batches=c.grad_accum), tokens=32 * 4096),
                     memory_budget=budget)
        assert p.fits is c.fits and p.per_device_bytes == c.per_device_bytes


def test_fit_on_this_cpu_uses_its_available_memory_and_ranks_by_predicted_time(capsys, monkeypatch):
    """`plan --gpu cpu --fit` without a budget: this machine's available memory (it used to fail with
    "unknown GPU 'cpu'"); the candidates are ranked by the step-time model (kernels timed here)."""
    monkeypatch.setenv("TRAINWISE_AVAILABLE_MEMORY", str(2 * 2**30))
    rc = main(["plan", "--model", "trainwise-small", "--gpu", "cpu", "--tokens", "1e6", "--seq-len", "64", "--fit",
               "--global-batch", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    best = out["best"][0]
    assert rc == 0 and best["fits"] and 0 < best["step_seconds"] and best["per_device_bytes"] <= 2 * 2**30
    slower = [c for c in out["rejected"] if c["fits"]]
    assert slower and all(c["step_seconds"] >= best["step_seconds"] and "slower" in c["reason"] for c in slower)
