"""benchmarks/perf_annotate.py: samples land on the instructions they name."""
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import perf_annotate  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")


def test_samples_counted_per_instruction(tmp_path, capsys):
    address = 0x7F0000001000
    # nop; nop; ret (three one-byte instructions) and a second function the samples must not reach
    (tmp_path / f"{address:x}.bin").write_bytes(bytes([0x90, 0x90, 0xC3]))
    perf_map = tmp_path / "perf-1.map"
    perf_map.write_text(f"{address:x} 3 4core9_scheduleB4v1\n{address + 3:x} 10 4core5_walkB4v2\n")
    ips = tmp_path / "ips.txt"
    ips.write_text("".join(f"{ip:x}\n" for ip in [address + 1] * 3 + [address + 2, address + 5]))
    perf_annotate.main([str(tmp_path), str(ips), "_schedule", "--map", str(perf_map), "--top", "2"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(": 4 samples")
    hottest = out.split("hottest:\n")[1].splitlines()
    assert hottest[0].startswith(" 75.0%") and f"{address + 1:x}:" in hottest[0]
    assert hottest[1].startswith(" 25.0%") and "ret" in hottest[1]


def test_unknown_function_is_one_line(tmp_path):
    perf_map = tmp_path / "perf-1.map"
    perf_map.write_text("7f0000001000 3 4core9_scheduleB4v1\n")
    (tmp_path / "7f0000001000.bin").write_bytes(b"\x90\x90\xc3")
    (tmp_path / "ips.txt").write_text("")
    with pytest.raises(SystemExit, match="no compiled function named like '_nothing'"):
        perf_annotate.main([str(tmp_path), str(tmp_path / "ips.txt"), "_nothing", "--map", str(perf_map)])
