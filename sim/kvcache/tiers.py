"""KV tiers below HBM: a per-replica CPU tier, a per-replica disk tier and a cluster-wide shared
store (Mooncake Store / LMCache style). Mechanism only: which block keys each tier holds, what a
prefix hit there costs to load, and the counts metrics report.

    HBM evicts a cached block ──► CPU ──(overflow)──► disk ──(overflow)──► dropped
    a block computed (keyed) ──► every write-through tier (the shared store by default)

A tier holds keys of full blocks (sim.workload.request's packed prefix keys), least recently
used dropped past its capacity (`lru`) or oldest written (`fifo`). A prefix lookup that misses in
HBM continues through the tiers, block by block, taking each from the fastest tier holding it (by
the time to load 64 blocks: with the defaults CPU, then the shared store, then disk); the
blocks found there are loaded into newly allocated HBM blocks: each rank moves its share of their
KV over the tier's link (CPU: the GPU's host link as calibrated; disk and shared store: the given
bandwidth and latency per replica), the tiers one after another. Loads are timed in the step that
admits the request (sim.latency's `kv_load`); with overlap they run beside that step's GPU work
(layer by layer, as vLLM's KV connector loads) and cost only what exceeds it. Writes to the tiers
are asynchronous and not timed (vLLM's offloading connector and LMCache store in the background).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sim.errors import ConfigError

TIER_NAMES = ("cpu", "disk", "shared")
TIER_SIZE_KEYS = ("cpu_gib", "disk_gib", "shared_gib")  # kv_offload.*: a size above 0 turns its tier on


def tiers_enabled(offload) -> bool:
    """Whether any tier is on, for an OffloadSpec or the kv_offload config node alike."""
    return any(getattr(offload, key) for key in TIER_SIZE_KEYS)
TIER_EVICTIONS = ("lru", "fifo")
GiB = 2**30


@dataclass(frozen=True, slots=True)
class OffloadSpec:
    """`kv_offload.*` (scenarios/run.yaml): sizes 0 = off."""
    cpu_gib: float = 0.0                  # per replica
    disk_gib: float = 0.0                 # per replica
    shared_gib: float = 0.0               # the whole cluster
    pool_cpu: bool = False                # the replicas' CPU tiers pooled into the shared store
    local_write_through: bool = False     # CPU and disk: written when computed (else on eviction)
    shared_write_through: bool = True     # as Mooncake Store and LMCache write
    overlap_load: bool = True             # loads beside the step's GPU work (vLLM's KV connector)
    eviction: str = "lru"
    disk_bandwidth_gb_per_s: float = 6.0  # per replica: one PCIe 4.0 x4 NVMe drive's reads
    disk_latency_s: float = 1e-4
    network_bandwidth_gb_per_s: float = 50.0  # per GPU: one 400 Gb/s NIC per GPU (DGX H100, Mooncake's nodes)
    network_latency_s: float = 2e-5

    def __post_init__(self):
        sizes = {"cpu_gib": self.cpu_gib, "disk_gib": self.disk_gib, "shared_gib": self.shared_gib}
        for key, value in {**sizes, "disk_bandwidth_gb_per_s": self.disk_bandwidth_gb_per_s,
                           "network_bandwidth_gb_per_s": self.network_bandwidth_gb_per_s,
                           "disk_latency_s": self.disk_latency_s, "network_latency_s": self.network_latency_s}.items():
            if value < 0 or (key.endswith("per_s") and value == 0):
                raise ConfigError(f"kv_offload.{key}={value} is {'negative' if value < 0 else '0'}, "
                                  f"key kv_offload.{key}, give a positive number (sizes: 0 turns a tier off)")
        if self.eviction not in TIER_EVICTIONS:
            raise ConfigError(f"unknown kv_offload.eviction '{self.eviction}', key kv_offload.eviction, "
                              f"use lru or fifo")

    @property
    def enabled(self) -> bool:
        return tiers_enabled(self)

    def shared_store_gib(self, num_replicas: int) -> float:
        """The shared store's size: shared_gib, plus every replica's CPU tier when pool_cpu
        (Mooncake Store pools its nodes' DRAM into one store)."""
        return self.shared_gib + (self.cpu_gib * num_replicas if self.pool_cpu else 0.0)


class Tier:
    """Block keys one tier holds, and what was written, dropped and read."""

    def __init__(self, name: str, capacity_blocks: int, eviction: str):
        self.name, self.capacity_blocks, self.lru = name, capacity_blocks, eviction == "lru"
        self.keys: OrderedDict[int, None] = OrderedDict()
        self.num_written_blocks = self.num_dropped_blocks = self.num_hit_blocks = 0

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def put(self, key: int) -> int | None:
        """Hold key (the most recent); returns the key dropped to make room, if any."""
        keys = self.keys
        if key in keys:
            if self.lru:
                keys.move_to_end(key)
            return None
        self.num_written_blocks += 1
        keys[key] = None
        if len(keys) > self.capacity_blocks:
            self.num_dropped_blocks += 1
            return keys.popitem(last=False)[0]
        return None

    def read(self, key: int) -> None:
        self.num_hit_blocks += 1
        if self.lru:
            self.keys.move_to_end(key)


class TierChain:
    """One replica's view of the tiers: its own CPU and disk tiers and the cluster's shared store
    (one object for all replicas), fastest first, with the timing of their loads."""

    def __init__(self, spec: OffloadSpec, block_bytes: float, ranks: int, host_load_s, shared: Tier | None):
        self.spec = spec
        local_cpu_gib = 0.0 if spec.pool_cpu else spec.cpu_gib  # pooled: part of the shared store
        self.local: list[Tier] = [Tier(name, int(gib * GiB // block_bytes), spec.eviction)
                                  for name, gib in (("cpu", local_cpu_gib), ("disk", spec.disk_gib)) if gib]
        self.shared = shared
        self.block_bytes, self.block_bytes_per_rank = block_bytes, block_bytes / ranks
        self._host_load_s = host_load_s  # blocks -> seconds over the host link (calibrated)
        # Lookups take a block from the fastest tier holding it: tiers by the time to load 64 blocks.
        self.tiers = sorted([*self.local, *([shared] if shared is not None else [])],
                            key=lambda tier: self._transfer_s(tier.name, 64))
        self.pending_load_s = 0.0        # loads of admissions in the step being planned
        self.load_s_total = 0.0
        self.num_loaded_blocks = dict.fromkeys((t.name for t in self.tiers), 0)

    @property
    def writes_through(self) -> bool:
        return bool(self.spec.local_write_through and self.local) or bool(
            self.shared is not None and self.spec.shared_write_through)

    # -- writes --------------------------------------------------------------------------------
    def evicted(self, key: int) -> None:
        """HBM dropped key: it goes down the local tiers (or to the shared store, if that is not
        written through); what overflows the last tier is dropped."""
        if self.spec.local_write_through:  # the local tiers hold it already, or dropped it
            return
        for tier in self.local:
            key = tier.put(key)
            if key is None:
                return
        if self.shared is not None and not self.spec.shared_write_through:
            self.shared.put(key)

    def computed(self, keys) -> None:
        """Blocks keyed in HBM: written to every write-through tier."""
        targets = [*(self.local if self.spec.local_write_through else ()),
                   *((self.shared,) if self.shared is not None and self.spec.shared_write_through else ())]
        for tier in targets:
            for key in keys:
                tier.put(key)

    # -- reads ---------------------------------------------------------------------------------
    def extend(self, keys) -> tuple[int, ...]:
        """Blocks per tier (in self.tiers' order) of the longest run of keys that the tiers hold,
        each from the fastest tier holding it."""
        counts = [0] * len(self.tiers)
        for key in keys:
            for index, tier in enumerate(self.tiers):
                if key in tier:
                    counts[index] += 1
                    break
            else:
                break
        return tuple(counts) if any(counts) else ()

    def local_run(self, keys) -> int:
        """Leading keys this replica's own tiers hold (what a router counts as its cache)."""
        found = 0
        for key in keys:
            if not any(key in tier for tier in self.local):
                break
            found += 1
        return found

    def load(self, keys) -> None:
        """An admission takes these keys from the tiers (as extend found them): count, refresh,
        and add their transfer to the step being planned."""
        counts = [0] * len(self.tiers)
        for key in keys:
            for index, tier in enumerate(self.tiers):
                if key in tier:
                    tier.read(key)
                    counts[index] += 1
                    break
        seconds = 0.0
        for tier, count in zip(self.tiers, counts):
            if count:
                self.num_loaded_blocks[tier.name] += count
                seconds += self._transfer_s(tier.name, count)
        self.pending_load_s += seconds
        self.load_s_total += seconds

    def _transfer_s(self, name: str, blocks: int) -> float:
        if name == "cpu":
            return self._host_load_s(blocks)
        if name == "disk":  # one drive per replica
            return self.spec.disk_latency_s + blocks * self.block_bytes / (self.spec.disk_bandwidth_gb_per_s * 1e9)
        per_rank = blocks * self.block_bytes_per_rank  # a NIC per GPU
        return self.spec.network_latency_s + per_rank / (self.spec.network_bandwidth_gb_per_s * 1e9)

    def consume_load_s(self) -> float:
        """The loads of the step just planned (and reset for the next)."""
        seconds, self.pending_load_s = self.pending_load_s, 0.0
        return seconds
