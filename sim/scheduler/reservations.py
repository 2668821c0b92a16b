"""guaranteed_no_evict's book (TensorRT-LLM's GUARANTEED_NO_EVICT capacity policy): what each
admitted sequence may hold on its way to completion, per pool of the allocator, so that a
request is admitted only when every admitted one can finish without a preemption.

The allocator says what a sequence needs (`completion_need`: the most it holds up to its final
length, a step adding at most step_tokens tokens; `fork_need`: what each further sample of it
holds beyond the blocks it shares) and what each pool holds (`completion_capacity`). A request
of n samples reserves its other samples' shares at admission; each share moves to its sample at
the fork, or is given back when the sample waits to recompute its prompt. A request whose
samples alone need more than the pool is admitted when nothing else is, and may preempt its own
samples (counted as any preemption).
"""
from __future__ import annotations

TOLERANCE = 1e-6  # (hybrid pools count bytes in floats)


class Reservations:
    def __init__(self, allocator, step_tokens: int):
        self.allocator, self.step_tokens = allocator, step_tokens
        self.capacity = list(allocator.completion_capacity)
        self.total = [0.0] * len(self.capacity)
        self.held: dict[int, list[float]] = {}  # by id(sequence)

    def need(self, seq) -> list[float]:
        """seq's need to completion, with its other samples' shares while it has not forked."""
        need = self.allocator.completion_need(seq, self.step_tokens)
        if seq.request.n > 1 and seq.sample_index == 0 and seq.num_output == 0:
            share = self.allocator.fork_need(seq, self.step_tokens)
            need = [own + (seq.request.n - 1) * each for own, each in zip(need, share)]
        return need

    def fits(self, seq) -> bool:
        """Whether seq's need fits beside every reservation; with none held, always (a request
        whose samples alone need more than the pool runs by itself rather than never)."""
        if not self.held:
            return True
        return all(t + n <= c + TOLERANCE for t, n, c in zip(self.total, self.need(seq), self.capacity))

    def take(self, seq) -> None:
        need = self.held[id(seq)] = self.need(seq)
        self.total = [t + n for t, n in zip(self.total, need)]

    def release(self, seq) -> None:
        need = self.held.pop(id(seq), None)
        if need is not None:
            self.total = [t - n for t, n in zip(self.total, need)]

    def fork(self, parent, sample, shares: bool) -> None:
        """A sample forked off parent takes its share (shares: it holds blocks now), or the share
        is given back (it waits to be admitted, or finished with its parent)."""
        share = self.allocator.fork_need(parent, self.step_tokens)
        self.held[id(parent)] = [h - s for h, s in zip(self.held[id(parent)], share)]
        if shares:
            self.held[id(sample)] = share
        else:
            self.total = [t - s for t, s in zip(self.total, share)]
