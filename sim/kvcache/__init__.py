"""KV-cache allocators: mechanism only, no SimPy, no policy imports.

Every allocator answers the same ask-then-act calls:

    lookup_prefix(seq)                 -> PrefixHit (0 tokens when nothing is cached)
    cached_prefix_tokens(request)      -> tokens of a new request's prompt lookup_prefix would find
                                          now (for routers; keeps nothing)
    allocate(seq, num_new_tokens, hit, full_tokens, watermark)
                                       -> tuple of new block ids / extents, or None if it does not fit
                                          (full_tokens and watermark gate an admission, as vLLM v1)
    free(seq)
    usage(first_waiting)               -> KVUsage, the memory breakdown of DESIGN.md
    state_bytes()                      -> host memory the allocator's state may grow to (an estimate
                                          used to refuse clusters too large for the machine)

and, for decode stretches (sim.scheduler.scheduler):

    decode_steps_that_fit(seqs, limit) -> the most steps (<= limit) whose one-token-each decode
                                          allocations all succeed, the first already made
    decode_rounds(seqs, steps, first_waiting)
                                       -> `steps` rounds of usage() then allocate(seq, 1) per seq,
                                          the usages as an array of KVUsage.as_tuple() rows
    admission_stays_blocked(full_sequence_reserved)
                                       -> whether an admission refused for memory stays refused
                                          while running sequences only decode

A lookup changes nothing; the blocks (or tree path) of a hit count their hit when allocate takes
them.

`seq` is any object with `seq_id`, `request` (for prefix keys), `num_tokens` (tokens known so
far) and `final_len` (L = min(prompt + output, max_model_len)).
"""
from sim.kvcache.base import NO_HIT, KVUsage, PrefixHit

__all__ = ["KVUsage", "PrefixHit", "NO_HIT"]
