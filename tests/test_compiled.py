"""The compiled loop (sim.engine.compiled, issue 9) gives the Python engine's results exactly on
every run it covers, says so in metrics.json, and leaves every other run to the Python engine
with the reason said."""
import numpy as np
import pandas as pd
import pytest

from sim.errors import ConfigError
from sim.metrics import flatten
from sim.run import run_all
from tests.conftest import compose_config
from tests.helpers import differing

SHAREGPT = ["scenario=sharegpt", "scenario.max_requests=300", "scenario.arrival_rate_rps=9.6",
            "cluster.num_replicas=3"]
# The golden experiment's pool (3,072 slots) under sharegpt's lengths: preemptions galore.
TIGHT = ["gpu=a100_80g", "model=llama3_8b", "tensor_parallel_size=1", "max_model_len=2048",
         "kv_cache_memory_bytes=402653184", "max_num_batched_tokens=1024"]
CASES = {
    "vidur_matched": ["+experiment=vidur_matched", "trace.max_requests=300"],
    "least_loaded_requests": SHAREGPT,
    "least_loaded_waiting": [*SHAREGPT, "router.metric=waiting"],
    "least_loaded_queued_tokens": [*SHAREGPT, "router.metric=queued_tokens"],
    "round_robin": [*SHAREGPT, "router=round_robin"],
    "preemptions": [*SHAREGPT, *TIGHT, "scenario.arrival_rate_rps=30"],
    "preemptions_unchunked": [*SHAREGPT, *TIGHT, "scenario.arrival_rate_rps=30", "enable_chunked_prefill=false",
                              "max_num_batched_tokens=2048"],
    "first_chunk_admits_with_watermark": [*SHAREGPT, *TIGHT, "scenario.arrival_rate_rps=30",
                                          "scheduler_reserve_full_isl=false", "watermark=0.05"],
    "eager_fp8_tp1_no_overhead": [*SHAREGPT, "enforce_eager=true", "quantization=fp8", "tensor_parallel_size=1",
                                  "model=llama31_8b", "serving_overhead_s=0", "async_output_processing=false"],
    "async_scheduling_bench": ["scenario=bench", "model=llama31_8b", "gpu=h100", "tensor_parallel_size=1",
                               "scenario.num_prompts=200", "scenario.input_len=512", "scenario.output_len=64",
                               "max_num_seqs=64", "async_scheduling=true"],
    # The host's step (Sarathi-Serve's per-sequence prior) outlasting a B200's GPU time at large batches.
    "async_scheduling_host_bound": ["scenario=bench", "model=llama31_8b", "gpu=b200", "tensor_parallel_size=1",
                                    "scenario.num_prompts=1200", "scenario.input_len=128", "scenario.output_len=32",
                                    "max_num_seqs=1024", "async_scheduling=true", "kv_cache_memory_bytes=null"],
    "bench_all_at_once": ["scenario=bench", "model=llama31_8b", "gpu=h100", "tensor_parallel_size=1",
                          "scenario.num_prompts=200", "scenario.input_len=512", "scenario.output_len=64",
                          "max_num_seqs=64"],
    "rejected_prompts_pp2": ["+experiment=vidur_matched", "trace.max_requests=300", "max_model_len=1024",
                             "max_num_seqs=16"],
    # Sessions: later turns sent a think time after their previous turn finishes (or is rejected).
    "rag_agents_sessions": ["scenario=rag_agents", "scenario.num_sessions=120", "measure.warmup_s=10"],
    "chat_sessions_rejected_turns": ["scenario=chat", "scenario.num_sessions=60", "max_model_len=3000"],
    "agentic_chains": ["scenario=trace", "trace.path=sample:agentic", "trace.max_requests=80",
                       "model=llama31_8b", "cluster.num_replicas=2"],
    # Repeated traces, streamed: the loop tiles one copy's rows (sim.engine.compiled.rows).
    "repeated_trace": [*SHAREGPT, "scenario.max_requests=100", "+scenario.repeat=3"],
    "repeated_agentic_chains": ["scenario=trace", "trace.path=sample:agentic", "trace.max_requests=40",
                                "trace.repeat=3", "model=llama31_8b", "cluster.num_replicas=2"],
    # The golden run: a memory-bound rag_agents whose prefix cache evicts and revives blocks.
    "golden": ["+experiment=golden"],
    "golden_block_1": ["+experiment=golden", "block_size=1"],
    "golden_block_256": ["+experiment=golden", "block_size=256"],  # a chain per block or two
    "golden_first_chunk_admits": ["+experiment=golden", "scheduler_reserve_full_isl=false",
                                  "max_num_batched_tokens=256"],
    "golden_unchunked": ["+experiment=golden", "enable_chunked_prefill=false", "max_num_batched_tokens=2048"],
}


