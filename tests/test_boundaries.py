"""Architecture boundaries that later work must keep."""
import subprocess
import sys


def test_simulator_imports_neither_torch_nor_triton():
    code = ("import sys, sim.run, sim.commands, sim.report, sim.__main__; "
            "bad = [m for m in ('torch', 'triton') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_allocators_and_scheduler_do_not_import_simpy():
    code = ("import sys, sim.kvcache.block, sim.kvcache.contiguous, sim.scheduler, sim.latency; "
            "print('simpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_calibration_fit_import_predict_and_show_import_neither_torch_nor_triton():
    code = ("import sys, calibration.__main__, calibration.commands, calibration.fit, calibration.vidur, "
            "calibration.report; from calibration.__main__ import _commands; "
            "[c.load_task() for verb, c in _commands().items() if verb != 'run']; "
            "print([m for m in ('torch', 'triton') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
