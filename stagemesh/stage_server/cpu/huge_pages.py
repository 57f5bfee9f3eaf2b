"""CPU tensors on 2 MiB pages (Linux transparent huge pages), for the memory a stage streams on every step: its
packed Linear weights and its KV pool.

With 4 KiB pages every 4 KiB of a stream is a TLB entry; a decode step walks hundreds of MiB of weights and, on a
busy stage, the pool's blocks, each block's slot a page of its own. On this project's Xeon VM a float32 GEMV
streams ~12% faster over memory on 2 MiB pages and decode attention over the pool ~15% faster
(docs/decisions.md, "Weights and KV on 2 MiB pages"). torch's allocator asks for huge pages only when the process
starts with THP_MEM_ALLOC_ENABLE=1, and then for every large temporary too; here the two long-lived regions ask for
them and nothing else does.

Where the kernel offers no transparent huge pages (`never`), or off Linux, the memory is ordinary and zeroed all
the same. The cost is at the first touch: a 2 MiB page is zeroed whole, and on a VM whose host backs guest memory
only when the guest first touches it (this project's VMs) a fresh huge page costs 5-8 ms, not ~0.1: the first ~270M
stage after a boot loaded in ~14 s instead of ~2; later processes mostly reuse those pages (4 GiB touched in 0.45 s
against 15.5 s the first time). `--no-huge-pages` keeps 4 KiB pages.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor. From 2 MiB on, in anonymous memory, which the kernel zeroes page by page at first touch
    (a KV pool sized for the host commits only what its sessions use; torch.zeros would write all of it now); with
    huge, advised onto 2 MiB pages before that touch. The tensor keeps its mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    # Private: an anonymous shared mapping is shmem, whose huge pages the kernel governs apart (shmem_enabled).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeroed, 4 KiB-aligned
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start:start + nbytes].view(dtype).view(shape)


def huge_page_bytes() -> int | None:
    """This process's memory on transparent huge pages (None where the kernel does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
