"""The vLLM-v1-style planner on tiny pools, step by step."""
from sim.kvcache.block import BlockAllocator
from sim.scheduler import Scheduler, SchedulerSpec, Sequence
from tests.helpers import request


def make(num_blocks=4, block_size=4, budget=64, chunked=True, max_num_seqs=8, max_model_len=64,
         caching=False):
    alloc = BlockAllocator(num_blocks, block_size, enable_caching=caching)
    spec = SchedulerSpec(max_num_seqs, budget, chunked, max_model_len)
    return Scheduler(spec, alloc), alloc


def add(scheduler, request_id, prompt, output, content=None, max_model_len=64):
    s = Sequence(request(request_id, [(content or request_id, prompt)], output), 0.0, max_model_len)
    scheduler.add(s)
    return s


def step(scheduler, now):
    plan = scheduler.schedule()
    return plan, scheduler.commit(plan, now).finished


def test_preempts_the_newest_running_sequence_and_admits_nothing_that_step():
    scheduler, alloc = make(num_blocks=4, block_size=4)
    a, b = add(scheduler, 1, 6, 10), add(scheduler, 2, 6, 10)
    c = add(scheduler, 3, 2, 2)
    plan, _ = step(scheduler, 1.0)
    assert [(s.seq_id, n) for s, n in plan.scheduled] == [(1, 6), (2, 6)]   # c does not fit
    assert a.num_tokens == 7 and a.first_token_time_s == 1.0
    step(scheduler, 2.0)                                 # tokens 6 of a and b: still block 1
    step(scheduler, 3.0)                                 # token 7: fills block 1
    plan, _ = step(scheduler, 4.0)                       # token 8 of a needs a fifth block
    assert plan.num_preempted == 1
    assert [s.seq_id for s, _ in plan.scheduled] == [1]
    assert scheduler.running == [a] and list(scheduler.waiting) == [b, c]
    assert (b.num_computed, b.num_preemptions, b.num_output) == (0, 1, 3)
    assert alloc.tables[1] == [0, 1, 3]                  # b's freed block 3 went to a


def test_preempted_sequence_recomputes_prompt_and_outputs_so_far():
    scheduler, _ = make(num_blocks=4, block_size=4)
    a, b = add(scheduler, 1, 6, 10), add(scheduler, 2, 6, 10)
    c = add(scheduler, 3, 2, 2)
    for now in range(1, 5):
        step(scheduler, float(now))                      # step 4 preempts b (3 outputs so far)
    now = 5.0
    while b not in scheduler.running:
        plan, finished = step(scheduler, now)
        assert c not in scheduler.running or b in scheduler.running   # FCFS: c waits behind b
        now += 1
    assert a.num_output == 10 and a.finish_time_s == now - 2  # b got a's blocks the step after
    readmit = dict((s.seq_id, n) for s, n in plan.scheduled)
    assert readmit[2] == 9                               # 6 prompt + 3 outputs recomputed
    assert b.num_output == 4 and b.first_token_time_s == 1.0


def test_chunked_prefill_splits_a_long_prompt_over_the_token_budget():
    scheduler, _ = make(num_blocks=16, block_size=4, budget=8)
    a = add(scheduler, 1, 20, 2)
    chunks = [step(scheduler, float(t))[0].scheduled[0][1] for t in (1, 2, 3)]
    assert chunks == [8, 8, 4]
    assert a.first_token_time_s == 3.0 and a.num_output == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler, _ = make(num_blocks=16, block_size=4, budget=10, chunked=False)
    add(scheduler, 1, 6, 4)
    add(scheduler, 2, 6, 4)
    plan, _ = step(scheduler, 1.0)
    assert [(s.seq_id, n) for s, n in plan.scheduled] == [(1, 6)]
    plan, _ = step(scheduler, 2.0)
    assert [(s.seq_id, n) for s, n in plan.scheduled] == [(1, 1), (2, 6)]


def test_max_num_seqs_caps_the_batch():
    scheduler, _ = make(num_blocks=32, block_size=4, max_num_seqs=2)
    for i in range(1, 5):
        add(scheduler, i, 3, 3)
    plan, _ = step(scheduler, 1.0)
    assert len(plan.scheduled) == 2 and len(scheduler.waiting) == 2


def test_output_stops_at_max_model_len():
    scheduler, _ = make(num_blocks=32, block_size=4, max_model_len=10)
    a = add(scheduler, 1, 8, 50, max_model_len=10)
    finished = []
    for t in range(1, 10):
        finished += step(scheduler, float(t))[1]
    assert finished == [a] and a.num_output == 2 and a.num_tokens == 10


