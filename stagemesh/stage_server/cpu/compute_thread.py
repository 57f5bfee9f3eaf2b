"""A stage's torch threads: every load, pool, warm-up and pass runs on its one compute thread, with the
stage's --threads; the event loop's own torch work runs on one thread.

OpenMP keeps a thread team for each thread that runs parallel work, and libgomp stops spinning between
parallel regions once its threads outnumber the cores (each region then wakes its workers from a futex). One
parallel region on the event loop (its KV pool's null block zeroed there; an output log's prefill rows; a
hidden state cast for the wire) gave a multi-threaded stage a second team for good: a 2-thread ~270M stage
decoded at 45-50 ms/token instead of 36-37 (docs/decisions.md, "Threads")."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch
from threadpoolctl import ThreadpoolController


def compute_executor() -> ThreadPoolExecutor:
    """The stage's compute thread (StageServer.compute). Its thread count is set by the load, which runs on it."""
    return ThreadPoolExecutor(1, thread_name_prefix="stage-compute")


def hold_to_one_thread() -> None:
    """Called on the event loop's thread: torch there runs inline from now on, never on a team of its own.

    Only this thread's OpenMP count is set (set_own_threads): torch.set_num_threads would also set the
    process-wide count that torch reads once per thread and library, and so the compute thread's. torch's own
    read comes first, so that it does not undo this one."""
    torch.get_num_threads()
    set_own_threads(1)


@functools.cache
def _openmp() -> ThreadpoolController:
    return ThreadpoolController().select(user_api="openmp")


def set_own_threads(threads: int) -> None:
    """The calling thread's OpenMP count (omp_set_num_threads on it alone, ~10 µs): the compute thread's for one
    pass (batcher.py, --lone-session-threads). torch.set_num_threads would also set the process-wide count that
    each thread and library reads once, lazily: the event loop's first kernel call after it would start a team."""
    for library in _openmp().lib_controllers:
        library.set_num_threads(threads)
