"""Routers (sim/router/) on hand-made replica views, and in whole runs."""
import pytest

from sim.errors import ConfigError
from sim.router.least_loaded import LeastLoaded
from sim.router.prefix_aware import PrefixAware
from sim.router.random_choice import RandomChoice
from sim.router.round_robin import RoundRobin
from sim.router.session_affinity import SessionAffinity
from sim.router.view import StaleReplicaView
from sim.router.weighted import WeightedScorer
from sim.run import run_all
from sim.workload.request import PrefixInterner, make_request

INTERNER = PrefixInterner()


def request(request_id, segments, session_id=None):
    return make_request(INTERNER, request_id, segments, 10, 10_000 + request_id,
                        session_id=request_id if session_id is None else session_id)


class View:
    """A replica as a router sees it: fixed loads and cached prompt prefixes (by content id)."""

    def __init__(self, index, requests=0, waiting=0, queued_tokens=0, kv_use=0.0, cached=()):
        self.index, self.cached = index, dict(cached)
        self.loads = {"requests": requests, "waiting": waiting, "queued_tokens": queued_tokens, "kv_use": kv_use}

    def load(self, metric):
        return self.loads[metric]

    def cached_prefix_tokens(self, req):
        return self.cached.get(req.segments[0][0], 0)


def test_round_robin_cycles_and_random_is_seeded_and_uniform():
    views = [View(i) for i in range(3)]
    robin = RoundRobin()
    assert [robin(views, request(i, [(1, 10)])) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    picks = [RandomChoice(seed=5)(views, request(0, [(1, 10)])) for _ in range(3)]
    assert len(set(picks)) == 1  # a fresh router from the same seed draws the same first replica
    router = RandomChoice(seed=5)
    draws = [router(views, request(i, [(1, 10)])) for i in range(3000)]
    assert all(900 < draws.count(r) < 1100 for r in range(3))


@pytest.mark.parametrize("metric, expected", [("requests", 2), ("queued_tokens", 0), ("kv_use", 1)])
def test_least_loaded_reads_the_metric_it_is_given(metric, expected):
    views = [View(0, requests=5, queued_tokens=100, kv_use=0.9),
             View(1, requests=4, queued_tokens=900, kv_use=0.1),
             View(2, requests=3, queued_tokens=500, kv_use=0.5)]
    assert LeastLoaded(metric)(views, request(0, [(1, 10)])) == expected


def test_least_loaded_breaks_ties_by_lowest_index_and_rejects_unknown_metrics():
    assert LeastLoaded()([View(0, requests=2), View(1, requests=1), View(2, requests=1)], request(0, [(1, 5)])) == 1
    with pytest.raises(ConfigError, match="router.metric"):
        LeastLoaded("tokens")


def test_session_affinity_keeps_a_session_where_its_first_turn_went():
    views = [View(0, requests=3), View(1, requests=1)]
    router = SessionAffinity()
    assert router(views, request(1, [(1, 10)], session_id=7)) == 1
    views[1].loads["requests"] = 50  # now busy: later turns of session 7 still go there
    assert router(views, request(2, [(1, 10)], session_id=7)) == 1
    assert router(views, request(3, [(1, 10)], session_id=8)) == 0


def test_prefix_aware_follows_the_longest_cached_prefix_above_the_threshold():
    views = [View(0, requests=1), View(1, requests=9, cached={1: 64}), View(2, requests=9, cached={1: 32})]
    router = PrefixAware(cache_threshold=0.3)
    assert router(views, request(1, [(1, 100)])) == 1            # 64 of 100 tokens cached there
    assert router(views, request(2, [(1, 300)])) == 0            # 64 of 300: below 0.3, least loaded
    assert router(views, request(3, [(2, 100)])) == 0            # nothing cached anywhere


def test_prefix_aware_balances_when_loads_are_imbalanced_by_both_thresholds():
    cached = {1: 90}
    busy = [View(0, requests=10), View(1, requests=80, cached=cached)]
    assert PrefixAware()(busy, request(1, [(1, 100)])) == 0      # 70 apart (> 64) and 8 x (> 1.5 x)
    close = [View(0, requests=100), View(1, requests=160, cached=cached)]
    assert PrefixAware()(close, request(1, [(1, 100)])) == 1     # 60 apart: not imbalanced


def test_prefix_aware_approximate_index_remembers_what_it_routed_and_forgets_past_capacity():
    views = [View(0), View(1)]
    router = PrefixAware(index="approximate", block_size=16, index_capacity_tokens=160)
    first = router(views, request(1, [(5, 161)]))               # nothing known: least loaded, replica 0
    views[0].loads["requests"] = 1
    assert first == 0 and router(views, request(2, [(5, 161), (6, 40)])) == 0  # its 10 blocks are there
    router(views, request(3, [(7, 161)]))                        # replica 1 (less loaded)
    views[1].loads["requests"] = 1
    router(views, request(4, [(8, 161)]))                        # tie at 1: replica 0, evicting prompt 5
    assert router.index.matched_tokens(views, request(9, [(5, 161)])) == [0, 0]


def test_weighted_scorer_adds_prefix_and_queue_scores_and_draws_ties_at_random():
    views = [View(0, waiting=0), View(1, waiting=4, cached={1: 100}), View(2, waiting=2)]
    router = WeightedScorer(prefix_weight=3, queue_weight=2, seed=0)
    assert router(views, request(1, [(1, 100)])) == 1            # 3 x 1.0 + 2 x 0 beats 2 x 1.0
    assert router(views, request(2, [(2, 100)])) == 0            # no prefix anywhere: shortest queue
    even = [View(i) for i in range(4)]
    picks = {router(even, request(3 + i, [(3, 10)])) for i in range(40)}
    assert picks == {0, 1, 2, 3}                                 # all tied: not always the first
    with pytest.raises(ConfigError):
        WeightedScorer(prefix_weight=0, queue_weight=0)


class Clock:
    now = 0.0


class Scheduler:
    load, num_waiting, queued_tokens = 0, 0, 0


class Replica:
    def __init__(self):
        self.index, self.scheduler = 0, Scheduler()


def test_a_stale_view_shows_loads_as_of_its_last_refresh():
    clock, replica = Clock(), Replica()
    view = StaleReplicaView(replica, clock, staleness_s=1.0)
    assert view.load("requests") == 0
    replica.scheduler.load = 5
    clock.now = 0.9
    assert view.load("requests") == 0          # refreshed at 0.0, 0.9 s old
    clock.now = 1.0
    assert view.load("requests") == 5


def prefix_runs(*overrides):
    base = ["allocators=[prefix]", "cluster.num_replicas=4", "scenario.num_sessions=80",
            "kv_cache_memory_bytes=805306368", *overrides]
    return {r.allocator: r.metrics for r in run_all(golden(*base))}["prefix"]


def golden(*overrides):
    from tests.conftest import compose_config
    return compose_config("run", ["+experiment=golden", *overrides])


def test_cache_aware_routers_raise_the_hit_rate_over_cache_blind_ones():
    blind = prefix_runs("router=round_robin")["prefix_cache"]["hit_rate"]
    for router in ("router=prefix_aware", "router=prefix_aware router.index=approximate", "router=weighted"):
        aware = prefix_runs(*router.split())["prefix_cache"]["hit_rate"]
        assert aware > blind + 0.05, router


def test_routers_that_read_the_kv_pools_give_the_step_by_step_results():
    """They run replicas step by step; so does step_exact=true: both give the same metrics."""
    for router in ("router=prefix_aware", "router=least_loaded router.metric=kv_use"):
        stepped = prefix_runs(*router.split(), "step_exact=true")
        default = prefix_runs(*router.split())
        for metrics in (default, stepped):  # the loop's time, and which loop ran and why
            metrics.pop("wall_time_s"), metrics.pop("engine")
        assert stepped == default


def test_stale_loads_herd_a_burst_onto_one_replica():
    live = prefix_runs("router=least_loaded")["routing"]
    stale = prefix_runs("router=least_loaded", "cluster.router_staleness_s=30")["routing"]
    assert stale["busiest_over_mean_finished_requests"] > live["busiest_over_mean_finished_requests"]


def test_with_room_for_every_prefix_cache_aware_routing_nears_the_traces_ideal_hit_ratio():
    """The Mooncake conversation sample's ideal prefix hit ratio (every earlier block kept, one
    cache: trace-stats, counted from the hash ids) is what one replica with room for everything
    would reach; spread over 4 replicas by load the hit rate falls (the issue measured 0.189 of the
    whole trace's 0.3736 with least_loaded); routing by prefix brings it back."""
    from sim.workload.stats import trace_stats
    from sim.workload.trace import TraceSpec
    ideal = trace_stats(TraceSpec(path="sample:mooncake"), 0)["ideal_prefix_hit_rate"]

    def hit_rate(router):
        from tests.conftest import compose_config
        cfg = compose_config("run", ["scenario=trace", "trace.path=sample:mooncake", "model=llama31_8b",
                                     "tensor_parallel_size=1", "allocators=[prefix]", "cluster.num_replicas=4",
                                     "gpu=h200", "kv_cache_memory_bytes=1000000000000", "plots=false", *router])
        return run_all(cfg)[0].metrics["prefix_cache"]["hit_rate"]
    blind = hit_rate(["router=least_loaded"])
    aware = hit_rate(["router=prefix_aware", "router.index=approximate"])
    assert blind < 0.6 * ideal
    assert 0.95 * ideal <= aware <= ideal


def test_a_stale_cache_view_follows_the_kv_events_staleness_late():
    from sim.kvcache.block import BlockAllocator
    from sim.kvcache.contiguous import ContiguousAllocator
    from sim.kvcache.radix import RadixAllocator
    from sim.router.view import DelayedCacheIndex
    from sim.scheduler import Sequence
    clock, alloc = Clock(), BlockAllocator(4, 4, enable_caching=True)
    index = DelayedCacheIndex(alloc, clock, staleness_s=1.0)
    first = Sequence(request(1, [(7, 13)]), 0.0, 64)
    alloc.allocate(first, 13)                                    # t = 0: 3 full blocks keyed
    alloc.free(first)
    probe = request(2, [(7, 13)])
    clock.now = 0.5
    assert index.cached_prefix_tokens(probe) == 0                # not reported yet
    clock.now = 1.0
    assert index.cached_prefix_tokens(probe) == 12
    clock.now = 2.0
    alloc.allocate(Sequence(request(3, [(8, 16)]), 0.0, 64), 16)  # evicts all three
    clock.now = 2.5
    assert index.cached_prefix_tokens(probe) == 12 and alloc.cached_prefix_tokens(probe) == 0
    clock.now = 3.0
    assert index.cached_prefix_tokens(probe) == 0
    with pytest.raises(ConfigError, match="router_staleness_s"):
        DelayedCacheIndex(RadixAllocator(16, 4), clock, 1.0)
    assert DelayedCacheIndex(ContiguousAllocator(64, 64), clock, 1.0).cached_prefix_tokens(probe) == 0


def test_a_router_reading_stale_kv_events_finds_fewer_prefixes_than_a_live_one():
    from tests.test_tiers import mooncake_sample
    rates = [run_all(mooncake_sample("router=prefix_aware", f"cluster.router_staleness_s={s}"))[0]
             .metrics["prefix_cache"]["hit_rate"] for s in (0, 60)]
    assert rates[1] < rates[0]
