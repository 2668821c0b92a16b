"""Profile the compiled loop with Linux perf, its numba functions named.

    mkfifo /tmp/perf.ctl
    NUMBA_CACHE_DIR=$(mktemp -d) PERF_CTL=/tmp/perf.ctl perf record -D -1 --control fifo:/tmp/perf.ctl \\
        -o perf.data python benchmarks/perf_compiled.py prefix
    perf report -i perf.data --no-children --sort symbol -g none

Runs rag_agents_100k with one allocator (prefix or paged). perf samples only while `core.run`
runs (the control fifo turns it on and off around each call), and reads the compiled functions'
names from /tmp/perf-PID.map, written after the loop is compiled. A fresh NUMBA_CACHE_DIR makes
numba compile in this process: code loaded from its cache has no module to name functions from.
Functions numba inlines (`inline="always"` in core.py) count in their callers.

With PERF_CODE_DIR set to a folder, each compiled function's machine code is written there
too, for `perf_annotate.py` (samples per instruction of one function).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from bench_suite import measure, rag_agents  # noqa: E402

from sim.engine.compiled import core, driver  # noqa: E402


def readable_bytes(address: int, size: int) -> bytes:
    """This process's memory at address, as much of size as is mapped (a function's span in the
    map may run past the end of its library's code)."""
    with open("/proc/self/mem", "rb", buffering=0) as memory:
        while size > 0:
            try:
                return os.pread(memory.fileno(), size, address)
            except OSError:
                size //= 2
    return b""


def write_perf_map() -> int:
    """perf's map of the compiled loop's functions (address, size, name); returns how many."""
    addresses = []
    for compiled in core.run.overloads.values():
        library = compiled.library
        for function in library._final_module.functions:
            if not function.is_declaration:
                addresses.append((library.get_pointer_to_function(function.name), function.name))
    addresses = sorted(a for a in addresses if a[0])
    code_dir = os.environ.get("PERF_CODE_DIR")
    with open(f"/tmp/perf-{os.getpid()}.map", "w") as out:
        for (address, name), (following, _) in zip(addresses, [*addresses[1:], (addresses[-1][0] + 4096, "")]):
            out.write(f"{address:x} {following - address:x} {name.split('compiled')[-1][:80]}\n")
            if code_dir:  # the machine code itself, for perf_annotate.py
                with open(os.path.join(code_dir, f"{address:x}.bin"), "wb") as code:
                    code.write(readable_bytes(address, min(following - address, 1 << 18)))
    return len(addresses)


def sampled_only_in_the_loop(control: str | None) -> None:
    run = core.run

    def switched(*args):
        if control:
            with open(control, "w") as fifo:
                fifo.write("enable\n")
        try:
            return run(*args)
        finally:
            if control:
                with open(control, "w") as fifo:
                    fifo.write("disable\n")

    core.run = switched


def main() -> None:
    allocator = sys.argv[1] if len(sys.argv) > 1 else "prefix"
    if allocator not in ("prefix", "paged"):
        raise SystemExit("error: perf_compiled.py takes prefix or paged")
    driver.warm_up()
    if core.run.stats.cache_hits:
        raise SystemExit("error: the compiled loop came from numba's cache, which keeps no functions to "
                         "name; run with NUMBA_CACHE_DIR set to a new empty folder")
    print(f"mapped {write_perf_map()} compiled functions", file=sys.stderr)
    sampled_only_in_the_loop(os.environ.get("PERF_CTL"))
    print(f"{allocator}: loop {measure(allocator, rag_agents(25_000))['wall_s']:.2f} s")


if __name__ == "__main__":
    main()
