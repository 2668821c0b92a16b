"""A progress bar for a simulation: requests done of all, simulated time, requests per wall
second and ETA (tqdm). It appears only on a terminal and only after two seconds, so short runs,
tests and CI logs stay quiet; `progress=false` turns it off."""
from __future__ import annotations

import sys
from contextlib import contextmanager


class _Quiet:
    def advance(self, now: float) -> None:
        pass


class _Bar:
    def __init__(self, bar):
        self.bar = bar
        self._count = 0

    def advance(self, now: float) -> None:
        self._count += 1
        if self._count % 64 == 0:  # keep the per-request cost to an increment
            self.bar.update(64)
            self.bar.set_postfix_str(f"sim {now:,.0f} s", refresh=False)

    def close(self) -> None:
        self.bar.update(self._count % 64)


@contextmanager
def progress_bar(show: bool, total: int, label: str, file=None, delay_s: float = 2.0):
    """Yields an object whose advance(now) counts one request done (served or rejected)."""
    if not show:
        yield _Quiet()
        return
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    bar = tqdm(total=total, desc=label, unit="req", file=stream, delay=delay_s, leave=False,
               dynamic_ncols=True, disable=None if file is None else False)
    wrapper = _Bar(bar)
    try:
        yield wrapper
        wrapper.close()
    finally:
        bar.close()
