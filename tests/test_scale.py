"""trainwise scale: the law's fit recovers known parameters; points, storage, predict, optimal, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainwise.config import RunConfig, apply_overrides, save_config
from trainwise.errors import TrainwiseError
from trainwise.scale.law import Law, bootstrap, fit_law, objective

# Hoffmann et al. 2022's own fit (eq. 10), used as the "known values".
TRUE = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


def synthetic_curves(law: Law, noise: float, seed: int = 0) -> list[np.ndarray]:
    """Six model sizes, each a curve of 12 points along D, with multiplicative Gaussian noise."""
    rng = np.random.default_rng(seed)
    groups = []
    for n in np.geomspace(1e6, 1e9, 6):
        d = np.geomspace(1e8, 1e11, 12)
        loss = law.loss(n, d) * np.exp(rng.normal(0.0, noise, d.shape))
        groups.append(np.stack([np.full_like(d, n), d, loss], axis=1))
    return groups


def test_fit_recovers_known_parameters_within_5_percent():
    groups = synthetic_curves(TRUE, noise=0.003)
    pts = np.concatenate(groups)
    law, _ = fit_law(pts[:, 0], pts[:, 1], pts[:, 2])
    for name in ("E", "A", "B", "alpha", "beta"):
        assert getattr(law, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name
    boot = bootstrap(groups, law, samples=8)
    assert boot.unit == "runs" and len(boot.laws) == 8
    for name in ("E", "alpha", "beta"):
        lo, hi = boot.interval(name)
        assert lo <= getattr(law, name) <= hi


def test_objective_gradient_matches_finite_differences():
    pts = np.concatenate(synthetic_curves(TRUE, noise=0.01))
    data = (np.log(pts[:, 0]), np.log(pts[:, 1]), np.log(pts[:, 2]))
    x = np.array([5.0, 6.0, 0.4, 0.3, 0.3])
    _, grad = objective(x, *data)
    for i in range(5):
        step = np.zeros(5)
        step[i] = 1e-6
        numeric = (objective(x + step, *data)[0] - objective(x - step, *data)[0]) / 2e-6
        assert grad[i] == pytest.approx(numeric, rel=1e-4, abs=1e-7)


def test_optimal_6nd_is_the_minimum_along_the_isoflop_line():
    flops = 1e21
    n_opt, d_opt = TRUE.optimal_6nd(flops)
    assert 6 * n_opt * d_opt == pytest.approx(flops)
    for factor in (0.8, 1.25):
        n = n_opt * factor
        assert TRUE.loss(n, flops / 6 / n) > TRUE.loss(n_opt, d_opt)


def test_fit_refuses_one_model_size():
    with pytest.raises(TrainwiseError, match="same parameter count"):
        fit_law([1e6] * 6, np.geomspace(1e6, 1e8, 6), np.linspace(4, 3, 6))


# ---------------------------------------------------------------------------------------------------
# Real runs: points, the stored fit, predict, optimal, plan

TINY = ["model.n_layers=1", "model.max_seq_len=32", "train.seq_len=32", "train.micro_batch=4",
        "tokenizer.vocab_size=300", "train.eval_steps=2", "train.log_every=2", "train.warmup_steps=2",
        "train.sample_tokens=4", "train.precision=fp32", "train.checkpoint_every=0", "train.compile=false",
        "train.lr=3e-3"]


def tiny_run(corpus, out, d_model: int, steps: int, constant: bool = True, extra=()):
    from trainwise.trainer.loop import train

    sets = TINY + [f"data.paths=['{corpus}']", f"model.d_model={d_model}", f"model.n_heads={d_model // 8}",
                   f"model.n_kv_heads={d_model // 8}", f"train.max_steps={steps}", "train.eval_every=2", *extra]
    sets += ["train.min_lr=3e-3"] if constant else ["train.min_lr=3e-4"]
    return train(apply_overrides(RunConfig(), sets), out=out, quiet=True).run_dir


@pytest.fixture(scope="module")
def tiny_runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("scale-runs")
    return [tiny_run(corpus, root / f"d{d}", d, 16) for d in (8, 16, 32)]


def test_points_constant_lr_uses_the_curve_and_cosine_only_the_end(corpus, tiny_runs, tmp_path):
    from trainwise.scale.points import non_embedding_params, read_run

    pts = read_run(tiny_runs[0])
    assert pts.schedule == "constant"
    assert list(pts.tokens) == [4 * 32 * s for s in range(2, 17, 2)]  # rows from 10% of the run on
    assert pts.n_params == non_embedding_params(pts.config) < pts.config.model.vocab_size * 8
    cosine = read_run(tiny_run(corpus, tmp_path / "cos", 8, 6, constant=False))
    assert cosine.schedule == "decaying" and len(cosine.tokens) == 1 and cosine.tokens[0] == 6 * 4 * 32
    assert "not losses of shorter runs" in cosine.used

    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(tiny_runs[0], cut)
    text = (cut / "config.toml").read_text()
    (cut / "config.toml").write_text(text.replace("max_steps = 16", "max_steps = 99"))
    with pytest.raises(TrainwiseError, match="stopped at step 16 of 99"):
        read_run(cut)


def test_rows_past_four_passes_over_the_corpus_are_not_fitted(corpus, tmp_path):
    """A corpus of a few hundred tokens and a run of 3,072: the rows past 4 passes over its training split
    are left out (the law has no term for repeated tokens), and the fit says why when too few are left."""
    from trainwise.scale.fitting import fit_runs
    from trainwise.scale.points import REPEAT_EPOCHS, read_run

    small = tmp_path / "small.txt"
    small.write_text(corpus.read_text(encoding="utf-8")[:700], encoding="utf-8")
    pts = read_run(tiny_run(small, tmp_path / "run", 8, 24, extra=["data.val_fraction=0.2"]))
    assert 100 < pts.unique_tokens < 3072 / REPEAT_EPOCHS  # so that some rows are past 4 passes
    everything = [4 * 32 * s for s in range(4, 25, 2)]  # the rows from 10% of the run (and warmup) on
    assert list(pts.tokens) == [d for d in everything if d <= REPEAT_EPOCHS * pts.unique_tokens]
    assert 0 < len(pts.tokens) < 5 and pts.past_passes == len(everything) - len(pts.tokens)
    assert f"past {REPEAT_EPOCHS} passes over the corpus's {pts.unique_tokens:,} training tokens" in pts.used
    with pytest.raises(TrainwiseError, match="fewer than 5 validation rows within 4 passes"):
        fit_runs([pts.run_dir])


def test_optimal_stays_within_four_passes_and_names_what_more_text_would_buy():
    """Hoffmann et al.'s law on a 1e6-token corpus at 1e16 FLOPs: unconstrained, a mid-size model on many
    passes wins; constrained, the best model whose D is at most 4 passes, and the answer says both."""
    from scale_records import record_of

    from trainwise.scale.fitting import optimal

    record = record_of(synthetic_curves(TRUE, noise=0.003), unique=1_000_000)  # identifies N and D
    free = optimal({**record, "corpus_train_tokens": None}, 1e16)
    assert free["data_bound"] is None and free["tokens"] > 4e6  # what the law alone would choose
    bound = optimal(record, 1e16)
    assert bound["tokens"] <= 4e6 and bound["repetition_note"] is None
    assert bound["n_params"] > free["n_params"] and bound["loss"] >= free["loss"]
    assert bound["data_bound"]["model"] == free["model"] and bound["data_bound"]["passes"] > 4
    fitted_up_to = optimal({**record, "runs": [{"n_params": 1e6, "points": [[1e8, 3.0]]}]}, 1e16)["n_beyond_fitted"]
    assert fitted_up_to == pytest.approx(bound["n_params"] / 1e6) and bound["n_beyond_fitted"] is None


def test_fit_cli_stores_per_corpus_and_plan_predict_optimal_read_it(corpus, tiny_runs, tmp_path, capsys):
    from trainwise.cli import main

    png = tmp_path / "fit.png"
    assert main(["scale", "fit", *map(str, tiny_runs), "--bootstrap", "4", "--plot", str(png), "--json"]) == 0
    record = json.loads(capsys.readouterr().out.split("\n", 1)[1])  # after the "plot: FILE" line
    assert set(record["identification"]["parameters"]) == {"E", "A", "B", "alpha", "beta"}
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert record["recipe"]["schedule"] == "constant" and record["bootstrap"]["samples"] == 4
    assert record["residuals"]["points"] == 24 and len(record["runs"]) == 3
    assert record["vocab_size"] == 300 and f"'{corpus}'" in record["corpus"]
    law = record["law"]
    last = record["runs"][-1]
    observed = last["points"][-1][1]
    fitted = law["E"] + law["A"] / last["n_params"] ** law["alpha"] + law["B"] / last["points"][-1][0] ** law["beta"]
    assert fitted == pytest.approx(observed, rel=0.05)

    toml = tmp_path / "run.toml"
    cfg = apply_overrides(RunConfig(), TINY + [f"data.paths=['{corpus}']", "model.d_model=16", "model.n_heads=2",
                                               "model.n_kv_heads=2", "train.max_steps=16"])
    save_config(cfg, toml)
    assert main(["scale", "predict", "--model", str(toml), "--json"]) == 0
    pred = json.loads(capsys.readouterr().out)
    assert pred["tokens"] == 16 * 4 * 32 and not pred["extrapolates"]
    assert pred["loss"] == pytest.approx(record["runs"][1]["points"][-1][1], rel=0.05)
    lo, hi = pred["loss_p5_p95"]
    assert lo <= hi and pred["repetition_note"] is None
    assert 0 < record["corpus_train_tokens"] < 60_000  # 95% of the 60 KB corpus fixture, 300-token BPE

    # Past the fitted D (and past 4 passes): where the fit identifies the D term, a prediction with a warning;
    # where it does not (three tiny runs of 16 steps may not), a refusal that names the runs that would
    code = main(["scale", "predict", "--model", str(toml), "--tokens", "1e6", "--json"])
    out, err = capsys.readouterr()
    if record["identification"]["axes"]["D"]:
        assert code == 0 and "passes over the corpus" in json.loads(out)["repetition_note"]
    else:
        assert code == 2 and "does not identify the D term" in " ".join(err.split())

    assert main(["plan", "--model", str(toml), "--gpu", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_loss"]["loss"] == pytest.approx(pred["loss"])

    # a reduced form: E held, the other four fitted; a form that is none is refused before any work
    assert main(["scale", "fit", *map(str, tiny_runs), "--bootstrap", "4", "--form", "E=4", "--json"]) == 0
    held = json.loads(capsys.readouterr().out)
    assert held["form"] == "E=4" and held["law"]["E"] == 4
    assert held["identification"]["parameters"]["E"]["identified"] is None
    assert main(["scale", "sweep", "--minutes", "1", "--form", "E=none"]) == 2
    assert "is not a form of the law" in capsys.readouterr().err

    # optimal finds the stored fit by --data and --vocab-size (tests/test_scale_identify.py checks its plan)
    code = main(["scale", "optimal", "--flops", "1e12", "--data", str(corpus), "--vocab-size", "300", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["plan"]["model"]["name"] or \
        code == 2 and "does not identify the" in " ".join(err.split())


def test_predict_without_a_fit_says_how_to_make_one(capsys):
    from trainwise.cli import main

    assert main(["scale", "predict", "--model", "trainwise-small", "--tokens", "1e6", "--vocab-size", "777"]) == 2
    assert "scale sweep" in capsys.readouterr().err


def test_a_fit_file_that_is_no_fit_record_is_one_error(tmp_path, capsys):
    from dataclasses import fields

    from trainwise.cli import main
    from trainwise.scale.law import Law
    from trainwise.scale.store import LAW_KEYS

    assert LAW_KEYS == tuple(f.name for f in fields(Law))  # the store's check names the law's own fields

    for text, why in (("{", "not JSON"), ("[1]", "not a JSON object"), ("{}", "no law, bootstrap, runs, conventions"),
                      ('{"law": {"E": "x"}, "bootstrap": {}, "runs": [], "conventions": {}}', "its law is not")):
        path = tmp_path / "fit.json"
        path.write_text(text)
        for command in (["predict", "--model", "trainwise-small", "--tokens", "1e6"], ["optimal", "--flops", "1e14"]):
            assert main(["scale", *command, "--fit", str(path)]) == 2
            assert f"is not a fit record of `trainwise scale fit` ({why}" in " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------------------------------------------
# The sweep


def test_sweep_grid_centres_on_20_tokens_per_parameter_and_grows_with_compute():
    from trainwise.scale.points import non_embedding_params
    from trainwise.scale.sweep import SWEEP_MODELS, choose_models, flops_per_token, predict_seconds

    small, large = choose_models(RunConfig(), 1e13), choose_models(RunConfig(), 1e16)
    assert len(small) == len(large) == SWEEP_MODELS
    assert non_embedding_params(large[2]) > non_embedding_params(small[2])
    for cfg in small + large:
        assert cfg.train.min_lr == cfg.train.lr and cfg.train.compile == "false"  # constant LR: curves count
    middle = large[2]
    ratio = 1e16 / flops_per_token(middle) / non_embedding_params(middle)
    assert 5 < ratio < 80  # the ladder's nearest size to D = 20 N
    one = predict_seconds(middle, 1e6, 1e11, 0.2)
    assert predict_seconds(middle, 2e6, 1e11, 0.2) == pytest.approx(2 * one, rel=0.05)
    assert one > 1e6 * flops_per_token(middle) / (1e11 * 0.2)  # evaluation time is added


@pytest.mark.slow
def test_sweep_cli_trains_the_grid_inside_the_budget_and_fits_it(corpus, tmp_path, capsys):
    import time

    from trainwise.cli import main

    start = time.perf_counter()
    assert main(["scale", "sweep", "--minutes", "1.5", "--data", str(corpus), "--set", "tokenizer.vocab_size=300",
                 "--out", str(tmp_path / "sweep"), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert 5 <= len(record["runs"]) <= 15 and all("validation rows" in r["used"] for r in record["runs"])  # seeds
    assert sum(r["measured_s"] for r in record["sweep"]["runs"]) < 1.5 * 60 * 2  # a minimum of steps can overrun
    assert time.perf_counter() - start < 1.5 * 60 * 4


def test_a_sweep_sizes_its_grid_against_the_peak_its_runs_train_at_and_stops_after_one_run(corpus, tmp_path):
    """The sweep at small size in the default suite: it sizes the grid, trains its first run and stops
    there (stop_at: before a run that would end after it, at least one run per call), its plan and that run
    in sweep.json. Each model's MFU is measured against the peak of the precision the runs train in (auto:
    fp32 on a CPU without fast bf16, whose bf16 peak is a quarter of fp32's: against it an MFU read above 1)."""
    import time

    import torch

    from trainwise.runtime.precision import resolve_precision
    from trainwise.scale.sweep import SWEEP_STATE, SweepStopped, run_sweep, sweep_base

    base = sweep_base([f"data.paths={json.dumps([str(corpus)])}", "tokenizer.vocab_size=300"])
    said = []
    with pytest.raises(SweepStopped, match="run the same command to continue"):
        run_sweep(0.3, tmp_path / "sweep", base, say=said.append, stop_at=time.time())
    precision = resolve_precision(base.train.precision, torch.device("cpu"))[0]
    assert any(f"measured {precision} matmul peak" in line for line in said)
    state = json.loads((tmp_path / "sweep" / SWEEP_STATE).read_text())
    assert len(state["runs"]) >= 5 and all(0 < r["mfu"] < 1 for r in state["runs"])
    assert [r["measured_s"] is not None for r in state["runs"]] == [True] + [False] * (len(state["runs"]) - 1)


@pytest.mark.slow
def test_a_sweep_stopped_between_runs_continues_where_it_stopped(corpus, tmp_path):
    """run_sweep(stop_at=...) stops before a run that would end after it (at least one run per call), keeps
    its plan and finished runs in sweep.json, and the same call continues: a shared machine's slices."""
    import time

    from trainwise.scale.sweep import SWEEP_STATE, SweepStopped, run_sweep, sweep_base

    base = sweep_base([f"data.paths={json.dumps([str(corpus)])}", "tokenizer.vocab_size=300"])
    out, calls = tmp_path / "sweep", 0
    while True:
        calls += 1
        try:
            runs = run_sweep(0.3, out, base, say=lambda *a: None, stop_at=time.time())  # one run per call
            break
        except SweepStopped as stop:
            assert "run the same command to continue" in str(stop)
            assert calls < 20
    state = json.loads((out / SWEEP_STATE).read_text())
    assert calls == len(runs) >= 5 and state["seeds_done"]
    assert sorted(str(r.run_dir) for r in runs) == sorted(str(p) for p in out.iterdir() if p.is_dir())
    assert state["spent_s"] >= sum(r.measured_s for r in runs)  # the budget counts training, not the gaps