def test_prefix_hit_is_recorded_once_at_first_admission():
    scheduler, _ = make(num_blocks=16, block_size=4, caching=True)
    add(scheduler, 1, 13, 1, content=7)
    step(scheduler, 1.0)                                 # finishes: its 3 full blocks stay cached
    b = add(scheduler, 2, 13, 2, content=7)
    plan, _ = step(scheduler, 2.0)
    assert b.prefix_hit_tokens == 12 and plan.scheduled[0][1] == 1
    assert plan.shape.num_prefill_tokens == 1 and plan.shape.prefill_kv_tokens == 13


def test_parallel_samples_share_the_prompt_and_copy_the_last_block_on_write():
    scheduler, alloc = make(num_blocks=16, block_size=4)
    s = Sequence(request(1, [(1, 6)], 3, n=3), 0.0, 64)
    scheduler.add(s)
    step(scheduler, 1.0)                                 # prompt done: two siblings forked
    assert len(scheduler.running) == 3
    assert [alloc.tables[x.seq_id] for x in scheduler.running] == [[0, 1]] * 3
    assert alloc.pool.ref_count[:2] == [3, 3]
    plan = step(scheduler, 2.0)[0]                       # each writes token 6 into block 1
    tables = [alloc.tables[x.seq_id] for x in scheduler.running]
    assert [t[0] for t in tables] == [0, 0, 0] and len({t[1] for t in tables}) == 3
    assert alloc.num_cow_copies == 2                     # the last writer owns the original
    assert plan.shape.copy_tokens == 2 * 4               # the step that wrote pays for the copies
    assert scheduler.schedule().shape.copy_tokens == 0   # and only that step
    finished = step(scheduler, 3.0)[1]
    assert len(finished) == 3 and all(x.num_output == 3 for x in finished)
    assert alloc.num_free_blocks == 16


def test_swap_preemption_moves_kv_to_cpu_and_back_without_recompute():
    alloc = BlockAllocator(4, 4)
    spec = SchedulerSpec(8, 64, True, 64, preemption_mode="swap", swap_space_tokens=100)
    scheduler = Scheduler(spec, alloc)
    a, b = add(scheduler, 1, 6, 10), add(scheduler, 2, 6, 4)
    for now in (1.0, 2.0, 3.0):
        step(scheduler, now)
    plan, _ = step(scheduler, 4.0)                       # a needs a block: b is swapped out
    assert list(scheduler.swapped) == [b] and b.num_computed == 8 and b.num_swapped_tokens == 8
    assert plan.shape.swap_tokens == 8 and scheduler.swap_used_tokens == 8
    while b in scheduler.swapped:
        plan, _ = step(scheduler, 5.0)
    assert plan.shape.swap_tokens == 8                   # swapped back in, not recomputed
    assert dict((x.seq_id, n) for x, n in plan.scheduled)[2] == 1
    assert b.num_preemptions == 1 and scheduler.swap_used_tokens == 0
    del a


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    alloc = BlockAllocator(4, 4)
    spec = SchedulerSpec(8, 64, True, 64, preemption_mode="swap", swap_space_tokens=4)
    scheduler = Scheduler(spec, alloc)
    add(scheduler, 1, 6, 10)
    b = add(scheduler, 2, 6, 4)
    for now in (1.0, 2.0, 3.0, 4.0):
        step(scheduler, now)
    assert not scheduler.swapped and scheduler.waiting[0] is b and b.num_computed == 0


def _admission(reserve_full_isl, watermark=0.0, num_blocks=8):
    """A running 4-token request holds 1 of 8 four-token blocks; a 36-token prompt waits. With a
    16-token budget its first chunk (3 blocks after the runner's decode token) fits the 7 free
    blocks, its whole prompt (9 blocks) does not."""
    alloc = BlockAllocator(num_blocks, 4)
    spec = SchedulerSpec(8, 16, True, 64, reserve_full_isl=reserve_full_isl, watermark=watermark)
    scheduler = Scheduler(spec, alloc)
    runner = add(scheduler, 1, 3, 50)
    step(scheduler, 1.0)
    waiting = add(scheduler, 2, 36, 4)
    plan, _ = step(scheduler, 2.0)
    return scheduler, plan, runner, waiting


def test_full_sequence_admission_waits_where_first_chunk_admission_admits():
    # vLLM v1 (scheduler_reserve_full_isl=True): allocate_slots(full_sequence_must_fit=True)
    # needs blocks for the whole current sequence: 9 > 7 free, so the request waits.
    scheduler, plan, runner, waiting = _admission(reserve_full_isl=True)
    assert [s.seq_id for s, _ in plan.scheduled] == [1]
    assert list(scheduler.waiting) == [waiting] and scheduler.running == [runner]
    # Earlier vLLM v1 checked only the chunk: 15 budget tokens left -> 4 blocks, which fit.
    scheduler, plan, runner, waiting = _admission(reserve_full_isl=False)
    assert [(s.seq_id, n) for s, n in plan.scheduled] == [(1, 1), (2, 15)]
    assert scheduler.running == [runner, waiting]


