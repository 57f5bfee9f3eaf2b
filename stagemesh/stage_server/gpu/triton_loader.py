"""The Triton kernels of a CUDA stage (triton_attention.py, triton_int8.py), imported where Triton can be: Triton is
optional (a CPU host needs none), and a stage without it serves on torch's ops, said once per module in the log."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger("stagemesh.stage")
_loaded: dict[str, ModuleType | None] = {}


def load(module: str, without: str) -> ModuleType | None:
    """stage_server.<module>, or None where Triton cannot be imported (logged once: "<without>: <why>")."""
    if module not in _loaded:
        try:
            _loaded[module] = importlib.import_module(f"stagemesh.stage_server.gpu.{module}")
        except ImportError as exc:  # an optional dependency: the stage serves without this kernel
            log.warning(f"{without}: Triton cannot be loaded ({exc})")
            _loaded[module] = None
    return _loaded[module]
