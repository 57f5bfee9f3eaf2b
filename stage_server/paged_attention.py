"""Decode attention read where K/V lie in the paged pool, on the CPU: the op stagemesh::decode_attention of
paged_attention.cpp, next to this file.

A pass of B sessions' decode steps attends over every key each of them holds. Gathered into one padded
contiguous buffer for SDPA (model.py's path for prefill chunks, and on other devices) the pass's K/V are
copied and read again; on a busy stage they outweigh the weights (32 sessions of ~360 positions on the ~270M
model: 95 MB per layer against 67 MB of the layer's weights). The kernel reads them once, block by block
through each session's block table.

It is built on first use with the host's C++ compiler against the installed torch, for the CPU's vector
capability, and kept in a cache keyed by the source, torch and the flags (built once per machine, ~15 s; a
file lock makes concurrent stages wait for one build, and a build killed half-way leaves nothing behind). A
host where it cannot be built (no compiler, a failed build) logs why, once, and attends by gather + SDPA.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from stage_server.model import StageModel
from stage_server.pass_plan import DecodeAttention

log = logging.getLogger("stagemesh.stage")

SOURCE = Path(__file__).with_name("paged_attention.cpp")
BUILD_TIMEOUT_S = 600.0
"""A build that takes longer is given up (the stage attends by gather + SDPA)."""
VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
"""By torch's reading of the CPU (torch.backends.cpu.get_cpu_capability()); any other: the compiler's default."""

_lock = threading.Lock()
_kernel: DecodeAttention | None = None
_failure: str | None = None


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stagemesh" / "kernels"


def load() -> DecodeAttention | None:
    """The kernel, built or read from the cache (once per process); None where it cannot be, logged once."""
    global _kernel, _failure
    with _lock:
        if _kernel is None and _failure is None:
            t0 = time.perf_counter()
            try:
                path, built = _build()
                torch.ops.load_library(str(path))
                torch.library.register_fake("stagemesh::decode_attention", _shape)  # for torch.compile's graphs
                _kernel = torch.ops.stagemesh.decode_attention
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                _failure = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1][:300]}"
                log.warning(f"decode attention gathers K/V for SDPA: the paged attention kernel could not be "
                            f"built ({_failure})")
            else:
                how = f"built in {time.perf_counter() - t0:.1f}s" if built else "from the cache"
                log.info(f"decode attention: paged attention kernel ({how}: {path})")
        return _kernel


def _shape(q: torch.Tensor, *_: object) -> torch.Tensor:
    """What the op returns, as torch.compile traces it: q's shape and dtype."""
    return torch.empty_like(q)


def attach(model: StageModel) -> None:
    """A CPU model's decode steps attend through the kernel from now on (where it can be had)."""
    if model.device.type == "cpu":
        model.decode_attention = load()


def _flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    return ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp", *VECTOR_FLAGS.get(capability, []),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), *(f"-L{p}" for p in cpp_extension.library_paths()),
            "-lc10", "-ltorch_cpu"]


def _build() -> tuple[Path, bool]:
    """The shared library's path, and whether this call built it."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise FileNotFoundError("no C++ compiler on PATH (c++, or $CXX)")
    flags = _flags()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), " ".join(flags).encode(),
                                     compiler.encode()])).hexdigest()[:16]
    folder = _writable(cache_root()) / key
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / "paged_attention.so"
    if library.exists():
        return library, False
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released if this process dies: a stale lock never blocks a build
        if library.exists():  # another process built it meanwhile
            return library, False
        partial = folder / f"paged_attention.so.{os.getpid()}.part"
        try:
            done = subprocess.run([compiler, str(SOURCE), "-o", str(partial), *flags], capture_output=True,
                                  text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} exited {done.returncode}: {done.stderr.strip()}")
            os.replace(partial, library)  # whole or absent, whoever reads it
        finally:
            partial.unlink(missing_ok=True)
    return library, True


def _writable(root: Path) -> Path:
    """root, or a folder of this user's in the temporary directory where root cannot be made."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"stagemesh-kernels-{os.getuid()}"
