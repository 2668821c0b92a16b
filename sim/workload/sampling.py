"""Random draws shared by the scenario generators."""
from __future__ import annotations

import numpy as np


def lognormal_tokens(rng: np.random.Generator, mean: float, sigma: float, size=None):
    """Integer lengths >= 1 from a lognormal whose mean is `mean`."""
    mu = np.log(max(mean, 1.0)) - sigma * sigma / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size))).astype(np.int64)


def zipf_choice(rng: np.random.Generator, n: int, exponent: float, size: int) -> np.ndarray:
    """Indices 0..n-1 with probability proportional to 1 / (rank ** exponent)."""
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    return rng.choice(n, size=size, p=weights / weights.sum())


def poisson_arrivals(rng: np.random.Generator, rate_per_s: float, count: int) -> np.ndarray:
    """Arrival times of a Poisson process with the given rate, starting after one gap."""
    return np.cumsum(rng.exponential(1.0 / rate_per_s, count))


def off_grid(n: int, grid: int = 16) -> int:
    """Nudge a shared segment's length off the block grid, or hit rates would not depend on the
    block size."""
    return n + 1 if n % grid == 0 else n
