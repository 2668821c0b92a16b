"""Where a contiguous reservation goes in a linear address space of token slots.

`FirstFit`: the lowest free hole that is long enough; holes coalesce on release.
`Buddy` (as the PagedAttention paper's contiguous baselines, Kwon et al. SOSP 2023 section 6.1):
extents are power-of-two sized and aligned; a free block splits in halves on demand and merges
with its buddy on release. The space is cut into power-of-two chunks, largest first, so every
chunk is aligned to its own size and start ^ size always names a block's buddy.

    first fit: [ used ][ hole 40 ][ used ][ hole 10 ]     need 30 -> the 40 hole
    buddy:     order-3 [0 .. 8) splits into [0 .. 4) + [4 .. 8); [4 .. 8) frees and rejoins [0 .. 4)
"""
from __future__ import annotations

from bisect import bisect_left, insort


class FirstFit:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.hole_starts: list[int] = [0] if num_slots else []
        self.hole_lengths: dict[int, int] = {0: num_slots} if num_slots else {}

    def extent_length(self, length: int) -> int:
        return length

    def place(self, length: int) -> tuple[int, int] | None:
        for start in self.hole_starts:
            if self.hole_lengths[start] >= length:
                self._take(start, length)
                return start, length
        return None

    def release(self, start: int, length: int) -> None:
        index = bisect_left(self.hole_starts, start)
        if index < len(self.hole_starts) and self.hole_starts[index] == start + length:
            length += self.hole_lengths.pop(self.hole_starts.pop(index))
        if index > 0:
            prev = self.hole_starts[index - 1]
            if prev + self.hole_lengths[prev] == start:
                self.hole_lengths[prev] += length
                return
        self.hole_starts.insert(index, start)
        self.hole_lengths[start] = length

    def holes(self) -> list[tuple[int, int]]:
        return [(s, self.hole_lengths[s]) for s in self.hole_starts]

    def unusable_slots(self, length: int) -> int:
        """Free slots that cannot hold an extent of `length` (external fragmentation)."""
        return sum(n for n in self.hole_lengths.values() if n < length)

    def _take(self, start: int, length: int) -> None:
        hole = self.hole_lengths.pop(start)
        index = bisect_left(self.hole_starts, start)
        if hole == length:
            del self.hole_starts[index]
        else:
            self.hole_starts[index] = start + length
            self.hole_lengths[start + length] = hole - length


class Buddy:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_by_order: dict[int, list[int]] = {}
        start = 0
        for order in range(num_slots.bit_length() - 1, -1, -1):
            if num_slots & (1 << order):
                self.free_by_order.setdefault(order, []).append(start)
                start += 1 << order

    def extent_length(self, length: int) -> int:
        return 1 << max(0, length - 1).bit_length()

    def place(self, length: int) -> tuple[int, int] | None:
        order = max(0, length - 1).bit_length()
        source = next((o for o in sorted(self.free_by_order) if o >= order and self.free_by_order[o]), None)
        if source is None:
            return None
        start = self.free_by_order[source].pop(0)
        while source > order:  # split, keeping the lower half, freeing the upper
            source -= 1
            insort(self.free_by_order.setdefault(source, []), start + (1 << source))
        return start, 1 << order

    def release(self, start: int, length: int) -> None:
        order = length.bit_length() - 1
        while True:
            buddy = start ^ (1 << order)
            free = self.free_by_order.get(order, [])
            index = bisect_left(free, buddy)
            if index < len(free) and free[index] == buddy:
                del free[index]
                start = min(start, buddy)
                order += 1
            else:
                insort(self.free_by_order.setdefault(order, []), start)
                return

    def holes(self) -> list[tuple[int, int]]:
        return sorted((s, 1 << o) for o, starts in self.free_by_order.items() for s in starts)

    def unusable_slots(self, length: int) -> int:
        order = max(0, length - 1).bit_length()
        return sum(len(starts) << o for o, starts in self.free_by_order.items() if o < order)


PLACEMENTS = {"first_fit": FirstFit, "buddy": Buddy}