def test_full_sequence_admission_admits_once_the_whole_prompt_fits():
    scheduler, plan, _, waiting = _admission(reserve_full_isl=True, num_blocks=10)
    assert [(s.seq_id, n) for s, n in plan.scheduled] == [(1, 1), (2, 15)]   # 9 of 9 free blocks


def test_watermark_keeps_a_share_of_blocks_free_only_while_something_runs():
    # 10 blocks, watermark 0.2 -> 2 blocks kept: 9 needed + 2 > 9 free, so it waits ...
    scheduler, plan, _, waiting = _admission(reserve_full_isl=True, watermark=0.2, num_blocks=10)
    assert list(scheduler.waiting) == [waiting]
    # ... but with nothing running (vLLM applies the watermark only then) it is admitted.
    alloc = BlockAllocator(10, 4)
    lone = Scheduler(SchedulerSpec(8, 16, True, 64, watermark=0.2), alloc)
    seq = add(lone, 2, 36, 4)
    plan, _ = step(lone, 1.0)
    assert [(s.seq_id, n) for s, n in plan.scheduled] == [(2, 16)] and lone.running == [seq]


def _no_evict_run(guaranteed_no_evict):
    """Two 6-token prompts that grow to 16 tokens (4 of 8 four-token blocks each) and a
    2-token one that grows to 12 (3 blocks): 11 blocks to completion, 8 in the pool."""
    alloc = BlockAllocator(8, 4)
    scheduler = Scheduler(SchedulerSpec(8, 64, True, 64, guaranteed_no_evict=guaranteed_no_evict), alloc)
    seqs = [add(scheduler, 1, 6, 10), add(scheduler, 2, 6, 10), add(scheduler, 3, 2, 10)]
    admitted, preempted, now = [], 0, 0.0
    while scheduler.has_work():
        now += 1.0
        plan, _ = step(scheduler, now)
        preempted += plan.num_preempted
        admitted.append(sorted(s.seq_id for s in scheduler.running))
    return seqs, admitted, preempted


def test_guaranteed_no_evict_admits_only_what_runs_to_completion_and_never_preempts():
    """TensorRT-LLM's GUARANTEED_NO_EVICT (its default capacity policy): a request starts only
    when every started request's blocks to completion and its own fit, so none is paused."""
    (a, b, c), admitted, preempted = _no_evict_run(guaranteed_no_evict=True)
    assert admitted[0] == [1, 2]  # c waits with 4 blocks free now: 4 + 4 + 3 > 8 to completion
    assert preempted == 0 and a.num_preemptions == b.num_preemptions == c.num_preemptions == 0
    assert c.first_token_time_s > min(a.finish_time_s, b.finish_time_s)  # once one has finished
    assert all(s.num_output == s.request.output_len for s in (a, b, c))
    # vLLM's scheduling (max_utilization) admits c at once and preempts when the blocks run out.
    _, admitted, preempted = _no_evict_run(guaranteed_no_evict=False)
    assert admitted[0] == [1, 2, 3] and preempted > 0


def test_guaranteed_no_evict_reserves_each_samples_share_at_admission():
    """A request of n samples reserves its blocks to completion and, for each other sample, the
    blocks past the prompt's full blocks it will share: two 2-sample requests (4 + 2 blocks each
    of 16) and a single one (4) fit; a fourth waits until one finishes; nothing is preempted
    and every reservation is given back."""
    alloc = BlockAllocator(16, 4)
    scheduler = Scheduler(SchedulerSpec(8, 64, True, 64, guaranteed_no_evict=True), alloc)
    pairs = [Sequence(request(i, [(i, 8)], 8, n=2), 0.0, 64) for i in (1, 2)]
    for seq in pairs:
        scheduler.add(seq)
    single, late = add(scheduler, 3, 8, 8), add(scheduler, 4, 8, 8)
    now, preempted, first_admitted = 0.0, 0, None
    while scheduler.has_work():
        now += 1.0
        plan, _ = step(scheduler, now)
        preempted += plan.num_preempted
        first_admitted = first_admitted or sorted({s.request.request_id for s in scheduler.running})
    assert first_admitted == [1, 2, 3] and preempted == 0
    assert late.first_token_time_s > min(seq.finish_time_s for seq in (*pairs, single))
    reservations = scheduler._reservations
    assert reservations.held == {} and reservations.total == [0]


def test_the_runs_title_says_a_capacity_policy_other_than_vllms():
    from sim.report import run_title
    from tests.conftest import compose_config
    assert "capacity_scheduler_policy" not in run_title(compose_config("run", []))
    title = run_title(compose_config("run", ["capacity_scheduler_policy=guaranteed_no_evict"]))
    assert "capacity_scheduler_policy=guaranteed_no_evict" in title
