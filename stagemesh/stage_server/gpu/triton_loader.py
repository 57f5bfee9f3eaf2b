"""The Triton kernels of a CUDA stage (triton_attention.py, triton_fused.py, triton_int8.py), imported where Triton
can be and launches a kernel (triton_check.py): Triton is optional (a CPU host needs none), and a stage without it
serves on torch's ops, said once per module in the log."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger("stagemesh.stage")
_loaded: dict[str, ModuleType | None] = {}


def load(module: str, without: str) -> ModuleType | None:
    """stage_server.<module>, or None where Triton cannot be imported or cannot launch a kernel on the GPU
    (triton_check.py; logged once: "<without>: <why>"). Called for CUDA stages only."""
    if module not in _loaded:
        try:
            _launches()
            _loaded[module] = importlib.import_module(f"stagemesh.stage_server.gpu.{module}")
        except Exception as exc:  # an optional dependency, or a machine it cannot build on: serve without it
            log.warning(f"{without}: Triton cannot be used ({type(exc).__name__}: {exc})")
            _loaded[module] = None
    return _loaded[module]


def _launches() -> None:
    """Raises why Triton cannot launch a kernel here; checked once."""
    if "triton_check" not in _loaded:
        try:
            check = importlib.import_module("stagemesh.stage_server.gpu.triton_check")
            check.launch()
            _loaded["triton_check"] = check
        except Exception:
            _loaded["triton_check"] = None
            raise
    if _loaded["triton_check"] is None:
        raise RuntimeError("a first kernel failed to launch (logged above)")
