"""What a scaling-law fit can and cannot tell (issue 31): reduced forms, identification, refusals, the chart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scale_records import SMALL_CORPUS, TRUE, curves, record_of

from trainwise.errors import TrainwiseError
from trainwise.scale.fitting import (
    fit_points,
    identification_of,
    identifying_sweep,
    optimal,
    predict,
    refusal,
)
from trainwise.scale.law import (
    PARAM_NAMES,
    Form,
    Law,
    bootstrap,
    fit_law,
    identification,
)


@pytest.fixture(scope="module")
def well_posed() -> dict:
    """Six sizes over three decades of N and D: every parameter pinned down."""
    return record_of(curves(TRUE, np.geomspace(1e6, 1e9, 6), np.geomspace(1e8, 1e11, 12), 0.003))


@pytest.fixture(scope="module")
def d_only() -> dict:
    """The built-in corpus's situation: five small models on 0.07-0.4M tokens, where the N term is
    below the seed-to-seed spread (5% per run) of the curves."""
    sizes = [106_816, 221_664, 426_624, 635_680, 1_328_448]
    return record_of(curves(SMALL_CORPUS, sizes, np.geomspace(4e4, 4e5, 12), 0.01, run_noise=0.05),
                     unique=106_665)


def test_form_parses_the_reduced_forms_and_says_what_it_takes():
    assert Form.parse("full") == Form() and Form.parse("alpha = beta") == Form(tied=True)
    assert Form.parse("E=1.7") == Form(E=1.7) and str(Form(E=1.7)) == "E=1.7"
    for bad in ("E=abc", "E=0", "E=-1", "alpha", "E=1e9"):
        with pytest.raises(TrainwiseError, match="is not a form of the law: give full, alpha=beta, or E=VALUE"):
            Form.parse(bad)


def test_reduced_forms_hold_their_parameters_and_recover_the_rest():
    pts = np.concatenate(curves(TRUE, np.geomspace(1e6, 1e9, 6), np.geomspace(1e8, 1e11, 12), 0.003))
    held, _ = fit_law(pts[:, 0], pts[:, 1], pts[:, 2], form=Form(E=TRUE.E))
    assert held.E == pytest.approx(TRUE.E, rel=1e-12)
    for name in ("A", "B", "alpha", "beta"):
        assert getattr(held, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name
    equal = Law(E=1.69, A=406.4, B=410.7, alpha=0.3, beta=0.3)
    pts = np.concatenate(curves(equal, np.geomspace(1e6, 1e9, 6), np.geomspace(1e8, 1e11, 12), 0.003))
    tied, _ = fit_law(pts[:, 0], pts[:, 1], pts[:, 2], form=Form(tied=True))
    assert tied.alpha == tied.beta == pytest.approx(0.3, rel=0.05)
    assert tied.E == pytest.approx(1.69, rel=0.05)
    ident = identification(bootstrap([pts[pts[:, 0] == n] for n in np.unique(pts[:, 0])], tied, samples=6,
                                     form=Form(tied=True)), Form(tied=True))
    assert ident["beta"]["why"].startswith("equal to alpha by the form") and ident["alpha"]["identified"]


def test_well_posed_curves_identify_all_five_parameters(well_posed):
    ident = well_posed["identification"]
    assert all(ident["parameters"][k]["identified"] for k in PARAM_NAMES), ident["parameters"]
    assert ident["axes"] == {"N": True, "D": True}
    assert 0.2 < ident["terms"]["N"]["share_of_range"] < 1 and 0.2 < ident["terms"]["D"]["share_of_range"] < 1
    assert refusal(well_posed, 1e11, 1e13) is None  # far beyond the fitted points along both axes, allowed


def test_a_d_only_sweep_identifies_neither_n_nor_e_and_says_so(d_only):
    ident = d_only["identification"]
    assert ident["axes"]["N"] is False and ident["parameters"]["E"]["identified"] is False
    for name in ("A", "alpha"):
        p = ident["parameters"][name]
        if p["identified"] is False:
            assert "reaches the search's bound" in p["why"] or "spans" in p["why"]
    n, d = ident["terms"]["N"], ident["terms"]["D"]
    assert n["max"] - n["min"] < d["max"] - d["min"]


def test_predict_and_optimal_refuse_to_extrapolate_an_unidentified_axis_and_name_the_runs(d_only):
    from trainwise.config import RunConfig

    inside = d_only["runs"][2]["n_params"]
    assert refusal(d_only, inside, 2e5) is None  # within the fitted models: the law interpolates
    why = refusal(d_only, 4e8, 2e5)
    assert why.startswith("N = 400,000,000 lies outside the fitted 106,816-1,328,448")
    assert "does not identify the N term A/N^alpha" in why
    assert "What would identify it: the runs `trainwise scale sweep` trains" in why
    assert "passes over this corpus's 106,665 training tokens" in why and "--data builtin:stdlib" in why
    with pytest.raises(TrainwiseError, match="does not identify the N term"):
        optimal(d_only, 1e15)
    with pytest.raises(TrainwiseError, match="no prediction for"):
        predict(d_only, RunConfig(), 2e5)  # the default model: N = 3.4M, outside the fitted sizes
    kept = predict(d_only, RunConfig(), 2e5, refuse=False)
    assert kept["not_identified"] == refusal(d_only, kept["n_params"], 2e5)


def test_the_identifying_sweep_reaches_the_target_in_n_and_in_d(d_only):
    from trainwise.scale.sweep import SWEEP_WIDTHS

    text = identifying_sweep(d_only, 3e6, None)
    assert "scale-d192-l3" in text or "scale-d256-l4" in text  # a grid whose largest model reaches N = 3M
    text = identifying_sweep(d_only, None, 5e7)
    c = float(text.split("C = ")[1].split(" ")[0])
    assert 5e7 <= c / 2.4e6 < 2 * 5e7 * 4  # the smallest model's run reaches D = 5e7 (within a doubling of C)
    top = identifying_sweep(d_only, 1e12, None)
    assert f"scale-d{SWEEP_WIDTHS[-1]}" in top and "the sweep's ladder ends there" in top


def test_fit_cli_prints_identification_and_optimal_plans_from_an_identified_fit(well_posed, tmp_path, capsys):
    from trainwise.cli import main
    from trainwise.commands.scale import format_fit

    text = format_fit({**well_posed, "stored": "x"})
    assert text.count("identified") >= 5 and "NOT IDENTIFIED" not in text
    assert "N term A/N^alpha" in text and "each term's range over them, as a share of that span" in text
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(well_posed))
    assert main(["scale", "optimal", "--flops", "1e12", "--fit", str(path), "--gpu", "h100", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert best["tokens"] * best["flops_per_token"] == pytest.approx(1e12)
    assert best["plan"]["model"]["name"] == best["model"]


def test_fit_cli_on_unidentified_points_says_which_and_optimal_refuses(d_only, tmp_path, capsys):
    from trainwise.cli import main
    from trainwise.commands.scale import format_fit

    text = format_fit({**d_only, "stored": "x"})
    assert "NOT IDENTIFIED" in text and "the points do not identify the N term" in text
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(d_only))
    assert main(["scale", "optimal", "--flops", "1e15", "--fit", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the CLI wraps the message
    print(err)
    assert "does not identify the N term" in err and "What would identify it" in err and "Traceback" not in err


def test_chart_has_one_colour_per_model_one_marker_per_seed_and_a_legend_by_model():
    from trainwise.scale.plot import fit_figure

    groups = []
    for seed in (1337, 1, 2):
        for name, n in (("small", 1e6), ("large", 1e7)):
            d = np.geomspace(1e8, 1e9, 4)
            groups.append((name, seed, np.stack([np.full(4, n), d, TRUE.loss(n, d)], axis=1)))
    fig = fit_figure(groups, TRUE)
    left = fig.axes[0]
    labels = [t.get_text() for t in left.get_legend().get_texts()]
    assert labels == ["small (N=1M)", "large (N=10M)", "seed 1337", "seed 1", "seed 2"]
    scatters = left.collections
    assert len(scatters) == 6
    colours = {tuple(np.round(s.get_facecolor()[0], 3)) for s in scatters}
    assert len(colours) == 2  # one per model, whatever the seed
    paths = {s.get_paths()[0].vertices.tobytes() for s in scatters}
    assert len(paths) == 3  # one marker shape per seed


@pytest.fixture(scope="module")
def builtin_docs_sweep() -> dict:
    """The fit of a real sweep on the default built-in corpus (tests/data: its measured points)."""
    sweep = json.loads((Path(__file__).parent / "data" / "scale_builtin_docs_sweep.json").read_text())
    groups = [np.array([[r["n_params"], d, l] for d, l in r["points"]]) for r in sweep["runs"]]
    record = {**fit_points(groups, samples=20), **{k: sweep[k] for k in ("corpus", "corpus_train_tokens", "recipe",
                                                                          "vocab_size")},
              "conventions": {"N": "non-embedding parameters", "D": "tokens", "L": "nats/token"},
              "runs": [{**r, "run_dir": f"{r['name']}-seed{r['seed']}", "used": "recorded"} for r in sweep["runs"]]}
    record["identification"] = identification_of(record)
    return record


def test_on_the_small_built_in_corpus_fit_says_what_is_not_identified_and_optimal_refuses_n(builtin_docs_sweep):
    """Issue 31: on the default corpus (106,665 training tokens) the sweep identifies a power law in D and
    nothing about N or E; the fit says so, and `scale optimal` will not plan a model far larger than the fitted."""
    from trainwise.commands.scale import format_fit

    text = format_fit({**builtin_docs_sweep, "stored": "x"})
    rows = {line.split()[0]: line for line in text.splitlines()[3:8]}
    for name in ("E", "A", "alpha"):
        assert "NOT IDENTIFIED" in rows[name], rows[name]
    assert "NOT IDENTIFIED" not in rows["B"] and "NOT IDENTIFIED" not in rows["beta"]
    assert "E" in rows and "reaches the search's bound" in rows["E"]
    assert "the points do not identify the N term" in text
    terms = builtin_docs_sweep["identification"]["terms"]
    assert terms["N"]["max"] - terms["N"]["min"] < 0.25 * (terms["D"]["max"] - terms["D"]["min"])
    with pytest.raises(TrainwiseError) as refused:
        optimal(builtin_docs_sweep, 1e15)
    why = str(refused.value)
    assert "does not identify the N term A/N^alpha" in why and "lies outside the fitted 106,816-1,328,448" in why
    assert "passes over this corpus's 106,665 training tokens" in why and "--data builtin:stdlib" in why
    assert optimal(builtin_docs_sweep, 4.1e12, widths=range(64, 200, 32))["n_params"] <= 1_328_448  # inside N: plans


def test_plan_gives_no_loss_where_the_stored_fit_refuses(builtin_docs_sweep, tmp_path, monkeypatch, capsys):
    """`trainwise plan` on the default corpus, whose stored fit identifies no N term: the default model
    (N = 3.4M, outside the fitted sizes) gets the refusal instead of a number, as `scale predict` does."""
    from trainwise.cli import main
    from trainwise.config import DataConfig
    from trainwise.data.corpus import corpus_key
    from trainwise.scale.store import fits_dir

    monkeypatch.setenv("TRAINWISE_CACHE", str(tmp_path / "cache"))  # a plan for an H100 needs no calibration
    fits_dir().mkdir(parents=True)
    (fits_dir() / "docs.json").write_text(json.dumps({**builtin_docs_sweep, "corpus_key": corpus_key(DataConfig())}))
    assert main(["plan", "--model", "trainwise-small", "--tokens", "2e5", "--gpu", "h100", "--json"]) == 0
    scaling = json.loads(capsys.readouterr().out)["predicted_loss"]
    assert scaling["loss"] is None and "does not identify the N term" in scaling["not_identified"]
    assert main(["plan", "--model", "trainwise-small", "--tokens", "2e5", "--gpu", "h100"]) == 0
    assert "predicted val loss     none: the `trainwise scale` fit of this corpus refuses" in capsys.readouterr().out
