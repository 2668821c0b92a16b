"""The busiest expert-parallel GPU (sim.latency.expert_load), checked against TensorRT-LLM's
published load figures, closed forms and a Monte Carlo of the process it stands for."""
import math

import numpy as np
import pytest

from sim.latency.expert_load import (EXPERT_TOKENS_CV, TRTLLM_EP32_BUSIEST_EXPERT_OVER_MEAN,
                                     TRTLLM_EP32_BUSIEST_GPU_OVER_MEAN, busiest_gpu, busiest_over_mean,
                                     expected_largest_normal)


def test_the_largest_of_normals_matches_its_closed_forms():
    assert expected_largest_normal(1) == 0.0
    assert expected_largest_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_largest_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)


def test_tensorrt_llms_ep32_imbalance_is_reproduced_within_a_seventh_from_the_per_expert_spread():
    """TensorRT-LLM tech blog 4, Table 1 (DeepSeek-R1, EP 32, 8 experts per GPU, no balancer): the
    per-expert spread (std 164.1 over mean 128, the default) gives the busiest GPU and the busiest
    expert over the mean; the table measured 2.564 and 11.948. The model is short of both (a
    lognormal's tail is lighter than the measured one) by about a tenth."""
    tokens = 32 * 1024 // 8  # 1,024 routed token copies per GPU on average, as the table's (top 8)
    _, busiest = busiest_gpu(tokens, 8, 256, 256, 32, EXPERT_TOKENS_CV)
    gpu_ratio = busiest / 1024
    expert_ratio = busiest_over_mean(math.sqrt(EXPERT_TOKENS_CV ** 2 + 1 / 128), 256)
    assert gpu_ratio == pytest.approx(TRTLLM_EP32_BUSIEST_GPU_OVER_MEAN, rel=0.15)
    assert expert_ratio == pytest.approx(TRTLLM_EP32_BUSIEST_EXPERT_OVER_MEAN, rel=0.15)
    assert gpu_ratio < TRTLLM_EP32_BUSIEST_GPU_OVER_MEAN and expert_ratio < TRTLLM_EP32_BUSIEST_EXPERT_OVER_MEAN


def monte_carlo_busiest(tokens, num_experts, top_k, num_gpus, cv, trials=400, seed=0):
    """Tokens choose top_k distinct experts by lognormal popularities drawn afresh each trial;
    the mean over trials of the busiest GPU's touched experts and token copies."""
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(math.log1p(cv * cv))
    per_gpu = num_experts // num_gpus
    touched, copies = [], []
    for _ in range(trials):
        weights = rng.lognormal(-sigma * sigma / 2, sigma, num_experts)
        # top_k distinct experts per token, drawn by weight (Gumbel top-k)
        keys = np.log(weights)[None, :] + rng.gumbel(size=(tokens, num_experts))
        chosen = np.argpartition(-keys, top_k, axis=1)[:, :top_k]
        counts = np.bincount(chosen.ravel(), minlength=num_experts).reshape(num_gpus, per_gpu)
        touched.append((counts > 0).sum(1).max())
        copies.append(counts.sum(1).max())
    return float(np.mean(touched)), float(np.mean(copies))


@pytest.mark.parametrize("tokens", [1, 16, 512])
def test_the_busiest_gpu_agrees_with_a_monte_carlo_of_top8_routing_over_ep8(tokens):
    """256 experts (DeepSeek-V3's), top 8, over 8 GPUs: the closed form against a simulation of
    the routing it stands for (without DeepSeek's limit of 4 expert groups a token), from one
    token (weight-bound: experts touched) to 512 (token copies), within a fifth."""
    touched_total = 256 * (1 - (1 - 8 / 256) ** tokens)
    touched, copies = busiest_gpu(tokens, 8, touched_total, 256, 8, EXPERT_TOKENS_CV)
    simulated_touched, simulated_copies = monte_carlo_busiest(tokens, 256, 8, 8, EXPERT_TOKENS_CV)
    assert copies == pytest.approx(simulated_copies, rel=0.2)
    if tokens < 512:  # (at 512 the mean's expected touched experts, uniform, exceed the skewed draw's)
        assert touched == pytest.approx(simulated_touched, rel=0.2)


