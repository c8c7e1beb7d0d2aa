"""The scaling law L(N, D) = E + A / N^alpha + B / D^beta and its fit (Hoffmann et al. 2022, approach 3).

Hoffmann et al. ("Training Compute-Optimal Large Language Models", section 3.3 and appendix D.2) fit
the five parameters by minimising the Huber loss (delta = 1e-3) between the log of the predicted and the
log of the observed loss, with the prediction written in log-sum-exp form so that the optimiser works
on unconstrained numbers:

    log L_hat(N, D) = LSE(a - alpha log N,  b - beta log D,  e),   A = e^a, B = e^b, E = e^e

They ran L-BFGS from every point of a grid of initialisations and kept the best. Here the objective is
evaluated on the whole grid at once (cheap, vectorised) and L-BFGS starts from the best GRID_STARTS
grid points; the grid is theirs (alpha, beta in 0..2 by 0.5; e in -1..1.5 by 0.5; a, b in 0..25 by 5).
Uncertainty is a wild cluster bootstrap (Cameron, Gelbach & Miller 2008): every refit keeps every run
and point, and moves each run's residual curve (log observed - log fitted) by one random weight from
Webb's six-point distribution (Webb 2023, "Reworking wild bootstrap-based inference for clustered
errors": for few clusters). A run is one cluster because its points share its noise (its seed, its
batches). Resampling whole runs instead changes the design: a sweep has one run per model size, and a
resample that lacks the largest sizes leaves the N term free (on the 5-run sweep of benchmarks/RESULTS.md,
20 of 100 such refits put alpha at the search's bound), which says what a different sweep would not know,
not what this one does.

What the data can tell (identify): a parameter whose bootstrap interval reaches a bound of the search box,
or spans more than an order of magnitude, is not identified: the points leave it free. When data are
short the fit can hold some parameters (Form): E at a value known from elsewhere, or alpha = beta.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np

from trainwise.errors import TrainwiseError

HUBER_DELTA = 1e-3
GRID = dict(alpha=np.arange(0.0, 2.01, 0.5), beta=np.arange(0.0, 2.01, 0.5), e=np.arange(-1.0, 1.51, 0.5),
            a=np.arange(0.0, 25.1, 5.0), b=np.arange(0.0, 25.1, 5.0))
GRID_STARTS = 24  # L-BFGS runs from this many of the best grid points (Hoffmann: from all of them)
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")
# Box for (a, b, e, alpha, beta): wide enough never to bind on a well-posed fit, and it keeps a
# degenerate one (few model sizes, where A and alpha trade off without limit) finite.
BOUNDS = [(-20.0, 100.0), (-20.0, 100.0), (-10.0, 10.0), (0.0, 5.0), (0.0, 5.0)]
# Webb's six-point weights: -sqrt(3/2), -1, -sqrt(1/2), sqrt(1/2), 1, sqrt(3/2), each with probability 1/6
WILD_WEIGHTS = np.array([-math.sqrt(1.5), -1.0, -math.sqrt(0.5), math.sqrt(0.5), 1.0, math.sqrt(1.5)])
SEARCHED = ("A", "B", "E", "alpha", "beta")  # the parameter each row of BOUNDS bounds (A, B, E through their logs)
# Identified: the bootstrap's 5-95% interval stays further than this share of the box's width from both
# bounds (on the searched scale: log E, log A, log B, alpha, beta) and spans at most IDENTIFIED_SPAN x.
BOUND_MARGIN = 0.01
IDENTIFIED_SPAN = 10.0  # identified: the interval spans no more than an order of magnitude


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta, in nats per token; N = non-embedding parameters."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n_params, tokens):
        """Predicted loss (nats/token) of N parameters trained on D tokens (scalars or arrays)."""
        return self.E + self.A / np.power(n_params, self.alpha) + self.B / np.power(tokens, self.beta)

    def optimal_6nd(self, flops: float) -> tuple[float, float]:
        """Compute-optimal (N, D) for C = 6ND (Hoffmann et al. eq. 4): N = G (C/6)^(beta/(alpha+beta)),
        D = G^-1 (C/6)^(alpha/(alpha+beta)), G = (alpha A / (beta B))^(1/(alpha+beta))."""
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / s)
        return g * (flops / 6.0) ** (self.beta / s), (flops / 6.0) ** (self.alpha / s) / g

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Form:
    """Which of the five parameters the fit moves. "full"; "E=VALUE": E held (known from a fit on more
    data of the same corpus and tokenizer), the reduced form when the points show no floor; "alpha=beta":
    one exponent for both terms, which makes N_opt and D_opt each grow as C^0.5, the equal scaling
    Hoffmann et al.'s approaches 1 and 2 found (their table 2: a = 0.50 / 0.49, b = 0.50 / 0.51)."""

    E: float | None = None
    tied: bool = False

    @staticmethod
    def parse(text: str) -> Form:
        spec = text.replace(" ", "")
        if spec == "full":
            return Form()
        if spec in ("alpha=beta", "beta=alpha"):
            return Form(tied=True)
        if spec.startswith("E="):
            try:
                value = float(spec[2:])
            except ValueError:
                value = math.nan
            low, high = (math.exp(v) for v in BOUNDS[2])
            if low < value < high:
                return Form(E=value)
        raise TrainwiseError(f"--form {text!r} is not a form of the law: give full, alpha=beta, or E=VALUE with "
                             f"VALUE the irreducible loss in nats/token between {math.exp(BOUNDS[2][0]):.2g} and "
                             f"{math.exp(BOUNDS[2][1]):.3g} (e.g. E=1.7).")

    def __str__(self) -> str:
        return f"E={self.E:g}" if self.E is not None else "alpha=beta" if self.tied else "full"

    def free(self) -> list[int]:
        """Indices of (a, b, e, alpha, beta) that the optimiser moves."""
        return [i for i in range(5) if not (i == 2 and self.E is not None) and not (i == 4 and self.tied)]

    def expand(self, z: np.ndarray) -> np.ndarray:
        x = np.zeros(5)
        x[self.free()] = z
        if self.E is not None:
            x[2] = math.log(self.E)
        if self.tied:
            x[4] = x[3]
        return x

    def reduce_grad(self, grad: np.ndarray) -> np.ndarray:
        g = grad.copy()
        if self.tied:
            g[3] += g[4]  # d/d alpha of f(.., alpha, beta = alpha)
        return g[self.free()]


