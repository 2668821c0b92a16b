"""Small builders shared by the tests."""
from __future__ import annotations

import math

from sim.workload.request import PrefixInterner, make_request

_interner = PrefixInterner()


class Seq:
    """The attributes an allocator reads from a sequence."""

    def __init__(self, seq_id, request, num_tokens=None, final_len=None):
        self.seq_id = seq_id
        self.request = request
        self.num_tokens = request.prompt_len if num_tokens is None else num_tokens
        self.final_len = final_len if final_len is not None else request.prompt_len + request.output_len


def request(request_id: int, segments, output_len: int = 8, **extra):
    return make_request(_interner, request_id, segments, output_len, 10_000 + request_id, **extra)


def seq(seq_id: int, segments, output_len: int = 8, **kwargs) -> Seq:
    return Seq(seq_id, request(seq_id, segments, output_len), **kwargs)


def predicted(tmp_path, rows: list[dict], gpu: str = "a100_80g"):
    """`python -m calibration predict gpu=... shapes=... out=...` on rows (dicts of an op and its
    shape columns), in process: the rows back with time_s, as a DataFrame."""
    import pandas as pd
    from omegaconf import OmegaConf

    from calibration.commands import predict_task
    shapes, out = tmp_path / "shapes.csv", tmp_path / "out.csv"
    pd.DataFrame(rows).to_csv(shapes, index=False)
    predict_task(OmegaConf.create({"gpu": gpu, "shapes": str(shapes), "out": str(out)}))
    return pd.read_csv(out)


def differing(first: dict, second: dict) -> list[str]:
    """Keys of two flattened metrics dicts whose values differ; a statistic of nothing (NaN,
    sim.metrics.NO_DATA) equals another."""
    def same(a, b):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return sorted(k for k in first.keys() | second.keys() if not same(first.get(k), second.get(k)))