def run(overrides, engine, allocator="paged"):
    cfg = compose_config("run", ["plots=false", "progress=false", f"allocators=[{allocator}]", *overrides,
                                 f"engine={engine}"])
    [result] = run_all(cfg)
    return result


@pytest.mark.parametrize("allocator", ["paged", "prefix"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_compiled_loop_gives_the_python_engines_results(case, allocator):
    python, compiled = run(CASES[case], "python", allocator), run(CASES[case], "compiled", allocator)
    assert python.metrics.pop("engine") == {"loop": "python", "why": "engine=python"}
    engine = compiled.metrics.pop("engine")
    assert engine["loop"] == "compiled" and engine["num_events"] >= compiled.metrics["scheduler"]["num_steps"]
    assert python.metrics["num_finished"] > 0, case  # a case that serves nothing compares nothing
    mp, mc = flatten(python.metrics), flatten(compiled.metrics)
    mp.pop("wall_time_s"), mc.pop("wall_time_s")
    assert not differing(mp, mc), (case, differing(mp, mc))
    pd.testing.assert_frame_equal(python.requests, compiled.requests)
    pd.testing.assert_frame_equal(python.timeline, compiled.timeline)


def test_guaranteed_no_evict_gives_the_python_engines_results_without_a_preemption():
    """TensorRT-LLM's capacity policy in both loops, on the load that preempts under vLLM's."""
    overrides = [*CASES["preemptions"], "capacity_scheduler_policy=guaranteed_no_evict"]
    python, compiled = run(overrides, "python"), run(overrides, "compiled")
    mp, mc = flatten(python.metrics), flatten(compiled.metrics)
    for m in (mp, mc):
        m.pop("wall_time_s"), [m.pop(k) for k in list(m) if k.startswith("engine")]
    assert not differing(mp, mc), differing(mp, mc)
    pd.testing.assert_frame_equal(python.requests, compiled.requests)
    pd.testing.assert_frame_equal(python.timeline, compiled.timeline)
    assert compiled.requests.num_preemptions.sum() == 0
    preempting = run(CASES["preemptions"], "compiled").requests  # the same requests served, later
    assert preempting.num_preemptions.sum() > 10
    assert (compiled.requests.status == preempting.status).all()


def test_a_store_compacted_at_every_turn_keeps_the_results(monkeypatch):
    """The prefix cache's block store at its smallest safe size (compacted whenever it fills,
    extents moving and shrinking) gives the Python engine's results on the evicting golden run
    and under preemptions; a store too small for the running sequences is a clear error."""
    from sim.engine.compiled import driver

    monkeypatch.setattr(driver, "STORE_ROOMS", 1)
    for case in ("golden_block_1", "preemptions"):
        python, compiled = run(CASES[case], "python", "prefix"), run(CASES[case], "compiled", "prefix")
        pd.testing.assert_frame_equal(python.requests, compiled.requests)
        pd.testing.assert_frame_equal(python.timeline, compiled.timeline)
    monkeypatch.setattr(driver, "STORE_ROOMS", 0)
    with pytest.raises(RuntimeError, match="block store is full; run with engine=python"):
        run(CASES["golden_block_1"], "compiled", "prefix")


def test_the_cases_exercise_what_they_name():
    """Preemptions happen, prompts are rejected, several replicas serve: else the equality above
    would check little."""
    preempted = run(CASES["preemptions"], "compiled")
    assert preempted.requests.num_preemptions.sum() > 10
    rejected = run(CASES["rejected_prompts_pp2"], "compiled")
    assert (rejected.requests.status == "rejected").sum() > 0
    assert (rejected.requests.status == "finished").sum() > 100
    spread = run(CASES["least_loaded_requests"], "compiled").requests.replica.value_counts()
    assert len(spread) == 3 and spread.min() > 50
    golden = run(CASES["golden"], "compiled", "prefix")
    assert golden.requests.prefix_hit_tokens.sum() > 0 and golden.timeline.cached_idle.max() > 0
    chat = run(CASES["chat_sessions_rejected_turns"], "compiled").requests
    assert (chat.status == "rejected").sum() > 0 and (chat[chat.status == "finished"].turn > 0).sum() > 50
    assert run(CASES["agentic_chains"], "compiled").requests.session_id.duplicated().sum() > 20


@pytest.mark.parametrize("overrides, reason", [
    (["allocators=[contiguous]"], "paged and prefix allocators"),
    (["allocators=[radix]"], "paged and prefix allocators"),
    (["allocators=[prefix]", "+allocator_options.prefix.eviction=lfu"], "LRU eviction"),
    (["allocators=[prefix]", "kv_offload.cpu_gib=1"], "KV tiers"),
    (["scenario=synthetic", "scenario.num_requests=20", "scenario.n=4"], "requests of one sample"),
    (["scenario=chat", "scenario.num_sessions=5", "serving_overhead_s=0", "scenario.think_time_s_mean=0"],
     "zero think times only with a serving overhead"),
    (["preemption_mode=swap"], "preemption_mode=recompute"),
    (["queue_order=priority"], "queue_order=fcfs"),
    (["router=prefix_aware"], "router=least_loaded"),
    (["cluster.router_staleness_s=0.5"], "live loads"),
    (["model=deepseek_v3", "tensor_parallel_size=8", "gpu=h200"], "one full-attention kind"),
    (["pipeline_parallel_size=4"], "pipeline_parallel_size up to 2"),
    (["step_exact=true"], "step_exact=true keeps the plain loop"),
])
def test_other_runs_take_the_python_engine_and_say_why(overrides, reason):
    base = ["cluster.num_replicas=2"]
    allocator = next((o for o in overrides if o.startswith("allocators=")), "allocators=[paged]")
    if not any(o.startswith("scenario=") for o in overrides):
        base += ["scenario=sharegpt", "scenario.max_requests=20"]
    cfg = compose_config("run", ["plots=false", "progress=false", allocator, *base, *overrides])
    [result] = run_all(cfg)
    assert result.metrics["engine"]["loop"] == "python"
    assert reason in result.metrics["engine"]["why"]
    with pytest.raises(ConfigError, match="engine=compiled does not cover this run"):
        run_all(compose_config("run", ["plots=false", "progress=false", allocator, *base, *overrides,
                                       "engine=compiled"]))


def test_the_step_clock_is_the_latency_models_bit_for_bit():
    """core.step_time on random shapes of a TP 2 x PP 2 model with graph capture sizes, eager
    launches and MoE-free GEMM tables equals sum(LatencyModel.breakdown(shape).values())."""
    from sim.engine.compiled import core
    from sim.engine.compiled.driver import _parameters
    from sim.engine.compiled.tables import latency_tables
    from sim.kvcache.block import BlockAllocator
    from sim.latency.model import BatchShape
    from sim.router.round_robin import RoundRobin
    from sim.run import prepare

    for overrides in (["+experiment=vidur_matched"], ["+experiment=vidur_matched", "async_output_processing=true",
                                                      "pipeline_parallel_size=1"]):
        setup = prepare(compose_config("run", overrides))
        spec, latency = setup.spec, setup.latency
        ints, floats = _parameters(setup, BlockAllocator(10, 16), RoundRobin())
        tables = latency_tables(latency, spec.max_num_batched_tokens, spec.max_num_seqs)
        rng = np.random.default_rng(3)
        for _ in range(300):
            decode_seqs = int(rng.integers(0, 60))
            chunks = int(rng.integers(0, 3)) if decode_seqs else int(rng.integers(1, 3))
            new = [int(rng.integers(1, 200)) for _ in range(chunks)]
            cached = [int(rng.integers(0, 3000)) for _ in range(chunks)]
            shape = BatchShape(sum(new), chunks, sum(q * c for q, c in zip(new, cached)),
                               sum(q * (q + 1) // 2 for q in new), sum(q + c for q, c in zip(new, cached)),
                               decode_seqs, decode_seqs * int(rng.integers(1, 4000)),
                               decode_seqs + int(rng.integers(0, chunks + 1)))
            row = np.array([shape.num_prefill_tokens, shape.num_prefill_seqs, shape.prefill_context_pairs,
                            shape.prefill_causal_pairs, shape.prefill_kv_tokens, shape.num_decode_seqs,
                            shape.decode_context_tokens, shape.num_sampled], dtype=np.int64)
            assert core.step_time(ints, floats, row, *tables) == latency.step_time(shape), shape


@pytest.mark.parametrize("fmt, path", [("length_stats", "sample:sharegpt"), ("agentic", "sample:agentic"),
                                       ("mooncake", "sample:mooncake")])
def test_a_repeated_traces_rows_are_its_copies_rows(fmt, path):
    """The rows tiled from one copy of a streamed repeat equal the rows read from every copy built
    as objects (ids, prefix ids, content ids, next turns, arrivals)."""
    from dataclasses import fields

    from sim.engine.compiled.rows import request_rows
    from sim.workload.request import RepeatedSessions
    from sim.workload.trace import TraceSpec, build_workload
    spec = TraceSpec(path=path, format=fmt, repeat=3, max_requests=60)
    workload = build_workload(spec, 0)
    assert isinstance(workload.sessions, RepeatedSessions)
    streamed = request_rows(workload, with_keys=True)
    built = request_rows(build_workload(spec, 0, stream=False), with_keys=True)
    one_copy = request_rows(build_workload(TraceSpec(path=path, format=fmt, max_requests=60), 0), with_keys=True)
    assert len(streamed) == 3 * len(one_copy)
    for rows, built_rows in ((streamed, built), (streamed.keys, built.keys)):
        for field in fields(rows):
            if field.name != "keys":
                assert np.array_equal(getattr(rows, field.name), getattr(built_rows, field.name)), field.name
    assert request_rows(workload, with_keys=False).keys is None


def _segment_rows_match_requests(workload):
    """Asserts that each request's segment rows (through first_segment and num_segments) are its
    own prompt's starts, content ids and prefix ids; returns the rows read and the segments held."""
    from sim.engine.compiled.rows import request_rows
    keys = request_rows(workload, with_keys=True).keys
    requests = [r for session in workload.in_arrival_order() for r in session.turns]
    for i, request in enumerate(requests):
        first, count = keys.first_segment[i], keys.num_segments[i]
        own = keys.segments[first:first + count]
        assert own[:, 0].tolist() == list(request.segment_starts), i
        assert own[:, 1].tolist() == [content for content, _ in request.segments], i
        assert own[:, 2].tolist() == list(request.prefix_ids[:-1]), i
        assert keys.prompt_prefix[i] == request.prefix_ids[-1], i
        assert keys.output_content[i] == request.output_content_id, i
    return len(keys.segments), sum(len(r.segments) for r in requests)


def test_a_turn_reads_its_next_turns_segment_rows_only_when_its_prompt_starts_that_prompt():
    """rows._read_keys shares a turn's segment rows with a later turn's only where its prompt is
    that turn's first segments: a session whose third turn starts afresh, one whose second turn
    drops the first's last segment, and one whose turns grow (rows shared)."""
    from sim.workload.request import PrefixInterner, Session, Workload, make_request
    interner, sessions, ids = PrefixInterner(), [], iter(range(100))
    prompts = {0: [[(1, 100)], [(1, 100), (2, 50)], [(3, 30)], [(3, 30), (4, 10)]],
               1: [[(1, 100), (2, 50)], [(1, 100)], [(1, 100), (5, 7)]],
               2: [[(6, 20)], [(6, 20), (7, 20)], [(6, 20), (7, 20), (8, 20)]]}
    for session_id, turns in prompts.items():
        requests = tuple(make_request(interner, next(ids), segments, 5, 1000 + next(ids), session_id=session_id,
                                      turn=turn) for turn, segments in enumerate(turns))
        sessions.append(Session(session_id, float(session_id), requests))
    # Read from each request's tuples, and from the interner's tree by whole-prompt ids.
    for tree in (None, interner.tree):
        held, in_prompts = _segment_rows_match_requests(Workload(tuple(sessions), prefix_tree=tree))
        assert in_prompts == 17
        assert held == 4 + 4 + 3  # each run of growing turns holds its last turn's rows


@pytest.mark.parametrize("scenario", ["rag_agents", "chat"])
def test_each_requests_segment_rows_are_its_own_prompts(scenario):
    """Scenarios whose turns grow hold each session's rows about once, every request finding its
    own, read from the interner's tree or from the requests' tuples alike."""
    from dataclasses import replace

    from sim.run import build_workload
    workload = build_workload(compose_config("run", [f"scenario={scenario}"]), 0)
    for tree in (workload.prefix_tree, None):
        held, in_prompts = _segment_rows_match_requests(replace(workload, prefix_tree=tree))
        assert held < in_prompts / 2


def _tree_only(monkeypatch):
    """Reading keys from the requests' tuples fails from here on."""
    from sim.engine.compiled import rows

    def refused(*args):
        raise AssertionError("keys read from the requests' tuples, not the interner's tree")
    monkeypatch.setattr(rows, "_keys_from_tuples", refused)


@pytest.mark.parametrize("overrides", [["scenario=rag_agents"], ["scenario=chat"], ["scenario=sharegpt"],
                                       ["scenario=trace", "trace.path=sample:agentic"],
                                       ["scenario=trace", "trace.path=sample:mooncake", "trace.repeat=2"]])
def test_every_workload_builder_hands_its_interner_over(overrides, monkeypatch):
    """Each builder's workload carries the interner of its prefix ids (Workload.prefix_tree), so
    that a prefix cache's run reads its keys from the tree: right, and without the Python work
    per segment."""
    from sim.run import build_workload
    workload = build_workload(compose_config("run", overrides), 0)
    _tree_only(monkeypatch)
    _segment_rows_match_requests(workload)


def test_truncated_prompts_are_read_with_their_new_interner(monkeypatch):
    """trace.on_overlength=truncate rebuilds the requests with an interner of its own, which the
    workload then carries (the old one's ids no longer name their prefixes)."""
    from sim.workload.overlength import truncate_overlength
    from sim.workload.trace import TraceSpec, build_workload
    workload = build_workload(TraceSpec(path="sample:mooncake", format="mooncake", max_requests=40), 0)
    truncated = truncate_overlength(workload, 2048)
    assert truncated.num_truncated_prompts > 0 and truncated.prefix_tree is not workload.prefix_tree
    _tree_only(monkeypatch)
    _segment_rows_match_requests(truncated)


def test_an_interner_that_did_not_make_the_requests_is_not_read(monkeypatch):
    """The tree of another workload's interner (another seed of the same scenario: the same
    kinds of prompts, other ids) are found not to match, and the keys come from the requests."""
    from dataclasses import replace

    from sim.engine.compiled import rows
    from sim.run import build_workload
    cfg = compose_config("run", ["scenario=rag_agents"])
    workload, other = build_workload(cfg, 0), build_workload(cfg, 1)
    read = []
    tuples = rows._keys_from_tuples
    monkeypatch.setattr(rows, "_keys_from_tuples", lambda *args: read.append(1) or tuples(*args))
    _segment_rows_match_requests(replace(workload, prefix_tree=other.prefix_tree))
    assert read == [1]


def test_a_tree_of_prompts_of_the_same_shapes_but_other_contents_is_not_read(monkeypatch):
    """Every request's segment count and tokens agree with the foreign tree (the first checks of
    PrefixTable.made pass), its contents and parents do not: the sampled read-back refuses
    it, and a workload with a tree still hashes and compares by its sessions."""
    from dataclasses import replace

    from sim.engine.compiled import rows
    from sim.workload.request import independent_requests

    def workload(first, second, third):
        contents = iter(range(100, 200)).__next__
        return independent_requests([0.0, 1.0, 2.0], [[(first, 32)], [(second, 32)], [(third, 32), (first + 2, 32)]],
                                    [4, 4, 4], contents)
    own, foreign = workload(20, 21, 21), workload(10, 11, 10)
    read = []
    tuples = rows._keys_from_tuples
    monkeypatch.setattr(rows, "_keys_from_tuples", lambda *args: read.append(1) or tuples(*args))
    _segment_rows_match_requests(replace(own, prefix_tree=foreign.prefix_tree))
    assert read == [1]
    _segment_rows_match_requests(own)
    assert read == [1]  # its own tree is read
    assert hash(own) == hash(replace(own, prefix_tree=None)) and own == replace(own, prefix_tree=None)


def test_the_interners_own_requests_are_read_from_its_columns_in_any_order_and_a_rebuilt_one_is_not(monkeypatch):
    """The interner keeps the requests it made (make_request) with their whole prompt ids and
    output content ids: the keys are read from those columns whether the requests reach the
    engine in the order made or not; a request not made by it (another interner's, or one of
    its own rebuilt with another output content, the same tokens) sends the read to the tuples."""
    from dataclasses import replace

    from sim.engine.compiled import rows
    from sim.workload.request import PrefixInterner, Session, Workload, make_request
    interner = PrefixInterner()
    made = [make_request(interner, request_id, [(1, 64), (10 + request_id, 16)], 4, 1000 + request_id)
            for request_id in [7, 3, 5, *range(10, 600)]]  # more than a sample of them
    read = []
    tuples = rows._keys_from_tuples
    monkeypatch.setattr(rows, "_keys_from_tuples", lambda *args: read.append(1) or tuples(*args))

    def workload(requests):  # one session per request, arriving in the order given
        return Workload(tuple(Session(r.request_id, float(i), (r,)) for i, r in enumerate(requests)),
                        prefix_tree=interner.tree)
    _segment_rows_match_requests(workload(made))
    _segment_rows_match_requests(workload(made[::-1]))
    _segment_rows_match_requests(workload(made[1:]))
    assert read == []
    other = make_request(PrefixInterner(), 9, [(1, 64)], 4, 200)
    _segment_rows_match_requests(workload([*made, other]))
    assert read == [1]
    _segment_rows_match_requests(workload([made[0], replace(made[1], output_content_id=300), *made[2:]]))
    assert read == [1, 1]


def test_the_pool_takes_small_pages_and_gives_numpy_its_setting_back():
    """The pool's arrays are allocated with numpy's huge-page advice off (driver._small_pages);
    numpy's own setting is restored after, whichever it was."""
    from sim.engine.compiled import driver
    advise = driver._set_hugepage_advice
    first = advise(True)
    try:
        for setting in (True, False):
            advise(setting)
            with driver._small_pages():
                assert advise(False) is False  # off inside
            pool = driver._pool_arrays(2, 8, 2, 64, 4, np.zeros((0, 3), dtype=np.int64))
            assert advise(setting) is setting  # restored after
            assert all(not array.any() for array in pool[1:5])  # zeroed, as the loop expects
    finally:
        advise(first)
