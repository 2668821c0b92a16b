"""Decode stretches (issue 9): one event per change of the batch gives the step-by-step loop's
results exactly, on every scenario and allocator; the pieces that make that so, one by one."""
import copy
import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engine.clock import Environment
from sim.kvcache.base import decode_rounds_token_by_token
from sim.kvcache.block import BlockAllocator
from sim.latency.model import BatchShape
from sim.metrics import flatten
from sim.run import prepare, run_all
from sim.scheduler import scheduler as scheduler_module
from tests.conftest import compose_config
from tests.helpers import differing, seq

ALLOCATORS = "allocators=[contiguous,contiguous_pow2,contiguous_oracle,paged,prefix,radix]"
CASES = {
    "rag_agents": ["scenario=rag_agents", "scenario.num_sessions=40", "scenario.session_rate_per_s=1.0",
                   "measure.warmup_s=10", "cluster.num_replicas=2", ALLOCATORS],
    "chat": ["scenario=chat", "scenario.num_sessions=40", ALLOCATORS],
    "code_completion": ["scenario=code_completion", "scenario.num_requests=150", ALLOCATORS],
    "doc_qa": ["scenario=doc_qa", "scenario.num_requests=80", ALLOCATORS],
    "sharegpt": ["scenario=sharegpt", "scenario.max_requests=150", ALLOCATORS],
    "long_context": ["scenario=long_context", "scenario.num_requests=6", "allocators=[paged,prefix]"],
    "trace_agentic": ["scenario=trace", "trace.path=sample:agentic", "trace.max_requests=60",
                      "model=llama31_8b", "allocators=[paged,prefix,radix]"],
    "golden_memory_bound": ["+experiment=golden", ALLOCATORS],
    "golden_block_1_lfu": ["+experiment=golden", "block_size=1", "allocators=[paged,prefix]",
                           "+allocator_options.prefix.eviction=lfu"],
    "golden_swap": ["+experiment=golden", "preemption_mode=swap", "allocators=[paged,contiguous]"],
    "golden_unchunked": ["+experiment=golden", "enable_chunked_prefill=false",
                         "max_num_batched_tokens=2048", "allocators=[paged,prefix,radix,contiguous]"],
    "parallel_samples": ["scenario=synthetic", "scenario.num_requests=60", "scenario.n=4",
                         "allocators=[paged,prefix,contiguous_oracle]"],
    "vidur_matched": ["+experiment=vidur_matched", "trace.max_requests=150"],
    # A chunk capped by the budget needs no more blocks when the head's hit shrinks: FIFO and LFU
    # can then free more than they take; only LRU (or a full-sequence reservation) stays blocked.
    "prefix_fifo_lfu_chunk_capped": ["+experiment=golden", "allocators=[prefix,paged]",
                                     "+allocator_options.prefix.eviction=fifo",
                                     "scheduler_reserve_full_isl=false", "max_num_batched_tokens=256"],
    "round_robin_small_batches": ["+experiment=golden", "router=round_robin", "max_num_seqs=4",
                                  "cluster.num_replicas=3", ALLOCATORS],
}


