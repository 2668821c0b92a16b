"""The busiest GPU of an expert-parallel MoE layer. Under EP each GPU runs the tokens routed to
its own experts, and a layer waits for the GPU that got the most: with no expert load balancer
(vLLM's, SGLang's and TensorRT-LLM's default) some experts are far more popular than others.

The popularity is one number, the coefficient of variation of the experts' shares of the routed
tokens (EXPERT_TOKENS_CV; measured at large batches, where the counts' own sampling noise is
small: it is added here). A GPU's routed token copies are the sum over its n = E / EP experts of
Poisson counts around lognormal popularities: their CV is sqrt((cv^2 + 1 / lambda) / n) for
lambda copies per expert on average, and the sum is taken as lognormal (Fenton-Wilkinson: the
same mean and variance), so the busiest of EP GPUs holds the mean times E[max of EP lognormals]
/ mean, computed over the distribution of the largest of EP standard normals. The experts a GPU
touches (those with at least one token; what a small batch's step reads) are a sum of n
Bernoulli trials (over ceil(E / EP) experts: a GPU may hold one more than the mean): the
busiest holds the mean plus E[max of EP standard normals] standard deviations, at most its
experts and its token copies. No expert gets more copies than the step has tokens, so the
busiest GPU's copies are at most its touched experts times the tokens.

Checked against the source of the default (tests/test_expert_load.py): with TensorRT-LLM's
per-expert CV of 1.28 at 128 tokens per expert, the model gives the busiest of 32 GPUs holding
8 experts each 2.28x the mean (TensorRT-LLM measured 2.56x) and the busiest of 256 experts
10.9x (measured 11.9x): about a tenth short of both, as a lognormal's tail is of a real one.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

# TensorRT-LLM tech blog 4 ("Scaling Expert Parallelism in TensorRT-LLM", Table 1; the same figures
# in examples/ep_load_balancer/README.md): DeepSeek-R1 on a machine-translation dataset, EP 32
# with 8 experts per GPU and no load balancer, averaged over layers and iterations: an expert
# slot gets 128 routed tokens on average with a standard deviation of 164.1, a GPU 1,024 with 491.6;
# the hottest GPU 1.564 more than the mean ((max - mean) / mean), the hottest expert 10.948 more.
EXPERT_TOKENS_CV = 1.282  # 164.1 / 128
MAX_EXPERT_TOKENS_CV = 10.0  # beyond it the lognormal's tail leaves the integration grid
TRTLLM_EP32_BUSIEST_GPU_OVER_MEAN = 1 + 1.564
TRTLLM_EP32_BUSIEST_EXPERT_OVER_MEAN = 1 + 10.948

_GRID = np.linspace(-9.0, 9.0, 3601)  # standard-normal values the largest of n is integrated over


@lru_cache(maxsize=None)
def _largest_of_normals(count: int) -> np.ndarray:
    """Weights over _GRID of the distribution of the largest of `count` standard normals."""
    cdf = 0.5 * (1.0 + np.array([math.erf(z / math.sqrt(2.0)) for z in _GRID]))
    density = count * np.exp(-0.5 * _GRID ** 2) / math.sqrt(2 * math.pi) * cdf ** (count - 1)
    return density / density.sum()


@lru_cache(maxsize=None)
def expected_largest_normal(count: int) -> float:
    """E[max of `count` independent standard normals] (0 for one)."""
    return 0.0 if count <= 1 else float(_largest_of_normals(count) @ _GRID)


def busiest_over_mean(cv: float, count: int) -> float:
    """E[max of `count` independent lognormals of coefficient of variation cv] / their mean."""
    if count <= 1 or cv <= 0:
        return 1.0
    sigma = math.sqrt(math.log1p(cv * cv))
    return float(_largest_of_normals(count) @ np.exp(sigma * _GRID - 0.5 * sigma * sigma))


def busiest_gpu(tokens: float, top_k: int, touched: float, num_experts: int, num_gpus: int,
                cv: float) -> tuple[float, float]:
    """(experts touched, token copies) on the busiest of num_gpus GPUs holding num_experts / num_gpus
    experts each, when `tokens` tokens routed to top_k experts each touch `touched` experts in
    all; cv 0: the means, every GPU alike (a perfect load balancer)."""
    copies = tokens * top_k
    if num_gpus <= 1 or copies <= 0 or cv <= 0:
        return touched / max(num_gpus, 1), copies / max(num_gpus, 1)
    per_gpu = num_experts / num_gpus
    gpu_cv = math.sqrt((cv * cv + num_experts / copies) / per_gpu)
    held, share = math.ceil(per_gpu - 1e-9), touched / num_experts  # the most experts a GPU holds
    spread = math.sqrt(held * share * (1.0 - share))
    busiest_touched = max(touched / num_gpus,
                          min(held, held * share + expected_largest_normal(num_gpus) * spread))
    busiest_copies = copies / num_gpus * busiest_over_mean(gpu_cv, num_gpus)
    busiest_copies = max(copies / num_gpus, min(busiest_copies, busiest_touched * tokens, copies))
    return min(busiest_touched, busiest_copies), busiest_copies
