"""Trace readers against hand-written files, the trace.* keys, and bad input."""
import json
import logging

import pytest

from sim.errors import KvsimError
from sim.workload import agentic
from sim.workload.records import TraceError, TraceRequest
from sim.workload.trace import TraceSpec, build_workload, read_requests


def write(path, text):
    path.write_text(text)
    return str(path)


def mooncake_file(tmp_path, rows=None):
    rows = rows or [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1030, "output_length": 7, "hash_ids": [1, 2, 4]},
        {"timestamp": 4000, "input_length": 600, "output_length": 9, "hash_ids": [9, 10]},
    ]
    return write(tmp_path / "trace.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def agentic_file(tmp_path, name="s1.json", requests=None, **top):
    body = {"block_size": 64, "tool_tokens": 100, "system_tokens": 40, **top,
            "requests": requests if requests is not None else [
                {"t": 0.0, "type": "n", "in": 130, "out": 10, "hash_ids": [5, 6], "think_time": 0},
                {"t": 10.0, "type": "subagent", "requests": [
                    {"t": 0.0, "type": "n", "in": 70, "out": 3, "hash_ids": [5], "think_time": 0},
                    {"t": 4.0, "type": "s", "in": 140, "out": 4, "hash_ids": [5, 8], "think_time": 2.5}]},
                {"t": 20.0, "type": "n", "in": 200, "out": 6, "hash_ids": [5, 6, 7], "think_time": 9.0}]}
    return write(tmp_path / name, json.dumps(body))


def test_mooncake_reader(tmp_path):
    fmt, requests, skipped, failed = read_requests(TraceSpec(path=mooncake_file(tmp_path), format="mooncake"))
    assert (fmt.block_size, fmt.covers_partial_block) == (512, True)
    assert [(r.arrival_s, r.input_len, r.output_len, r.hash_ids) for r in requests] == [
        (0.0, 1100, 5, (1, 2, 3)), (1.5, 1030, 7, (1, 2, 4)), (4.0, 600, 9, (9, 10))]
    assert (skipped, failed) == (0, 0)


def test_azure_reader_takes_seven_fraction_digits(tmp_path):
    path = write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n")
    _, requests, _, _ = read_requests(TraceSpec(path=path, format="azure"))
    assert [r.input_len for r in requests] == [4808, 3180]
    assert requests[1].arrival_s == pytest.approx(0.052, abs=1e-9)


def test_burstgpt_zero_response_rows_are_failed_requests_counted_not_replayed(tmp_path):
    path = write(tmp_path / "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "0.5,ChatGPT,100,20,120,Conversation log\n1.0,GPT-4,50,0,50,Conversation log\n"
                 "2.0,ChatGPT,70,30,100,API log\n")
    _, requests, skipped, failed = read_requests(TraceSpec(path=path, format="burstgpt"))
    assert [(r.arrival_s, r.input_len, r.output_len) for r in requests] == [(0.5, 100, 20), (2.0, 70, 30)]
    assert (skipped, failed) == (0, 1)
    assert build_workload(TraceSpec(path=path, format="burstgpt"), 0).num_failed_requests == 1


def test_length_stats_get_an_arrival_process(tmp_path):
    path = write(tmp_path / "l.csv", "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
                 "10,20,30,0.5\n40,5,45,8\n7,7,14,1\n")
    spec = TraceSpec(path=path, format="length_stats", arrival_process="constant", arrival_rate_rps=2.0)
    workload = build_workload(spec, 0)
    assert [s.arrival_time_s for s in workload.sessions] == [0.0, 0.5, 1.0]
    assert [s.turns[0].prompt_len for s in workload.sessions] == [10, 40, 7]


def test_agentic_subagents_are_chains_of_their_parents_session(tmp_path):
    path = agentic_file(tmp_path)
    _, requests, _, _ = read_requests(TraceSpec(path=path, format="agentic"))
    assert [(r.arrival_s, r.chain, r.input_len) for r in requests] == [
        (0.0, 0, 130), (10.0, 1, 70), (14.0, 1, 140), (20.0, 0, 200)]
    workload = build_workload(TraceSpec(path=path, format="agentic", arrival_process="constant"), 0)
    chains = sorted((s.chain, [t.prompt_len for t in s.turns], [t.think_time_s for t in s.turns])
                    for s in workload.sessions)
    assert chains == [(0, [130, 200], [0.0, 9.0]), (1, [70, 140], [0.0, 2.5])]
    assert {s.session_id for s in workload.sessions} == {0}
    opened = build_workload(TraceSpec(path=path, format="agentic", timing="open"), 0)
    assert sorted(s.arrival_time_s for s in opened.sessions) == [0.0, 10.0, 14.0, 20.0]


def test_agentic_ids_are_per_session_unless_the_preamble_is_shared(tmp_path):
    folder = tmp_path / "sessions"
    folder.mkdir()
    agentic_file(folder, "a.json")
    agentic_file(folder, "b.json")
    def first_keys(share):
        workload = build_workload(TraceSpec(path=str(folder), format="agentic", share_preamble=share), 0)
        firsts = [s.turns[0] for s in workload.sessions if s.chain == 0]
        return [r.prefix_key(64) for r in firsts], [r.prefix_key(128) for r in firsts]
    block1, block2 = first_keys(False)
    assert block1[0] != block1[1]                        # local ids: no cross-session sharing
    block1, block2 = first_keys(True)
    # (100 + 40) // 64 = 2 preamble blocks are shared by every session.
    assert block1[0] == block1[1] and block2[0] == block2[1]


def test_hash_ids_map_onto_any_simulated_block_size_exactly(tmp_path):
    workload = build_workload(TraceSpec(path=mooncake_file(tmp_path), format="mooncake"), 0)
    a, b, c = (s.turns[0] for s in sorted(workload.sessions, key=lambda s: s.arrival_time_s))
    for end in (1, 16, 511, 512, 700, 1024):
        assert a.prefix_key(end) == b.prefix_key(end)  # blocks 1, 2 shared
    for end in (1025, 1030):
        assert a.prefix_key(end) != b.prefix_key(end)
    assert a.prefix_key(16) != c.prefix_key(16)


def test_max_requests_window_scaling_target_rate_and_repeat(tmp_path):
    path = mooncake_file(tmp_path)
    arrivals = lambda **kw: sorted(s.arrival_time_s for s in build_workload(
        TraceSpec(path=path, format="mooncake", **kw), 0).sessions)
    assert arrivals(max_requests=2) == [0.0, 1.5]
    assert arrivals(start_s=1.0, end_s=5.0) == [0.0, 2.5]
    assert arrivals(time_scale=2.0) == [0.0, 3.0, 8.0]
    assert arrivals(target_rate_rps=1.0) == pytest.approx([0.0, 0.75, 2.0])   # 2 gaps in 2 s
    assert arrivals(repeat=2) == [0.0, 1.5, 4.0, 6.0, 7.5, 10.0]
    copies = build_workload(TraceSpec(path=path, format="mooncake", repeat=2), 0)
    first, again = copies.sessions[0].turns[0], copies.sessions[3].turns[0]
    assert first.prompt_len == again.prompt_len and first.prefix_key(16) != again.prefix_key(16)


def test_auto_detection_says_what_it_chose(tmp_path, caplog):
    path = mooncake_file(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="sim.workload.trace"):
        fmt, *_ = read_requests(TraceSpec(path=path))
    assert fmt.name == "mooncake" and "auto -> mooncake" in caplog.text
    assert build_workload(TraceSpec(path=path), 0).trace_format == "mooncake"   # the run says it
    for name, text in [("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,5,6\n"),
                       ("length_stats", "num_prefill_tokens,num_decode_tokens\n5,6\n")]:
        assert read_requests(TraceSpec(path=write(tmp_path / f"{name}.csv", text)))[0].name == name
    assert read_requests(TraceSpec(path=agentic_file(tmp_path)))[0].name == "agentic"


BAD = [
    # (format, file name, content, expected fragments)
    ("mooncake", "t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n',
     ["malformed JSON", "t.jsonl:2"]),
    ("mooncake", "t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1}\n',
     ["missing field 'hash_ids'", "t.jsonl:1 field hash_ids"]),
    ("mooncake", "t.jsonl", '{"timestamp": 0, "input_length": -4, "output_length": 1, "hash_ids": []}\n',
     ["t.jsonl:1 field input_length", "below 1"]),
    ("mooncake", "t.jsonl", '{"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": [1]}\n',
     ["not an integer", "field input_length"]),
    ("mooncake", "t.jsonl", '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n',
     ["1 hash ids for input_length 1000", "field hash_ids"]),
    ("mooncake", "t.jsonl", '{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": 2, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n',
     ["before the previous", "t.jsonl:2 field timestamp", "trace.sort=true"]),
    ("mooncake", "t.jsonl", "", ["no requests"]),
    ("azure", "a.csv", "TIMESTAMP,Context,GeneratedTokens\n", ["missing column(s) ContextTokens", "a.csv:1"]),
    ("azure", "a.csv", "", ["empty file", "a.csv:1"]),
    # Found by the fuzzer: a quoted header cell spanning lines must not break the one-line error.
    ("burstgpt", "b.csv", 'Timestamp,Model,"Reques tokens,Response tokens\n0.5",x\n', ["missing column(s)", "b.csv:1"]),
    ("burstgpt", "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
     "0,m,abc,1,1,x\n", ["b.csv:2 field Request tokens", "not an integer"]),
    ("agentic", "s.json", json.dumps({"block_size": 64, "requests": [
        {"t": 0, "type": "subagent", "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": [1]},
                                                  {"t": 1, "in": -3, "out": 1, "hash_ids": []}]}]}),
     ["requests[0].requests[1].in", "field in"]),
    ("agentic", "s.json", json.dumps({"block_size": 64, "requests": [{"t": 0, "in": 200, "out": 1, "hash_ids": [1]}]}),
     ["requests[0].hash_ids", "full 64-token blocks need 3"]),
]