def results(overrides, step_exact):
    cfg = compose_config("run", ["plots=false", "progress=false", "engine=python", *overrides,
                                 f"step_exact={step_exact}"])
    return run_all(cfg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_stretches_give_the_step_by_step_results(case):
    exact, jumped = results(CASES[case], True), results(CASES[case], False)
    for a, b in zip(exact, jumped):
        assert a.metrics["num_finished"] > 0, (case, a.allocator)  # a case that serves nothing compares nothing
        ma, mb = flatten(a.metrics), flatten(b.metrics)
        ma.pop("wall_time_s"), mb.pop("wall_time_s")
        assert not differing(ma, mb), (case, a.allocator, differing(ma, mb))
        pd.testing.assert_frame_equal(a.requests, b.requests)
        pd.testing.assert_frame_equal(a.timeline, b.timeline)


COHORT_CASES = ["rag_agents", "sharegpt", "golden_memory_bound", "golden_block_1_lfu", "golden_swap",
                "golden_unchunked", "parallel_samples", "vidur_matched", "prefix_fifo_lfu_chunk_capped"]


@pytest.mark.parametrize("case", COHORT_CASES)
def test_the_decode_cohort_gives_the_sequence_by_sequence_results(case, monkeypatch):
    """The paged allocators advance leading decoders in arrays (sim.scheduler.cohort); without
    that (as the contiguous and radix allocators run) every number and table is the same."""
    overrides = [o for o in CASES[case] if not o.startswith("allocators=")] + ["allocators=[paged,prefix]"]
    if case == "golden_swap":
        overrides[-1] = "allocators=[paged]"
    monkeypatch.setattr(scheduler_module, "COHORT_MIN_SEQS", 2)  # a cohort wherever one can form
    cohort = results(overrides, False)
    monkeypatch.delattr(BlockAllocator, "decode_cohort")
    plain = results(overrides, False)
    for a, b in zip(cohort, plain):
        ma, mb = flatten(a.metrics), flatten(b.metrics)
        ma.pop("wall_time_s"), mb.pop("wall_time_s")
        assert not differing(ma, mb), (case, a.allocator, differing(ma, mb))
        pd.testing.assert_frame_equal(a.requests, b.requests)
        pd.testing.assert_frame_equal(a.timeline, b.timeline)


def test_a_submit_at_exactly_a_step_end_counts_after_that_step(tmp_path):
    """A subagent's next turn (zero think time) is submitted to the other replica at the very
    instant one of that replica's steps ends; the plain loop sees it one step later."""
    session = {"id": "s0", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 0,
               "system_tokens": 0, "requests": [
                   {"t": 0.0, "type": "n", "in": 640, "out": 100, "hash_ids": list(range(1, 11)),
                    "api_time": 0.0, "think_time": 0.0},
                   {"t": 0.0, "type": "subagent", "requests": [
                       {"t": 0.0, "type": "n", "in": 640, "out": 50,
                        "hash_ids": list(range(100, 110)), "api_time": 0.0, "think_time": 0.0},
                       {"t": 1.0, "type": "n", "in": 1344, "out": 30,
                        "hash_ids": list(range(200, 221)), "api_time": 0.0, "think_time": 0.0}]}]}
    (tmp_path / "trace_0000.json").write_text(json.dumps(session))
    overrides = ["scenario=trace", f"trace.path={tmp_path}", "trace.format=agentic",
                 "router=round_robin", "cluster.num_replicas=2", "allocators=[paged]"]
    [exact], [jumped] = results(overrides, True), results(overrides, False)
    pd.testing.assert_frame_equal(exact.requests, jumped.requests)
    pd.testing.assert_frame_equal(exact.timeline, jumped.timeline)


def test_stretches_take_fewer_events_than_steps():
    """The point of a stretch: the golden run has many decode-only steps per SimPy event."""
    events = {}
    original = Environment.step
    for step_exact in (True, False):
        count = [0]

        def counted(env, count=count):
            count[0] += 1
            return original(env)
        Environment.step = counted
        try:
            [result] = results(["+experiment=golden", "allocators=[paged]"], step_exact)
        finally:
            Environment.step = original
        events[step_exact] = count[0]
        steps = result.metrics["scheduler"]["num_steps"]
    assert events[True] > steps > 2 * events[False]


def test_decode_step_times_are_step_time_bit_for_bit():
    for overrides in (["+experiment=golden"], ["+experiment=vidur_matched"],
                      ["scenario=long_context"]):  # dense GQA, TP 4, MoE with MLA
        latency = prepare(compose_config("run", overrides)).latency
        rng = np.random.default_rng(7)
        for num_seqs in (1, 5, 128):
            contexts = rng.integers(num_seqs, num_seqs * 100_000, 40)
            times = latency.decode_step_times(num_seqs, contexts)
            for context, time_s in zip(contexts.tolist(), times.tolist()):
                shape = BatchShape(num_decode_seqs=num_seqs, decode_context_tokens=context,
                                   num_sampled=num_seqs)
                assert time_s == latency.step_time(shape)


def test_timeout_at_reaches_a_time_no_delay_from_now_reaches():
    """From 1.9891978415246077 no delay lands on 6.991707122581963 (the sum rounds past it);
    the step-by-step loop reached it by smaller additions, so a stretch must too."""
    start, target = 1.9891978415246077, 6.991707122581963
    assert start + (target - start) != target
    env = Environment(initial_time=start)
    env.timeout_at(target)
    env.step()
    assert env.now == target
    with pytest.raises(ValueError):
        env.timeout_at(start - 1)


def _running_batch(caching: bool, block_size: int, prompts, cached_prompt: int, spare: int):
    held = sum(-(-(8 + prompt + 1) // block_size) for prompt in prompts)
    alloc = BlockAllocator(num_blocks=held + spare, block_size=block_size, enable_caching=caching)
    if cached_prompt:  # a finished sequence leaves cached blocks in the free queue
        done = seq(99, [(7, cached_prompt)], output_len=1)
        alloc.allocate(done, cached_prompt)
        alloc.free(done)
    seqs = []
    for index, prompt in enumerate(prompts):
        s = seq(index, [(7, 8), (100 + index, prompt)], output_len=400)
        hit = alloc.lookup_prefix(s)
        assert alloc.allocate(s, s.num_tokens - hit.num_tokens, hit) is not None
        assert alloc.allocate(s, 1) is not None  # the stretch's first step
        seqs.append(s)
    return alloc, seqs


def _state(alloc):
    pool = alloc.pool
    return (alloc.seqs, pool.free_blocks(), pool.num_free, pool.ref_count, pool.block_key,
            pool.cached, pool.num_cached_free, pool.clock, pool.created, pool.hits, pool.last_access,
            alloc.total_reserved, alloc.total_internal)


@settings(max_examples=60, deadline=None)
@given(caching=st.booleans(), block_size=st.sampled_from([1, 2, 4, 16]),
       prompts=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       cached_prompt=st.integers(0, 60), spare=st.integers(0, 12), data=st.data())
def test_block_allocator_decode_stretch_equals_token_by_token(caching, block_size, prompts,
                                                              cached_prompt, spare, data):
    """Same usage rows and the same allocator state, block ids, keys and clocks included, with
    some of the free blocks holding cached KV (evicted as they are taken) and memory running out."""
    spare += -(-cached_prompt // block_size)  # room for the cached sequence while it runs
    alloc, seqs = _running_batch(caching, block_size, prompts, cached_prompt, spare)
    limit = alloc.decode_steps_that_fit(seqs, 200)  # steps 2..limit find blocks
    if limit < 200:  # and step limit + 1 would not
        spare = copy.deepcopy((alloc, seqs))
        with pytest.raises(AssertionError, match="ran out of memory"):
            decode_rounds_token_by_token(spare[0], spare[1], limit, None)
    if limit < 2:
        return
    steps = data.draw(st.integers(1, limit - 1))  # commits steps 1..steps, allocates steps + 1
    twin = copy.deepcopy((alloc, seqs))
    rows = alloc.decode_rounds(seqs, steps)
    assert np.array_equal(rows, decode_rounds_token_by_token(twin[0], twin[1], steps, None))
    assert _state(alloc) == _state(twin[0])