FULL = Form()  # all five parameters free


def _unpack(x: np.ndarray) -> Law:
    a, b, e, alpha, beta = x
    return Law(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta))


def _huber(r: np.ndarray, delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals r and its derivative: r^2/2 inside |r| <= delta, linear outside."""
    inside = np.abs(r) <= delta
    value = np.where(inside, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))
    return value, np.where(inside, r, delta * np.sign(r))


def objective(x: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray) -> tuple[float, np.ndarray]:
    """Sum of Huber(LSE(a - alpha log N, b - beta log D, e) - log L) and its gradient in (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = x
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])  # (3, P)
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    lse = top + np.log(weights.sum(axis=0))
    soft = weights / weights.sum(axis=0)  # d LSE / d term
    value, slope = _huber(lse - log_l)
    grad = np.array([(slope * soft[0]).sum(), (slope * soft[1]).sum(), (slope * soft[2]).sum(),
                     -(slope * soft[0] * log_n).sum(), -(slope * soft[1] * log_d).sum()])
    return float(value.sum()), grad


def _grid_values(log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                 form: Form) -> tuple[np.ndarray, np.ndarray]:
    """Every grid initialisation of the form as rows (a, b, e, alpha, beta) and its objective, vectorised."""
    starts = np.array(list(itertools.product(GRID["a"], GRID["b"], GRID["e"], GRID["alpha"], GRID["beta"])))
    if form.E is not None:
        starts = np.unique(np.column_stack([starts[:, :2], np.full(len(starts), math.log(form.E)), starts[:, 3:]]),
                           axis=0)
    if form.tied:
        starts = starts[starts[:, 3] == starts[:, 4]]
    a, b, e, alpha, beta = (starts[:, i:i + 1] for i in range(5))
    lse = np.logaddexp(np.logaddexp(a - alpha * log_n, b - beta * log_d), e)  # (S, P)
    value, _ = _huber(lse - log_l)
    return starts, value.sum(axis=1)


def _reduced_objective(z: np.ndarray, form: Form, *data) -> tuple[float, np.ndarray]:
    value, grad = objective(form.expand(z), *data)
    return value, form.reduce_grad(grad)


def _lbfgs(x0: np.ndarray, data: tuple, form: Form) -> tuple[np.ndarray, float]:
    from scipy.optimize import minimize

    free = form.free()
    res = minimize(_reduced_objective, x0[free], args=(form, *data), jac=True, method="L-BFGS-B",
                   bounds=[BOUNDS[i] for i in free], options=dict(maxiter=2000))
    return form.expand(res.x), float(res.fun)


