"""The memory a stage streams every step, its packed weights and its KV pool, lies on 2 MiB pages where the
kernel offers transparent huge pages (stage_server/cpu/huge_pages.py), zeroed like torch.zeros, and keeps results
exact."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from stagemesh.router.server import RouterConfig, RouterServer
from stagemesh.stage_server.config import StageConfig
from stagemesh.stage_server.cpu import cpu_kernels, huge_pages, packed_weights
from stagemesh.stage_server.engine.kv_pool import KVPool
from stagemesh.stage_server.server import StageServer
from tests.conftest import Mesh, collect, hf_greedy
from tests.test_traffic import request

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ON_REQUEST = THP.exists() and "[madvise]" in THP.read_text()
"""Huge pages only where asked for: then memory that does not ask has none (with `always` every large region may)."""
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="this kernel offers no transparent huge pages (or says nothing of them)")
needs_thp_on_request = pytest.mark.skipif(
    not ON_REQUEST, reason="this kernel's transparent huge pages are not `madvise` (only where asked for): with "
    "`always` memory that does not ask may lie on them too, with `never` (or none) nothing does")


def huge_bytes_under(tensor: torch.Tensor) -> int:
    """Bytes on huge pages in the mapping that holds tensor's first element (/proc/self/smaps)."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_a_huge_page_tensor_is_zeroed_aligned_and_of_the_asked_shape():
    t = huge_pages.zeros((3, 1024, 1024), torch.float32)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not t.any()
    small = huge_pages.zeros((7, 5), torch.bfloat16)  # under a huge page: ordinary torch memory
    assert small.shape == (7, 5) and small.dtype == torch.bfloat16 and not small.any()


@pytest.mark.parametrize("huge", [True, False])
def test_a_kv_pool_takes_memory_as_its_blocks_are_used_not_when_made(huge):
    """A pool is sized for the host (by default a quarter of its memory): made, it must not commit it, with or
    without huge pages (--no-huge-pages once zeroed the whole pool up front)."""
    process = psutil.Process()
    before = process.memory_info().rss
    pool = KVPool(512 << 20, num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.float32, device="cpu", huge=huge)
    assert process.memory_info().rss - before < (pool.k.nbytes + pool.v.nbytes) // 8
    assert not pool.k[:, :pool.block_size].any() and not pool.v[:, :pool.block_size].any()  # the null block


@needs_thp
def test_packed_weights_lie_on_huge_pages_once_touched():
    weight = torch.randn(2048, 1024)  # 8 MiB
    panels = packed_weights.panels_of(weight)
    assert huge_bytes_under(panels) >= panels.nbytes // 2  # the kernel may split an edge page
    x = torch.randn(3, 1024)
    assert cpu_kernels.load()
    assert torch.allclose(torch.ops.stagemesh.packed_linear(x, panels, None, 2048), x @ weight.t(), atol=1e-4)


@needs_thp
def test_the_kv_pool_lies_on_huge_pages_as_its_blocks_are_used():
    pool = KVPool(64 << 20, num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.float32, device="cpu")
    pool.k.fill_(1.0)
    pool.v.fill_(1.0)
    assert huge_bytes_under(pool.k) >= pool.k.nbytes // 2 and huge_bytes_under(pool.v) >= pool.v.nbytes // 2


@needs_thp_on_request
def test_a_kv_pool_without_huge_pages_lies_on_none():
    """--no-huge-pages: the pool does not ask for them, and gets none."""
    plain = KVPool(64 << 20, num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.float32, device="cpu", huge=False)
    plain.k.fill_(1.0)
    assert huge_bytes_under(plain.k) == 0


@pytest.mark.parametrize("huge", [pytest.param(True, marks=needs_thp), pytest.param(False, marks=needs_thp_on_request)])
async def test_a_stage_serves_from_a_pool_on_huge_pages_unless_told_not_to(tiny_model, hf_models, huge):
    mesh = Mesh()
    try:
        server = StageServer(StageConfig(model=str(tiny_model), layer_start=0, layer_end=8, port=0, kv_cache_gb=0.05,
                                         huge_pages=huge))
        mesh.stages.append([server])
        await server.start(await server.in_compute(server.load, 0, 8))
        mesh.router = RouterServer(RouterConfig(model=str(tiny_model), chains=[server.address], port=0))
        await mesh.router.start()
        ids, _, _ = await collect(mesh.router_stub.Generate(request([5, 6, 7, 8], 12)))
        assert ids == hf_greedy(hf_models["llama"], [5, 6, 7, 8], 12)
        on_huge = huge_bytes_under(server.pool.k)  # the warm-up's and the stream's blocks touched it
        if huge:
            assert on_huge > 0
            assert server.pool.k.data_ptr() % huge_pages.HUGE_PAGE == 0
        else:
            assert on_huge == 0
    finally:
        await mesh.stop()
