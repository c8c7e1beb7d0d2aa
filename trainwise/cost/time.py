"""Wall-clock time and cost from FLOPs, device count, peak FLOP/s and MFU.

time = C / (G x peak x MFU)  (Chinchilla, Hoffmann et al. 2022 appendix F; PaLM section 4.1 for MFU).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwise.errors import TrainwiseError

DEFAULT_MFU = 0.4
SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class TimeEstimate:
    seconds: float
    devices: int

    @property
    def days(self) -> float:
        return self.seconds / SECONDS_PER_DAY

    @property
    def device_hours(self) -> float:
        return self.seconds * self.devices / 3600.0


def training_seconds(total_flops: float, devices: int, peak_flops: float, mfu: float = DEFAULT_MFU) -> float:
    """seconds = total FLOPs / (G x peak FLOP/s x MFU). 6e19 / (1 x 100e12 x 0.4) = 1.5e6 s = 17.36 days."""
    if not 0 < mfu <= 1:
        raise TrainwiseError(f"--mfu {mfu} must be in (0, 1], e.g. 0.4.")
    if devices <= 0 or peak_flops <= 0:
        raise TrainwiseError("device count and peak FLOP/s must be positive.")
    return total_flops / (devices * peak_flops * mfu)


def estimate_time(total_flops: float, devices: int, peak_flops: float, mfu: float = DEFAULT_MFU) -> TimeEstimate:
    return TimeEstimate(training_seconds(total_flops, devices, peak_flops, mfu), devices)


def cost_usd(device_hours: float, price_per_device_hour: float) -> float:
    """cost = device-hours x $ per device-hour."""
    return device_hours * price_per_device_hour


def ridge_point(peak_flops: float, bandwidth_bytes_per_s: float) -> float:
    """Ridge point of the roofline = P / BW, in FLOPs per byte: the arithmetic intensity above which a
    kernel is compute-bound (Williams, Waterman, Patterson 2009, "Roofline"). 100e12 / 1e12 = 100."""
    return peak_flops / bandwidth_bytes_per_s


def attainable_flops(intensity: float, peak_flops: float, bandwidth_bytes_per_s: float) -> float:
    """Roofline: attainable FLOP/s = min(P, I x BW) for arithmetic intensity I (FLOPs/byte)
    (Williams et al. 2009). 100 TFLOP/s, 1 TB/s: I = 20 -> 20e12; I = 150 -> 100e12."""
    return min(peak_flops, intensity * bandwidth_bytes_per_s)


def roofline_seconds(flops: float, bytes_moved: float, peak_flops: float, bandwidth_bytes_per_s: float) -> float:
    """Lower-bound time of a kernel = max(F / P, Q / BW) seconds (Williams et al. 2009)."""
    return max(flops / peak_flops, bytes_moved / bandwidth_bytes_per_s)


def model_flops_utilization(model_flops_per_s: float, peak_flops: float, devices: int = 1) -> float:
    """MFU = model FLOPs per second / (devices x peak FLOP/s) (PaLM, Chowdhery et al. 2022, appendix B);
    model FLOPs exclude recomputation. 40e12 / 100e12 = 0.4."""
    return model_flops_per_s / (devices * peak_flops)


def fit_linear(rows: list[tuple[list[float], float]]) -> list[float]:
    """Non-negative x minimising sum(((features . x) - t) / t)^2 over rows (features, t): a least-squares
    fit in relative error, so that small and large kernels count alike, with every coefficient >= 0
    (each is a time per unit of work). Exact for few features: every subset of free coefficients is
    solved, the best feasible one kept. Rows ([1, 2], 5) and ([1, 4], 9) give x = [1, 2]."""
    import itertools

    import numpy as np

    a = np.array([[f / t for f in feats] for feats, t in rows], dtype=float)
    b = np.ones(len(rows))
    n = a.shape[1]
    best, best_err = np.zeros(n), float("inf")
    for k in range(1, n + 1):
        for keep in itertools.combinations(range(n), k):
            x = np.zeros(n)
            x[list(keep)] = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
            if (x < 0).any():
                continue
            err = float(((a @ x - b) ** 2).sum())
            if err < best_err:
                best, best_err = x, err
    return [float(v) for v in best]
