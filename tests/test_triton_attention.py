"""The GPU's Triton kernels (attention, a layer's fused small ops, int8) checked on this CPU:
tests/triton_interpreted.py in a process of its own with TRITON_INTERPRET=1 (Triton's interpreter must be chosen
before triton is imported, so not in this one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the dev extra installs it)")


def test_the_triton_attention_kernel_in_the_interpreter():
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "tests/triton_interpreted.py"], cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]
