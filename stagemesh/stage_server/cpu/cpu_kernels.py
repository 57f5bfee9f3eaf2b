"""stagemesh's CPU kernels, built on first use and loaded as torch ops: stagemesh::decode_attention
(paged_attention.cpp: decode attention read where K/V lie in the paged pool), stagemesh::packed_linear
(packed_linear.cpp: float32 Linears over weights packed in panels, packed_weights.py) and stagemesh::decode_layers
(decode_layers.cpp: a decode pass's decoder layers in one call over the other two, decode_layers.py).

They are built with the host's C++ compiler against the installed torch, for the CPU's vector capability, into
one library kept in a cache keyed by the sources, torch and the flags (built once per machine, ~20 s; a file
lock makes concurrent stages wait for one build, and a build killed half-way leaves nothing behind). A library is
loaded only from a folder this user owns and no one else may write to. A host where they cannot be built (no
compiler, a failed build, a cache folder that fails that check) logs why, once, and runs torch's ops instead:
decode attention by gather + SDPA, Linears by torch's matrix products; STAGEMESH_CPU_KERNELS=0 in the environment
chooses that path on purpose. `stagemesh kernels` builds them ahead (after an install, in an image build); they are
not built when the wheel is, which would need torch in every build environment (a multi-GB download), so the
first stage on a machine where that was not run builds them instead.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

log = logging.getLogger("stagemesh.stage")

SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "packed_linear.cpp", "decode_layers.cpp")]
HEADERS = [Path(__file__).with_name("cpu_kernels.h")]
BUILD_TIMEOUT_S = 600.0
"""A compiler or linker run that takes longer is given up (the stage runs torch's ops)."""
VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
"""By torch's reading of the CPU (torch.backends.cpu.get_cpu_capability()); any other: the compiler's default."""

OFF_ENV = "STAGEMESH_CPU_KERNELS"
"""0 (or off, false, no): never build nor load the kernels; every stage of the process runs torch's ops."""

_lock = threading.Lock()
_loaded = False
_failure: str | None = None
_library: Path | None = None


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stagemesh" / "kernels"


def load() -> bool:
    """Whether the kernels are loaded (built or read from the cache, once per process); False where they cannot
    be, logged once."""
    global _loaded, _failure
    with _lock:
        if not _loaded and _failure is None and os.environ.get(OFF_ENV, "1").lower() in ("0", "off", "false", "no"):
            _failure = f"{OFF_ENV}={os.environ[OFF_ENV]}"
            log.info(f"the CPU kernels are off ({_failure}): decode attention gathers K/V for SDPA, and Linear "
                     "weights stay in torch's layout")
        if not _loaded and _failure is None:
            t0 = time.perf_counter()
            try:
                path, built = _build()
                torch.ops.load_library(str(path))
                global _library
                _library = path
                # what each op returns, as torch.compile traces it
                torch.library.register_fake("stagemesh::decode_attention", _attention_shape)
                torch.library.register_fake("stagemesh::packed_linear", _linear_shape)
                _loaded = True
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                _failure = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1][:300]}"
                log.warning(f"the CPU kernels could not be built ({_failure}): decode attention gathers K/V for "
                            f"SDPA, and Linear weights stay in torch's layout")
            else:
                how = f"built in {time.perf_counter() - t0:.1f}s" if built else "from the cache"
                log.info(f"CPU kernels: paged attention, packed Linears, decoder layers ({how}: {path})")
        return _loaded


def status() -> str:
    """Where the loaded library lies, or why none is (after load())."""
    return str(_library) if _loaded else (_failure or "not tried")


def _attention_shape(q: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(q)


def _linear_shape(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _flags() -> tuple[list[str], list[str]]:
    """The compiler's flags for each source, and the linker's for the library."""
    capability = torch.backends.cpu.get_cpu_capability()
    compile_flags = ["-O3", "-std=c++20", "-fPIC", "-fopenmp", *VECTOR_FLAGS.get(capability, []),
                     f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     *(f"-I{p}" for p in cpp_extension.include_paths())]
    link_flags = ["-shared", "-fopenmp", *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
    return compile_flags, link_flags


def _build() -> tuple[Path, bool]:
    """The shared library's path, and whether this call built it."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise FileNotFoundError("no C++ compiler on PATH (c++, or $CXX)")
    compile_flags, link_flags = _flags()
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in SOURCES + HEADERS), torch.__version__.encode(),
                                     " ".join(compile_flags + link_flags).encode(),
                                     compiler.encode()])).hexdigest()[:16]
    root = _writable(cache_root())
    _check_owned(root)
    folder = root / key
    folder.mkdir(mode=0o700, exist_ok=True)
    _check_owned(folder)
    library = folder / "stagemesh_kernels.so"
    if library.exists():
        _check_owned(library)
        return library, False
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released if this process dies: a stale lock never blocks a build
        if library.exists():  # another process built it meanwhile
            return library, False
        partial = folder / f"stagemesh_kernels.so.{os.getpid()}.part"
        objects = [folder / f"{source.stem}.{os.getpid()}.o" for source in SOURCES]
        try:
            # One compiler per source, side by side (the sources take about the same time each), then the link.
            with ThreadPoolExecutor(len(SOURCES)) as compilers:
                list(compilers.map(lambda source, obj: _run([compiler, "-c", str(source), "-o", str(obj),
                                                             *compile_flags]), SOURCES, objects))
            _run([compiler, *map(str, objects), "-o", str(partial), *link_flags])
            os.replace(partial, library)  # whole or absent, whoever reads it
        finally:
            for leftover in (partial, *objects):
                leftover.unlink(missing_ok=True)
    return library, True


def _run(command: list[str]) -> None:
    """Runs a compiler or linker; RuntimeError with its complaint if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} exited {done.returncode}: {done.stderr.strip()}")


def _check_owned(path: Path) -> None:
    """Raises PermissionError unless path belongs to this user and no one else may write to it: a library loaded
    from a cache another user can write to would run their code in this process."""
    st = path.lstat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{path} belongs to uid {st.st_uid} or is writable by others (mode "
                              f"{st.st_mode & 0o777:o}): no library is loaded from it")


def _writable(root: Path) -> Path:
    """root, or a folder of this user's in the temporary directory where root cannot be made."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"stagemesh-kernels-{os.getuid()}"
