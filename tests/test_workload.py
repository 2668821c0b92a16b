"""Request identity (prefix keys) and the rag_agents generator."""
from hydra.utils import instantiate
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.workload.request import PrefixInterner, make_request
from tests.conftest import compose_config


def workload(*overrides, seed=0):
    cfg = compose_config("run", list(overrides))
    return instantiate(cfg.scenario).generate(seed)


def tokens_of(segments):
    return [(content, i) for content, n in segments for i in range(n)]


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 6)), min_size=1, max_size=4),
       b=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 6)), min_size=1, max_size=4),
       end=st.integers(1, 24))
def test_prefix_keys_are_equal_exactly_when_token_prefixes_are(a, b, end):
    interner = PrefixInterner()
    ra, rb = make_request(interner, 1, a, 1, 100), make_request(interner, 2, b, 1, 101)
    if end > min(ra.prompt_len, rb.prompt_len):
        return
    same_tokens = tokens_of(a)[:end] == tokens_of(b)[:end]
    same_segmentation = _segments_upto(a, end) == _segments_upto(b, end)
    if same_segmentation:
        assert ra.prefix_key(end) == rb.prefix_key(end)
    if ra.prefix_key(end) == rb.prefix_key(end):
        assert same_tokens


def _segments_upto(segments, end):
    out, position = [], 0
    for content, n in segments:
        if position >= end:
            break
        out.append((content, n) if position + n < end else (content, None))
        position += n
    return out


def test_output_keys_continue_in_the_next_turns_prompt():
    interner = PrefixInterner()
    first = make_request(interner, 1, [(1, 10)], 7, 50)
    second = make_request(interner, 2, [(1, 10), (50, 7), (60, 3)], 4, 51)
    for end in range(1, 18):
        assert first.prefix_key(end) == second.prefix_key(end)
    other_tool = make_request(interner, 3, [(1, 10), (50, 7), (61, 3)], 4, 52)
    assert other_tool.prefix_key(17) == second.prefix_key(17)
    assert other_tool.prefix_key(18) != second.prefix_key(18)


def test_rag_agents_is_deterministic_per_seed():
    assert workload() == workload()
    assert workload() != workload(seed=1)


def test_rag_agents_sessions_share_application_preambles_and_grow_turn_by_turn():
    sessions = workload().sessions
    preambles = {s.turns[0].segments[:2] for s in sessions}
    assert 1 < len(preambles) <= 6                           # num_applications: 6
    arrivals = [s.arrival_time_s for s in sessions]
    assert arrivals == sorted(arrivals)
    multi = [s for s in sessions if len(s.turns) > 1]
    assert multi
    for session in multi:
        for before, after in zip(session.turns, session.turns[1:]):
            assert after.segments[:len(before.segments)] == before.segments
            assert after.segments[len(before.segments)] == (before.output_content_id, before.output_len)
            assert after.think_time_s > 0 and after.prompt_len > before.prompt_len


def test_shared_segments_avoid_block_aligned_lengths():
    # Aligned shared segments would make prefix hit rates independent of the block size.
    for session in workload().sessions:
        for content, n in session.turns[0].segments[:-1]:
            assert n % 16 != 0


def test_popular_documents_recur_across_sessions():
    sessions = workload().sessions
    docs = [seg for s in sessions for seg in s.turns[0].segments[2:-1]]
    most_common = max(docs.count(d) for d in set(docs))
    assert most_common > len(sessions) * 0.05


@settings(max_examples=100, deadline=None)
@given(segments=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 9)), min_size=1, max_size=5),
       block_size=st.integers(1, 8), output=st.integers(1, 20), first=st.integers(0, 5))
def test_bulk_prefix_keys_match_single_keys(segments, block_size, output, first):
    r = make_request(PrefixInterner(), 1, segments, output, 99)
    end_block = (r.prompt_len + output) // block_size
    expected = [r.prefix_key((i + 1) * block_size) for i in range(first, end_block)]
    assert list(r.prefix_keys(block_size, first, end_block)) == expected


def test_truncation_keeps_the_last_tokens_and_gives_the_cut_segment_new_identity():
    from sim.workload.overlength import truncate_overlength
    from sim.workload.request import PrefixInterner, Session, Workload, make_request

    interner = PrefixInterner()
    shared = [(1, 3000), (2, 500)]                       # a 3000-token document, then a question
    long = make_request(interner, 0, [*shared, (3, 1000)], 10, 90, session_id=0, priority=2)
    twin = make_request(interner, 1, [*shared, (4, 1000)], 10, 91, session_id=1)
    short = make_request(interner, 2, [(1, 3000), (5, 40)], 10, 92, session_id=2)
    other = make_request(interner, 3, [(1, 3000), (6, 40)], 10, 93, session_id=3)
    workload = Workload(tuple(Session(i, 0.0, (r,)) for i, r in enumerate((long, twin, short, other))))
    cut = truncate_overlength(workload, 4096)
    assert cut.num_truncated_prompts == 2
    long2, twin2, short2, other2 = (s.turns[0] for s in cut.sessions)
    assert long2.prompt_len == twin2.prompt_len == 4096 - 10   # room for the 10 output tokens
    # The first 414 tokens went: the document's kept tail is new content, the rest keeps its ids.
    assert [n for _, n in long2.segments] == [2586, 500, 1000]
    assert long2.segments[0][0] not in (1, 2, 3, 4, 5, 6) and long2.segments[1:] == ((2, 500), (3, 1000))
    # Each cut is its own content: two truncated prompts share nothing, not even the kept tail ...
    assert long2.prefix_key(100) != twin2.prefix_key(100)
    assert long2.prefix_key(100) != short2.prefix_key(100)
    # ... while untruncated prompts keep their segments and still share their common prefix.
    assert short2.segments == short.segments and other2.segments == other.segments
    # Every other field of a request stays as it was (queue_order=priority reads priority).
    assert (long2.priority, short2.priority, long2.session_id, long2.output_len) == (2, 0, 0, 10)
    assert short2.prefix_key(3000) == other2.prefix_key(3000) != short2.prefix_key(3001)
    untouched = Workload((Session(2, 0.0, (short,)),))
    assert truncate_overlength(untouched, 4096) is untouched


@settings(max_examples=200, deadline=None)
@given(a=st.tuples(st.integers(0, 2**40), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
       b=st.tuples(st.integers(0, 2**40), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)))
def test_packed_keys_are_equal_exactly_when_their_fields_are(a, b):
    from sim.workload.request import pack_key
    assert (pack_key(*a) == pack_key(*b)) == (a == b)
    assert pack_key(*a) == pack_key(*a[:2], 0) + a[2]  # a segment's keys form one range


def test_a_content_id_beyond_the_packed_keys_bits_is_refused():
    import pytest
    with pytest.raises(ValueError, match="32 bits"):
        make_request(PrefixInterner(), 1, [(2**32, 4)], 1, 5)
