"""The block-sharing study: how much KV memory parallel sampling and beam search save when
sequences share blocks by reference count and copy a shared last block on write (PagedAttention,
Kwon et al. SOSP 2023, section 4.4 and Figure 15).

Per request, on its own block pool: the prompt is computed once; then
  parallel n: n samples fork from the prompt and each appends one token per step;
  beam w:     each step each of the w new beams picks a parent among the current beams (seeded),
              forks it (sharing all its blocks) and appends one token; the old beams are freed.
saving_frac = 1 - (physical blocks summed over steps) / (blocks summed over steps if every
sequence owned its own copy).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from sim.errors import ConfigError
from sim.kvcache.block import BlockAllocator
from sim.workload.sampling import lognormal_tokens

MODES = ("parallel", "beam")


@dataclass(frozen=True, slots=True)
class LengthSpec:
    input_tokens_mean: float
    output_tokens_mean: float


@dataclass(frozen=True, slots=True)
class SharingSpec:
    num_requests: int
    widths: tuple[int, ...]
    modes: tuple[str, ...]
    length_sigma: float
    max_total_tokens: int
    workloads: dict


class _Seq:
    __slots__ = ("seq_id", "request", "num_tokens", "final_len")

    def __init__(self, seq_id: int, num_tokens: int, final_len: int):
        self.seq_id, self.request, self.num_tokens, self.final_len = seq_id, None, num_tokens, final_len


def sharing_spec(values: dict) -> SharingSpec:
    try:
        spec = SharingSpec(
            num_requests=int(values["num_requests"]), widths=tuple(values["widths"]),
            modes=tuple(values["modes"]), length_sigma=float(values["length_sigma"]),
            max_total_tokens=int(values["max_total_tokens"]),
            workloads={name: LengthSpec(**lengths) for name, lengths in values["workloads"].items()})
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"incomplete sharing study config ({exc}), key sharing, "
                          f"see scenarios/experiment/sharing.yaml") from None
    unknown = [m for m in spec.modes if m not in MODES]
    if unknown or min(spec.widths, default=0) < 1:
        raise ConfigError(f"sharing modes must be {' or '.join(MODES)} and widths >= 1, "
                          f"key sharing, fix modes {list(spec.modes)} / widths {list(spec.widths)}")
    return spec


def block_usage(prompt_len: int, output_len: int, mode: str, width: int, block_size: int,
                rng: np.random.Generator) -> tuple[int, int]:
    """(physical, logical) blocks summed over the decode steps of one request."""
    final_len = prompt_len + output_len
    per_sequence = -(-final_len // block_size) + 1
    alloc = BlockAllocator(per_sequence * width * 2 + 4, block_size)
    next_id = iter(range(1 << 62)).__next__
    root = _Seq(next_id(), prompt_len, final_len)
    alloc.allocate(root, prompt_len)
    sequences = [root]
    if mode == "parallel":
        for _ in range(width - 1):
            child = _Seq(next_id(), prompt_len, final_len)
            alloc.fork(root, child)
            sequences.append(child)
    physical = logical = 0
    for _ in range(output_len):
        if mode == "beam":
            parents, sequences = sequences, []
            for _ in range(width):
                child = _Seq(next_id(), 0, final_len)
                alloc.fork(parents[int(rng.integers(len(parents)))], child)
                sequences.append(child)
            for parent in parents:
                alloc.free(parent)
        for seq in sequences:
            if alloc.allocate(seq, 1) is None:
                raise AssertionError("sharing study pool too small")
        physical += alloc.num_blocks - alloc.num_free_blocks
        logical += sum(len(alloc.tables[s.seq_id]) for s in sequences)
    return physical, logical


def run_sharing_study(spec: SharingSpec, block_size: int, seed: int) -> pd.DataFrame:
    rows = []
    streams = np.random.SeedSequence(seed).spawn(len(spec.workloads) * (1 + len(spec.modes) * len(spec.widths)))
    stream = iter(streams)
    for workload, lengths in spec.workloads.items():
        rng = np.random.default_rng(next(stream))
        inputs = lognormal_tokens(rng, lengths.input_tokens_mean, spec.length_sigma, spec.num_requests)
        outputs = lognormal_tokens(rng, lengths.output_tokens_mean, spec.length_sigma, spec.num_requests)
        inputs = np.minimum(inputs, spec.max_total_tokens - 1)
        outputs = np.minimum(outputs, spec.max_total_tokens - inputs)
        for mode in spec.modes:
            for width in spec.widths:
                choices = np.random.default_rng(next(stream))
                physical = logical = 0
                for prompt_len, output_len in zip(inputs.tolist(), outputs.tolist()):
                    p, q = block_usage(prompt_len, output_len, mode, width, block_size, choices)
                    physical, logical = physical + p, logical + q
                rows.append({"workload": workload, "mode": mode, "width": width,
                             "saving_frac": 1.0 - physical / logical,
                             "physical_block_steps": physical, "logical_block_steps": logical})
    return pd.DataFrame(rows)
