"""Samples per instruction of one compiled function, from a perf_compiled.py recording.

    PERF_CODE_DIR=/tmp/code ... perf record ... python benchmarks/perf_compiled.py prefix
    perf script -i perf.data -F ip > ips.txt
    python benchmarks/perf_annotate.py /tmp/code ips.txt _schedule [--top 40] [--map /tmp/perf-PID.map]

Prints the function's disassembly (objdump) with each instruction's share of the function's
samples, and the hottest instructions. perf attributes a sample to the instruction after the
one that stalled more often than not, so read a hot line with its neighbour above.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess


def functions(code_dir: str, map_path: str) -> list[tuple[int, int, str]]:
    """(address, size, name) of the compiled functions whose code was written, from the perf map."""
    rows = []
    with open(map_path) as perf_map:
        for line in perf_map:
            address, size, name = line.split(maxsplit=2)
            if os.path.exists(os.path.join(code_dir, f"{address}.bin")):
                rows.append((int(address, 16), int(size, 16), name.strip()))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("code_dir")
    parser.add_argument("ips")
    parser.add_argument("function", help="part of the function's name, e.g. _schedule")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--map", help="perf's map file (default: the newest /tmp/perf-*.map)")
    args = parser.parse_args(argv)
    map_path = args.map or max(glob.glob("/tmp/perf-*.map"), key=os.path.getmtime, default=None)
    if not map_path:
        raise SystemExit("error: no perf map (/tmp/perf-PID.map); record with perf_compiled.py first")
    pattern = re.compile(r"\d+" + re.escape(args.function) + r"B")
    chosen = [f for f in functions(args.code_dir, map_path) if pattern.search(f[2])]
    if not chosen:
        raise SystemExit(f"error: no compiled function named like {args.function!r} in the perf map")
    address, size, name = max(chosen, key=lambda f: f[1])
    counts = collections.Counter()
    with open(args.ips) as ips:
        for line in ips:
            ip = int(line.split()[0], 16)
            if address <= ip < address + size:
                counts[ip] += 1
    total = sum(counts.values()) or 1
    listing = subprocess.run(
        ["objdump", "-D", "-b", "binary", "-mi386:x86-64", f"--adjust-vma={address:#x}",
         os.path.join(args.code_dir, f"{address:x}.bin")], capture_output=True, text=True, check=True).stdout
    lines = []
    for line in listing.splitlines():
        match = re.match(r"\s+([0-9a-f]+):\t", line)
        if match:
            ip = int(match.group(1), 16)
            lines.append((counts.get(ip, 0), line))
    print(f"{name}: {total} samples")
    for count, line in lines:
        print(f"{100 * count / total:5.1f}% {line}" if count else f"       {line}")
    print("\nhottest:")
    for count, line in sorted(lines, key=lambda x: -x[0])[:args.top]:
        print(f"{100 * count / total:5.1f}% {line}")


if __name__ == "__main__":
    main()