def _one_blas_thread():
    """L-BFGS-B calls BLAS on 5-vectors; threaded OpenBLAS then spends its time waking threads (an
    iteration ran ~45x slower threaded than on one thread on a busy 2-core CPU)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def fit_law(n_params, tokens, losses, starts: np.ndarray | None = None, form: Form = FULL) -> tuple[Law, float]:
    """Fit the law (in `form`) to points (N_i, D_i, L_i); returns (law, final objective). `starts`: extra
    initialisations (rows a, b, e, alpha, beta) tried besides the best grid points."""
    n, d, l = (np.asarray(v, dtype=float) for v in (n_params, tokens, losses))
    free = len(form.free())
    if len(l) < free:
        raise TrainwiseError(f"a scaling-law fit of form {form} has {free} parameters and needs at least {free} "
                             f"points; got {len(l)}. Give more runs, or runs with more validation rows "
                             "(train.eval_every).")
    if np.any(n <= 0) or np.any(d <= 0) or np.any(l <= 0) or not np.all(np.isfinite(l)):
        raise TrainwiseError("every point needs N > 0, D > 0 and a finite loss > 0.")
    if len(np.unique(n)) < 2:
        raise TrainwiseError("all points have the same parameter count N, so A and alpha cannot be told apart "
                             "from E: fit runs of at least two (better four or more) model sizes.")
    data = (np.log(n), np.log(d), np.log(l))
    grid, values = _grid_values(*data, form)
    candidates = list(grid[np.argsort(values)[:GRID_STARTS]])
    if starts is not None:
        candidates = [form.expand(x[form.free()]) for x in starts] + candidates[:GRID_STARTS // 3]
    try:
        import scipy.optimize  # noqa: F401
        import threadpoolctl  # noqa: F401
    except ModuleNotFoundError as err:
        raise TrainwiseError(f"the scaling-law fit needs {err.name}: pip install 'trainwise[scale]' "
                             "(scipy and threadpoolctl).") from None
    best_x, best_f = None, math.inf
    with _one_blas_thread():
        for x0 in candidates:
            x, f = _lbfgs(np.asarray(x0, dtype=float), data, form)
            if f < best_f:
                best_x, best_f = x, f
    return _unpack(best_x), best_f


@dataclass(frozen=True)
class Bootstrap:
    """Spread of the fitted parameters over bootstrap refits: percentiles 5 and 95, and the refits."""

    unit: str  # what a bootstrap draw perturbs as one: "runs" (older records: "points")
    laws: list[Law]

    def interval(self, name: str) -> tuple[float, float]:
        values = [getattr(law, name) for law in self.laws]
        return float(np.percentile(values, 5)), float(np.percentile(values, 95))

    def predict_interval(self, n_params: float, tokens: float) -> tuple[float, float]:
        values = [law.loss(n_params, tokens) for law in self.laws]
        return float(np.percentile(values, 5)), float(np.percentile(values, 95))

    def term_interval(self, axis: str, at: float) -> tuple[float, float]:
        """5-95% of the N term A/N^alpha at N = at (axis "N"), or of the D term B/D^beta at D = at."""
        values = [law.A / at ** law.alpha if axis == "N" else law.B / at ** law.beta for law in self.laws]
        return float(np.percentile(values, 5)), float(np.percentile(values, 95))

    def to_json(self) -> dict:
        return {"unit": self.unit, "method": "wild cluster bootstrap, one cluster per run, Webb six-point weights",
                "samples": len(self.laws), "p5_p95": {k: list(self.interval(k)) for k in PARAM_NAMES}}


def bootstrap(groups: list[np.ndarray], law: Law, samples: int = 100, seed: int = 0, form: Form = FULL) -> Bootstrap:
    """Refit `samples` times on data made from the fit and the residuals (module docstring), starting
    from the full fit and a few grid points. groups: one (P_i, 3) array of (N, D, L) per run."""
    rng = np.random.default_rng(seed)
    start = np.array([[math.log(law.A), math.log(law.B), math.log(law.E), law.alpha, law.beta]])
    fitted = [law.loss(g[:, 0], g[:, 1]) for g in groups]
    residuals = [np.log(g[:, 2]) - np.log(f) for g, f in zip(groups, fitted)]
    laws = []
    for _ in range(samples):
        weights = rng.choice(WILD_WEIGHTS, size=len(groups))
        pick = np.concatenate([np.column_stack([g[:, 0], g[:, 1], f * np.exp(w * r)])
                               for g, f, r, w in zip(groups, fitted, residuals, weights)])
        refit, _ = fit_law(pick[:, 0], pick[:, 1], pick[:, 2], starts=start, form=form)
        laws.append(refit)
    return Bootstrap("runs", laws)


def identification(boot: Bootstrap, form: Form = FULL) -> dict[str, dict]:
    """Per parameter: {"identified": bool, or None when the form holds it, "why": the reasons it is not}.
    Not identified: the 5-95% interval comes within BOUND_MARGIN of the box's width of a bound of the
    search (on the searched scale: log E, log A, log B, alpha, beta), or its upper end is more than
    IDENTIFIED_SPAN x its lower end."""
    out = {}
    for name, (low, high) in zip(SEARCHED, BOUNDS):
        if name == "E" and form.E is not None:
            out[name] = {"identified": None, "why": f"held at {form.E:g} by the form"}
            continue
        lo, hi = boot.interval(name)
        logged = name in ("A", "B", "E")
        why = []
        for end, bound in zip((lo, hi), (low, high)):
            if abs((math.log(end) if logged else end) - bound) <= BOUND_MARGIN * (high - low):
                why.append(f"its interval reaches the search's bound {math.exp(bound) if logged else bound:.3g}"
                           + (f" (e^{bound:g})" if logged else ""))
        if lo > 0 and hi / lo > IDENTIFIED_SPAN:
            why.append(f"its interval spans {hi / lo:.3g}x")
        out[name] = {"identified": not why, "why": "; ".join(why)}
    if form.tied:
        out["beta"]["why"] = "; ".join(["equal to alpha by the form"] + [out["beta"]["why"]] * bool(out["beta"]["why"]))
    return out
