"""bench: what `vllm bench serve --dataset-name random` and TensorRT-LLM's `trtllm-bench` replay.

`num_prompts` independent requests of `input_len` prompt tokens and exactly `output_len` output
tokens (the benchmarks set ignore_eos), no shared tokens. With `range_ratio` r > 0 both lengths
are uniform integers in [len * (1 - r), len * (1 + r)], as vLLM's random dataset draws them.
Arrivals as `vllm bench serve` sends them: all at once with `request_rate: inf` (the default),
else gaps from a gamma distribution of shape `burstiness` (1: Poisson) at `request_rate`, the
first request at time 0. `max_concurrency` caps the requests in flight, as the client's semaphore
does: a request waits at the client until one finishes, and its latency counts from the moment it
is sent (vLLM starts its clock inside the semaphore).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from sim.errors import ConfigError
from sim.workload.request import Workload, independent_requests


@dataclass(frozen=True, slots=True)
class BenchSpec:
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None = None
    request_rate: float = math.inf
    range_ratio: float = 0.0
    burstiness: float = 1.0

    def __post_init__(self):
        try:  # `inf` arrives as a string from YAML and the command line
            object.__setattr__(self, "request_rate", float(self.request_rate))
        except (TypeError, ValueError):
            raise ConfigError(f"scenario.request_rate={self.request_rate} is not a number, "
                              f"scenario bench, give requests per second or inf") from None
        for key in ("input_len", "output_len", "num_prompts", "max_concurrency"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"scenario.{key}={value} is not a whole number, scenario bench, "
                                  f"give an integer" + (" or null" if key == "max_concurrency" else ""))
        problems = []
        if self.input_len < 1 or self.output_len < 1:
            problems.append("input_len and output_len must be >= 1")
        if self.num_prompts < 1:
            problems.append("num_prompts must be >= 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            problems.append("max_concurrency must be >= 1 or null (unlimited)")
        if not self.request_rate > 0:
            problems.append("request_rate must be > 0 (inf: all at once)")
        if not 0 <= self.range_ratio < 1:
            problems.append("range_ratio must be in [0, 1)")
        if not self.burstiness > 0:
            problems.append("burstiness must be > 0")
        if problems:
            raise ConfigError(f"{'; '.join(problems)}, scenario bench, fix those scenario.* keys")

    def lengths(self, rng: np.random.Generator, mean: int) -> np.ndarray:
        if self.range_ratio == 0:
            return np.full(self.num_prompts, mean, dtype=np.int64)
        low = max(1, int(mean * (1 - self.range_ratio)))
        high = max(low, int(mean * (1 + self.range_ratio)))
        return rng.integers(low, high + 1, self.num_prompts)

    def arrivals(self, rng: np.random.Generator) -> np.ndarray:
        if math.isinf(self.request_rate):
            return np.zeros(self.num_prompts)
        theta = 1.0 / (self.request_rate * self.burstiness)
        gaps = rng.gamma(self.burstiness, theta, self.num_prompts - 1)
        return np.concatenate(([0.0], np.cumsum(gaps)))

    def generate(self, seed: int) -> Workload:
        arrivals_rng, lengths_rng = (np.random.default_rng(s)
                                     for s in np.random.SeedSequence(seed).spawn(2))
        inputs = self.lengths(lengths_rng, self.input_len)
        outputs = self.lengths(lengths_rng, self.output_len)
        contents = iter(range(1, 2 * self.num_prompts + 1))
        prompts = [[(next(contents), int(n))] for n in inputs]
        workload = independent_requests(self.arrivals(arrivals_rng), prompts, outputs,
                                        lambda: next(contents))
        return replace(workload, max_concurrency=self.max_concurrency)