@pytest.mark.parametrize("fmt, name, content, fragments", BAD)
def test_bad_input_names_file_line_and_field(tmp_path, fmt, name, content, fragments):
    path = write(tmp_path / name, content)
    with pytest.raises(KvsimError) as err:
        build_workload(TraceSpec(path=path, format=fmt), 0)
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_skip_mode_counts_and_reports_instead_of_failing(tmp_path):
    path = write(tmp_path / "t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                 '{broken\n{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [2]}\n')
    workload = build_workload(TraceSpec(path=path, format="mooncake", on_error="skip"), 0)
    assert workload.num_requests == 2 and workload.num_skipped_records == 1


def test_sort_accepts_out_of_order_timestamps(tmp_path):
    path = mooncake_file(tmp_path, [{"timestamp": 900, "input_length": 5, "output_length": 1, "hash_ids": [1]},
                                    {"timestamp": 100, "input_length": 6, "output_length": 1, "hash_ids": [2]}])
    workload = build_workload(TraceSpec(path=path, format="mooncake", sort=True), 0)
    assert [s.turns[0].prompt_len for s in sorted(workload.sessions, key=lambda s: s.arrival_time_s)] == [6, 5]


def test_directories_are_only_for_agentic_sessions(tmp_path):
    with pytest.raises(TraceError, match="a directory"):
        read_requests(TraceSpec(path=str(tmp_path), format="mooncake"))
    (tmp_path / "SOURCE.md").write_text("# where the trace comes from\n")
    with pytest.raises(TraceError, match="no trace files"):
        read_requests(TraceSpec(path=str(tmp_path)))
    with pytest.raises(TraceError, match="a glob that matches no trace file"):
        read_requests(TraceSpec(path=str(tmp_path / "*.json")))
    with pytest.raises(TraceError, match="no session files"):
        read_requests(TraceSpec(path=str(tmp_path), format="agentic"))
    mooncake_file(tmp_path, [{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}])
    with pytest.raises(TraceError, match="is a mooncake trace, and only agentic sessions come as many"):
        read_requests(TraceSpec(path=str(tmp_path)))


def test_auto_detects_agentic_sessions_in_a_directory_and_a_glob(tmp_path):
    sessions = [[TraceRequest(0.0, 128, 4, (1, 2), session="x")]]
    agentic.write(sessions, tmp_path / "dir")
    (tmp_path / "dir" / "SOURCE.md").write_text("licence\n")   # shipped beside public traces
    for path in (tmp_path / "dir", tmp_path / "dir" / "trace_*.json"):
        fmt, requests, _, _ = read_requests(TraceSpec(path=str(path)))
        assert fmt.name == "agentic" and [r.input_len for r in requests] == [128]


def test_unknown_format_is_a_config_error():
    with pytest.raises(KvsimError, match="unknown trace format 'csvx'"):
        TraceSpec(path="x", format="csvx")


@pytest.mark.parametrize("fmt", ["mooncake", "azure", "agentic", "auto"])
def test_undecodable_bytes_are_a_trace_error(tmp_path, fmt):
    path = tmp_path / ("t.json" if fmt == "agentic" else "t.jsonl")
    path.write_bytes(b'{"timestamp": 0, "input_length": \xff\xfe}\n')
    with pytest.raises(TraceError):
        build_workload(TraceSpec(path=str(path), format=fmt), 0)


@pytest.mark.parametrize("key, value, why", [
    ("share_preamble", True, "only agentic sessions have a preamble"),
    ("timing", "open", "requests are independent"),
    ("arrival_rate_rps", 50.0, "records its own arrival times"),
    ("arrival_process", "constant", "records its own arrival times"),
])
def test_trace_keys_a_format_does_not_read_are_errors(tmp_path, key, value, why):
    path = mooncake_file(tmp_path)
    with pytest.raises(KvsimError, match=f"trace.{key} does not apply to this trace: .*{why}"):
        build_workload(TraceSpec(path=path, **{key: value}), 0)


def test_arrival_keys_apply_to_untimed_traces():
    workload = build_workload(TraceSpec(path="sample:sharegpt", arrival_process="constant",
                                        arrival_rate_rps=4.0, max_requests=5), 0)
    assert sorted(s.arrival_time_s for s in workload.sessions) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_max_total_tokens_clips_as_vidur_does(tmp_path):
    # Vidur's TraceRequestLengthGenerator: the excess over max_tokens comes off prompt and output
    # in proportion, each rounded up, at least one token each.
    from sim.workload.trace import clip_total
    from sim.workload.mooncake import FORMAT
    request = TraceRequest(0.0, 3000, 2000, tuple(range(6)))
    clipped = clip_total(request, 4096, FORMAT)
    assert (clipped.input_len, clipped.output_len) == (3000 - 543, 2000 - 362)   # excess 904
    assert clipped.hash_ids == tuple(range(5))                                   # ceil(2457 / 512)
    assert clip_total(TraceRequest(0.0, 10, 5), 4096, FORMAT) == TraceRequest(0.0, 10, 5)
    small = clip_total(TraceRequest(0.0, 5000, 1), 100, FORMAT)
    assert small.output_len == 1 and small.input_len + small.output_len <= 100


def test_recorded_timestamps_can_give_way_to_an_arrival_process():
    spec = dict(path="sample:azure_conv", max_requests=200, arrivals="process",
                arrival_process="constant", arrival_rate_rps=2.0)
    arrivals = sorted(s.arrival_time_s for s in build_workload(TraceSpec(**spec), 0).sessions)
    assert arrivals[:3] == [0.0, 0.5, 1.0] and arrivals[-1] == pytest.approx(99.5)
    with pytest.raises(KvsimError, match="trace.arrivals does not apply"):
        build_workload(TraceSpec(path="sample:sharegpt", arrivals="process", max_requests=5), 0)


@pytest.mark.parametrize("path, fmt", [("sample:mooncake", "mooncake"), ("sample:agentic", "agentic"),
                                       ("sample:sharegpt", "length_stats")])
def test_a_repeated_trace_streams_copies_equal_to_building_them_all(path, fmt):
    from sim.workload.request import RepeatedSessions
    spec = TraceSpec(path=path, format=fmt, repeat=3)
    streamed, built = build_workload(spec, 0), build_workload(spec, 0, stream=False)
    assert isinstance(streamed.sessions, RepeatedSessions) and len(streamed.sessions.one_copy) * 3 == len(built.sessions)
    assert list(streamed.in_arrival_order()) == list(built.in_arrival_order())
    assert (streamed.num_requests, streamed.first_arrival_s, streamed.last_arrival_s) == (
        built.num_requests, built.first_arrival_s, built.last_arrival_s)
    assert streamed.sessions[-1] == sorted(built.sessions, key=lambda s: (s.arrival_time_s, s.session_id))[-1]


def test_a_streamed_repeat_simulates_exactly_as_one_built_whole():
    from sim.run import prepare, simulate
    from tests.conftest import compose_config
    cfg = compose_config("run", ["scenario=trace", "trace.path=sample:mooncake", "trace.repeat=2",
                                 "trace.max_requests=300", "model=llama31_8b", "tensor_parallel_size=1",
                                 "allocators=[prefix]", "cluster.num_replicas=2", "plots=false"])
    setup = prepare(cfg)
    runs = [simulate(setup, build_workload(TraceSpec(**cfg.trace), 0, stream=stream), "prefix", cfg.router,
                     queue_order_cfg=cfg.queue_order) for stream in (True, False)]
    for run in runs:
        run.metrics.pop("wall_time_s")
    assert runs[0].metrics == runs[1].metrics
    assert runs[0].requests.equals(runs[1].requests)
