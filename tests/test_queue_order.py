"""Queue orders within a replica (sim/scheduler/queue_order.py) on tiny pools, step by step."""
from sim.kvcache.block import BlockAllocator
from sim.scheduler import Scheduler, SchedulerSpec, Sequence
from sim.scheduler.queue_order import LongestPrefixMatch, Priority
from tests.helpers import request


def make(order=None, num_blocks=4, block_size=4, caching=False):
    alloc = BlockAllocator(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerSpec(8, 64, True, 64), alloc, order), alloc


def add(scheduler, request_id, prompt, output, arrival_s, content=None, priority=0):
    seq = Sequence(request(request_id, [(content or request_id, prompt)], output, priority=priority),
                   arrival_s, 64)
    scheduler.add(seq)
    return seq


def admitted_order(scheduler):
    order, now = [], 1.0
    while scheduler.has_work():
        plan = scheduler.schedule()
        order += [seq.seq_id for seq, _ in plan.scheduled if seq.seq_id not in order]
        scheduler.commit(plan, now)
        now += 1
    return order


def test_priority_admits_the_lowest_value_first_then_the_earliest_arrival():
    scheduler, _ = make(Priority(), num_blocks=3)      # room for one 10-token request at a time
    add(scheduler, 1, 9, 2, 0.0, priority=2)
    add(scheduler, 2, 9, 2, 0.1, priority=0)
    add(scheduler, 3, 9, 2, 0.2, priority=1)
    add(scheduler, 4, 9, 2, 0.3, priority=0)
    assert admitted_order(scheduler) == [2, 4, 3, 1]
    fcfs, _ = make(num_blocks=3)
    for i, p in enumerate((2, 0, 1, 0)):
        add(fcfs, i + 1, 9, 2, 0.1 * i, priority=p)
    assert admitted_order(fcfs) == [1, 2, 3, 4]


def test_priority_preempts_the_lowest_priority_even_when_already_scheduled_this_step():
    scheduler, alloc = make(Priority(), num_blocks=4)
    a = add(scheduler, 1, 6, 10, 0.0, priority=5)       # two blocks each: the pool is full
    b = add(scheduler, 2, 7, 10, 0.1, priority=0)
    scheduler.commit(scheduler.schedule(), 1.0)          # prompts
    scheduler.commit(scheduler.schedule(), 2.0)          # positions 6 and 7: still two blocks each
    plan = scheduler.schedule()                          # a's position 7 fits; b's 8 needs a block
    assert plan.num_preempted == 1 and [(s.seq_id, n) for s, n in plan.scheduled] == [(2, 1)]
    assert scheduler.running == [b] and list(scheduler.waiting) == [a] and a.num_preemptions == 1
    assert plan.shape.num_tokens == 1 and len(alloc.tables[2]) == 3


def test_fcfs_preempts_the_newest_instead():
    scheduler, _ = make(num_blocks=4)
    a = add(scheduler, 1, 6, 10, 0.0, priority=5)
    b = add(scheduler, 2, 7, 10, 0.1, priority=0)
    scheduler.commit(scheduler.schedule(), 1.0)
    scheduler.commit(scheduler.schedule(), 2.0)
    plan = scheduler.schedule()
    assert plan.num_preempted == 1 and scheduler.running == [a] and list(scheduler.waiting) == [b]


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first():
    hits = {}
    for name, order, expected in (("lpm", LongestPrefixMatch(), [3, 2]), ("fcfs", None, [2, 3])):
        scheduler, _ = make(order, num_blocks=5, caching=True)
        add(scheduler, 1, 13, 1, 0.0, content=7)         # leaves 3 blocks of content 7 cached
        admitted_order(scheduler)
        add(scheduler, 2, 13, 2, 1.0, content=9)         # no hit
        third = add(scheduler, 3, 13, 2, 1.1, content=7)  # 12 tokens cached
        assert admitted_order(scheduler) == expected, name
        hits[name] = third.prefix_hit_tokens
    assert hits == {"lpm": 12, "fcfs": 4}                # admitted second, 2 of its blocks were evicted


SMALL = ["model=llama3_8b", "gpu=a100_80g", "tensor_parallel_size=1", "max_model_len=2048",
         "kv_cache_memory_bytes=402653184", "plots=false", "cluster.num_replicas=1"]
SYNTHETIC = ["scenario=synthetic", "allocators=[paged]", "scenario.num_requests=300",
             "scenario.request_rate_per_s=40", "scenario.priority_classes=2", "scenario.input_tokens_mean=300"]


def compose(*overrides):
    from tests.conftest import compose_config
    return compose_config("run", list(overrides))


def whole_run(*overrides):
    from sim.run import run_all
    return run_all(compose(*overrides))[0]


def test_reordering_queues_give_the_step_by_step_results():
    for overrides in (["+experiment=golden", "queue_order=lpm", "allocators=[prefix]"],
                      [*SMALL, *SYNTHETIC, "queue_order=priority", "scenario.num_requests=150"]):
        default, stepped = (whole_run(*overrides, *extra).metrics for extra in ([], ["step_exact=true"]))
        for metrics in (default, stepped):  # the loop's time, and which loop ran and why
            metrics.pop("wall_time_s"), metrics.pop("engine")
        assert default == stepped, overrides


def test_priority_serves_the_urgent_class_first_under_load():
    from sim.run import build_workload
    result = whole_run(*SMALL, *SYNTHETIC, "queue_order=priority")
    priority = {r.request_id: r.priority for s in build_workload(compose(*SMALL, *SYNTHETIC), 0).sessions
                for r in s.turns}
    ttft = result.requests.set_index("request_id").ttft_s
    by_class = ttft.groupby(ttft.index.map(priority)).mean()
    assert by_class[0] < 0.5 * by_class[1]
