"""Where a router looks up how much of a prompt each replica holds cached.

precise: the replica's own cache (ReplicaView.cached_prefix_tokens), as llm-d's precise
prefix-cache scorer learns it from the engines' KV events. approximate: the router's own record of
the prompts it sent to each replica (SGLang's router tree), in blocks of block_size tokens, the
least recently routed dropped past capacity_tokens per replica (null: never); it never learns of
an engine's evictions, so it may send a request to a replica that has since dropped its prefix.
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import takewhile

from sim.errors import ConfigError

PREFIX_INDEXES = ("precise", "approximate")


class PrefixIndex:
    def __init__(self, kind: str = "precise", block_size: int = 16, capacity_tokens: int | None = None):
        if kind not in PREFIX_INDEXES:
            raise ConfigError(f"unknown prefix index '{kind}', key router.index, use precise or approximate")
        if block_size < 1 or (capacity_tokens is not None and capacity_tokens < block_size):
            raise ConfigError(f"router.block_size={block_size}, router.index_capacity_tokens={capacity_tokens}: "
                              f"need block_size >= 1 and a capacity of at least one block (or null), "
                              f"key router.index_capacity_tokens, raise it or set null")
        self.precise = kind == "precise"
        self.block_size = block_size
        self._capacity_blocks = None if capacity_tokens is None else capacity_tokens // block_size
        self._routed: list[OrderedDict] = []  # per replica: block keys sent there, oldest first

    def matched_tokens(self, replicas, request) -> list[int]:
        """Per replica, the leading tokens of request's prompt it holds (by this index)."""
        if self.precise:
            return [replica.cached_prefix_tokens(request) for replica in replicas]
        while len(self._routed) < len(replicas):
            self._routed.append(OrderedDict())
        keys = self._keys(request)
        return [sum(1 for _ in takewhile(routed.__contains__, keys)) * self.block_size
                for routed in self._routed]

    def record(self, replica: int, request) -> None:
        """The request went to replica: its prompt's blocks are (the most recently) there."""
        if self.precise:
            return
        routed = self._routed[replica]
        for key in self._keys(request):
            routed[key] = None
            routed.move_to_end(key)
        if self._capacity_blocks is not None:
            while len(routed) > self._capacity_blocks:
                routed.popitem(last=False)

    def _keys(self, request) -> list[int]:
        return request.prefix_keys(self.block_size, 0, (request.prompt_len - 1) // self.block_size)
