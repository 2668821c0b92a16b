"""Kernel tests run on the CPU under Triton's interpreter unless a GPU is present. The variable
must be set before triton is first imported (it reads it then, and again as each @triton.jit
decorator runs), hence here, before anything imports triton."""
import os
import subprocess
import sys

import pytest


def _has_cuda() -> bool:
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
