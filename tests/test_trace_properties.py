"""Generated traces round-trip through writers and readers; fuzzed input never escapes as a
traceback; prefix identity survives the mapping onto simulated blocks; trace-stats agrees with an
independent computation on the shipped samples."""
import json
import random
import string
import tempfile
from pathlib import Path
from importlib import resources

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.workload import agentic, azure, burstgpt, length_stats, mooncake
from sim.workload.records import TraceError, TraceRequest
from sim.workload.stats import trace_stats
from sim.workload.trace import TraceSpec, build_workload, read_requests

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
lengths = st.integers(1, 5000)


@st.composite
def timed_requests(draw, with_hashes):
    count = draw(st.integers(1, 12))
    gaps = draw(st.lists(st.integers(0, 5000), min_size=count, max_size=count))
    requests, t = [], 0
    for gap in gaps:
        t += gap
        input_len, output_len = draw(lengths), draw(st.integers(1, 2000))
        ids = tuple(draw(st.lists(st.integers(0, 50), min_size=-(-input_len // 512),
                                  max_size=-(-input_len // 512)))) if with_hashes else ()
        requests.append(TraceRequest(t / 1000.0, input_len, output_len, ids))
    return requests


def same(a, b, with_hashes):
    assert [(r.input_len, r.output_len) for r in a] == [(r.input_len, r.output_len) for r in b]
    assert np.allclose([r.arrival_s - a[0].arrival_s for r in a], [r.arrival_s - b[0].arrival_s for r in b], atol=1e-6)
    if with_hashes:
        assert [r.hash_ids for r in a] == [r.hash_ids for r in b]


@SETTINGS
@given(requests=timed_requests(with_hashes=True))
def test_mooncake_round_trip(tmp_path, requests):
    mooncake.write(requests, tmp_path / "m.jsonl")
    same(requests, read_requests(TraceSpec(path=str(tmp_path / "m.jsonl"), format="mooncake"))[1], True)


@SETTINGS
@given(requests=timed_requests(with_hashes=False))
def test_azure_round_trip(tmp_path, requests):
    azure.write(requests, tmp_path / "a.csv")
    same(requests, read_requests(TraceSpec(path=str(tmp_path / "a.csv"), format="azure"))[1], False)


@SETTINGS
@given(requests=timed_requests(with_hashes=False), failed=st.integers(0, 3))
def test_burstgpt_round_trip(tmp_path, requests, failed):
    burstgpt.write(requests, tmp_path / "b.csv", failed_rows=failed)
    spec = TraceSpec(path=str(tmp_path / "b.csv"), format="burstgpt", sort=True)
    fmt, back, _, num_failed = read_requests(spec)
    assert num_failed == failed
    same(sorted(requests, key=lambda r: r.arrival_s), back, False)


@SETTINGS
@given(requests=timed_requests(with_hashes=False))
def test_length_stats_round_trip(tmp_path, requests):
    length_stats.write(requests, tmp_path / "l.csv")
    back = read_requests(TraceSpec(path=str(tmp_path / "l.csv"), format="length_stats"))[1]
    assert [(r.input_len, r.output_len) for r in back] == [(r.input_len, r.output_len) for r in requests]


@SETTINGS
@given(sessions=st.lists(st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 9), st.integers(0, 30)),
                                  min_size=1, max_size=6), min_size=1, max_size=3))
def test_agentic_round_trip(tmp_path, sessions):
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    generated = []
    for index, session in enumerate(sessions):
        t, rows = 0.0, []
        for input_len, output_len, think in session:
            t += think
            rows.append(TraceRequest(t, input_len + 1, output_len, tuple(range(index, index + (input_len + 1) // 64)),
                                     float(think)))
        generated.append(rows)
    agentic.write(generated, folder)
    back = read_requests(TraceSpec(path=str(folder), format="agentic"))[1]
    flat = [r for session in generated for r in session]
    assert [(r.arrival_s, r.input_len, r.output_len, r.think_time_s) for r in back] == \
        [(r.arrival_s, r.input_len, r.output_len, r.think_time_s) for r in flat]
    assert [tuple(h for _, h in r.hash_ids) for r in back] == [r.hash_ids for r in flat]


FUZZ_BASES = {
    "mooncake": '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n',
    "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n",
    "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n0.5,m,10,2,12,x\n",
    "length_stats": "num_prefill_tokens,num_decode_tokens\n10,20\n",
    "agentic": json.dumps({"block_size": 64, "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": [1]}]}),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(sorted(FUZZ_BASES)), seed=st.integers(0, 10**9), edits=st.integers(1, 6))
def test_fuzzed_input_raises_only_trace_errors(tmp_path, fmt, seed, edits):
    rng = random.Random(seed)
    text = list(FUZZ_BASES[fmt])
    for _ in range(edits):
        position = rng.randrange(len(text) + 1)
        action = rng.choice(["insert", "delete", "replace"])
        char = rng.choice(string.printable + "{}[],:\"-.ü\x00")
        if action == "insert" or not text:
            text.insert(position, char)
        elif action == "delete":
            del text[min(position, len(text) - 1)]
        else:
            text[min(position, len(text) - 1)] = char
    path = tmp_path / ("f.json" if fmt == "agentic" else "f.txt")
    path.write_text("".join(text), encoding="utf-8")
    for name in (fmt, "auto"):
        try:
            build_workload(TraceSpec(path=str(path), format=name), 0)
        except TraceError as error:
            assert "\n" not in str(error)
        except Exception as error:  # noqa: BLE001 - the point of the test
            if type(error).__name__ not in ("ConfigError", "TraceError"):
                raise


@settings(max_examples=80, deadline=None)
@given(shared=st.integers(0, 4), tail_a=st.lists(st.integers(100, 120), max_size=3),
       tail_b=st.lists(st.integers(200, 220), max_size=3), extra_a=st.integers(1, 511),
       extra_b=st.integers(1, 511), block=st.sampled_from([1, 7, 16, 64, 256, 512, 1000]))
def test_equal_trace_prefixes_give_equal_keys_and_different_ones_never_collide(
        tmp_path_factory, shared, tail_a, tail_b, extra_a, extra_b, block):
    ids_a = list(range(shared)) + tail_a
    ids_b = list(range(shared)) + tail_b
    if not ids_a or not ids_b:
        return
    rows = [{"timestamp": i, "input_length": 512 * (len(ids) - 1) + extra, "output_length": 1, "hash_ids": ids}
            for i, (ids, extra) in enumerate(((ids_a, extra_a), (ids_b, extra_b)))]
    path = tmp_path_factory.mktemp("t") / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = (s.turns[0] for s in build_workload(TraceSpec(path=str(path), format="mooncake"), 0).sessions)
    # Tokens covered by the leading equal ids (a partial last block covers only its own length).
    common = 0
    for i, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            break
        len_a = 512 if i < len(ids_a) - 1 else extra_a
        len_b = 512 if i < len(ids_b) - 1 else extra_b
        common += min(len_a, len_b)
        if len_a != len_b:
            break
    for end in range(block, min(a.prompt_len, b.prompt_len) + 1, block):
        assert (a.prefix_key(end) == b.prefix_key(end)) == (end <= common)


def test_trace_stats_on_the_shipped_mooncake_sample_match_an_independent_count():
    path = resources.files("sim.workload") / "samples" / "mooncake_conversation.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    seen, hits = set(), 0
    for row in rows:
        run = 0
        for h in row["hash_ids"]:
            if h not in seen:
                break
            run += 1
        hits += min(512 * run, row["input_length"])
        seen.update(row["hash_ids"])
    stats = trace_stats(TraceSpec(path="sample:mooncake"), 0)
    inputs = [r["input_length"] for r in rows]
    assert stats["num_requests"] == len(rows) == stats["num_sessions"]
    assert stats["duration_s"] == (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
    assert stats["mean_input_tokens"] == np.mean(inputs)
    assert stats["p99_input_tokens"] == np.percentile(inputs, 99)
    assert stats["ideal_prefix_hit_rate"] == hits / sum(inputs)


def test_trace_stats_on_the_shipped_agentic_sample_count_subagents_in_their_session():
    folder = resources.files("sim.workload") / "samples" / "agentic"
    requests, hits, inputs = 0, 0, 0

    def walk(items, seen):
        nonlocal requests, hits, inputs
        for item in items:
            if item["type"] == "subagent":
                walk(item["requests"], seen)
                continue
            requests += 1
            inputs += item["in"]
            run = 0
            for h in item["hash_ids"]:
                if h not in seen:
                    break
                run += 1
            hits += min(64 * run, item["in"])
            seen.update(item["hash_ids"])
    files = sorted(p for p in folder.iterdir() if p.name.endswith(".json"))
    for path in files:  # ids are local: each session has its own namespace
        walk(json.loads(path.read_text())["requests"], set())
    stats = trace_stats(TraceSpec(path="sample:agentic", format="agentic", timing="open"), 0)
    assert stats["num_requests"] == requests and stats["num_sessions"] == len(files)
    # Stats take requests in arrival order across sessions; within a session the order is the
    # trace's, and ids never cross sessions, so the hit count is the same.
    assert stats["ideal_prefix_hit_rate"] == hits / inputs