def test_the_busiest_share_grows_with_gpus_and_spread_and_falls_with_batch():
    def share(tokens, gpus, cv=EXPERT_TOKENS_CV):
        return busiest_gpu(tokens, 8, 256, 256, gpus, cv)[1] / (tokens * 8 / gpus)
    assert share(4096, 4) < share(4096, 8) < share(4096, 32)
    assert share(4096, 8, 0.5) < share(4096, 8)
    assert share(64, 8) > share(4096, 8) > share(65536, 8) > 1.0
    assert busiest_gpu(100, 8, 100, 256, 8, 0.0) == (100 / 8, 800 / 8)  # cv 0: every GPU the mean
    assert busiest_gpu(100, 8, 100, 256, 1, EXPERT_TOKENS_CV) == (100, 800)  # one GPU holds them all


def test_the_busiest_gpu_stays_within_what_its_experts_and_the_tokens_allow():
    """At most ceil(E / EP) experts (a GPU may hold one more than the mean), at most as many
    copies as its touched experts times the tokens (a token picks an expert once), never below
    the mean, and bounded at the largest spread allowed."""
    from sim.latency.expert_load import MAX_EXPERT_TOKENS_CV
    touched, copies = busiest_gpu(1, 8, 8, 256, 8, EXPERT_TOKENS_CV)
    assert copies == touched < 3  # one token: one copy per touched expert
    touched, copies = busiest_gpu(4096, 1, 16, 16, 3, EXPERT_TOKENS_CV)  # Scout's 16 experts on 3 GPUs
    assert touched == 6 and 4096 / 3 < copies <= 6 * 4096
    for cv in (0.01, 1.0, MAX_EXPERT_TOKENS_CV):
        for tokens in (1, 64, 8192):
            touched, copies = busiest_gpu(tokens, 8, 256 * (1 - (1 - 8 / 256) ** tokens), 256, 8, cv)
            assert tokens * 8 / 8 <= copies <= tokens * 8 and copies <= touched * tokens
    assert busiest_over_mean(MAX_EXPERT_TOKENS_CV, 8) < 8  # the grid still holds the tail


def test_a_run_says_the_busiest_gpus_share_and_that_the_spread_does_nothing_without_ep(tmp_path):
    """The command line: an expert-parallel run notes what its busiest GPU does beyond the mean,
    with the spread given (0: the mean); a spread set where no GPU holds whole experts is an
    unread key, and one outside 0-10 an error, each one line."""
    from tests.test_cli import assert_one_line_error, sim
    small = ["scenario=bench", "scenario.num_prompts=4", "scenario.input_len=64", "scenario.output_len=4",
             "model=deepseek_v3", "gpu=h200", "tensor_parallel_size=8", "allocators=[paged]", "plots=false"]
    ep = sim(tmp_path, "run", *small, "enable_expert_parallel=true", "hydra.run.dir=ep")
    assert ep.returncode == 0
    assert ("note: expert parallelism over 8 GPUs: each MoE layer waits for its busiest GPU, which touches "
            "2.40 experts where the mean is 1.00 at 1 token a step, and gets 1.35x the mean routed tokens at 8,192 "
            "(expert_tokens_cv=1.282") in ep.stderr
    flat = sim(tmp_path, "run", *small, "enable_expert_parallel=true", "expert_tokens_cv=0", "hydra.run.dir=flat")
    assert flat.returncode == 0
    assert "touches 1.00 experts where the mean is 1.00 at 1 token a step, and gets 1.00x" in flat.stderr
    assert_one_line_error(sim(tmp_path, "run", *small, "expert_tokens_cv=0.5"),
                          "expert_tokens_cv is not read: enable_expert_parallel is false")
    for value in ("-0.5", "inf", "nan"):
        assert_one_line_error(sim(tmp_path, "run", *small, "enable_expert_parallel=true", f"expert_tokens_cv={value}"),
                              "is outside 0-10")
