"""The paged attention kernel (stage_server/cpu/paged_attention.cpp, built by cpu_kernels.py): decode attention read
where K/V lie in the pool equals SDPA over each session's own keys, for grouped and plain heads, sliding
windows, every head size and dtype a stage serves; it reads nothing past a session's end, refuses a table that
points outside the pool, and is built once, into a cache, or not at all (a stage then gathers for SDPA)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from stagemesh.stage_server.cpu import cpu_kernels
from stagemesh.stage_server.engine import paged_attention

kernel = paged_attention.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the paged attention kernel could not be built here "
                                  "(no C++ compiler?): stages gather K/V for SDPA; the build tests below say why")


def scattered_pool(kvH: int, D: int, lengths: list[int], bs: int, dtype: torch.dtype, seed: int = 0):
    """A pool [slots, kvH, D] whose sessions hold interleaved, shuffled blocks, and the sessions' block tables
    [B, nb] (padded with block 0). Every slot no session holds is NaN."""
    rng = random.Random(seed)
    nb = max(-(-n // bs) for n in lengths)
    blocks = list(range(1, 1 + sum(-(-n // bs) for n in lengths) + 3))
    rng.shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-n // bs))] for n in lengths]
    slots = (max(max(t) for t in tables) + 1) * bs
    k = torch.full((slots, kvH, D), float("nan"), dtype=dtype)
    v = torch.full((slots, kvH, D), float("nan"), dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for table, n in zip(tables, lengths, strict=True):
        for p in range(n):
            slot = table[p // bs] * bs + p % bs
            k[slot] = torch.randn(kvH, D, generator=g).to(dtype)
            v[slot] = torch.randn(kvH, D, generator=g).to(dtype)
    return k, v, torch.tensor([t + [0] * (nb - len(t)) for t in tables])


def reference(q, k, v, table, lengths, bs, window):
    """SDPA over each session's keys, in float32, one session at a time."""
    out = []
    for b, n in enumerate(lengths):
        slots = torch.tensor([table[b, p // bs].item() * bs + p % bs for p in range(max(0, n - window) if window
                                                                                    else 0, n)])
        kvH = k.shape[1]
        qb = q[b].float().view(kvH, -1, q.shape[2])  # [kvH, G, D]
        kb, vb = k[slots].float().transpose(0, 1), v[slots].float().transpose(0, 1)  # [kvH, n, D]
        out.append(F.scaled_dot_product_attention(qb, kb, vb).reshape(q.shape[1], q.shape[2]))
    return torch.stack(out)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 32), (16, 16, 64), (8, 2, 128), (6, 3, 24)],
                         ids=["gqa-32", "mha-64", "gqa-128", "odd-24"])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("block_size", [16, 5])
def test_the_kernel_equals_sdpa_over_each_sessions_own_keys(heads, kv_heads, head_dim, window, block_size):
    lengths = [1, 2, 16, 17, 40, 333, 5]
    k, v, table = scattered_pool(kv_heads, head_dim, lengths, block_size, torch.float32, seed=heads + head_dim)
    q = torch.randn(len(lengths), heads, head_dim)
    got = kernel(q, k, v, table, torch.tensor(lengths), block_size, window, head_dim**-0.5)
    assert not got.isnan().any()  # the NaN slots no session holds were never read
    torch.testing.assert_close(got, reference(q, k, v, table, lengths, block_size, window), atol=2e-6, rtol=1e-5)


@needs_kernel
def test_threads_split_a_lone_sessions_heads_without_changing_a_bit():
    """A pass of fewer sessions than threads splits each session's kv heads across the threads: one session, and
    three, come out bit for bit as on one thread, and a session's heads as when it is alone."""
    lengths = [200, 37, 90]
    k, v, table = scattered_pool(16, 64, lengths, 16, torch.float32, seed=5)
    q = torch.randn(3, 16, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k, v, table, torch.tensor(lengths), 16, 0, 0.125)
        torch.set_num_threads(4)
        four = kernel(q, k, v, table, torch.tensor(lengths), 16, 0, 0.125)
        alone = kernel(q[:1], k, v, table[:1], torch.tensor(lengths[:1]), 16, 0, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)
    assert torch.equal(alone[0], one[0])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_pools_are_attended_in_float32(dtype):
    lengths = [3, 64, 100]
    k, v, table = scattered_pool(4, 32, lengths, 16, dtype)
    q = torch.randn(3, 8, 32).to(dtype)
    got = kernel(q, k, v, table, torch.tensor(lengths), 16, 0, 32**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), reference(q, k, v, table, lengths, 16, 0), atol=1e-2, rtol=1e-2)


@needs_kernel
def test_a_table_or_end_outside_the_pool_is_refused_not_read():
    k, v, table = scattered_pool(2, 32, [20, 30], 16, torch.float32)
    q = torch.randn(2, 4, 32)
    outside = table.clone()
    outside[1, 1] = k.shape[0] // 16  # one past the last block
    with pytest.raises(RuntimeError, match="is not in the pool"):
        kernel(q, k, v, outside, torch.tensor([20, 30]), 16, 0, 0.1)
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernel(q, k, v, table, torch.tensor([20, 33]), 16, 0, 0.1)  # 2 blocks hold 32 positions
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernel(q, k, v, table, torch.tensor([0, 30]), 16, 0, 0.1)


def test_a_build_lands_whole_in_the_cache_and_is_built_once(tmp_path, monkeypatch):
    """The build's path (each source compiled, then one link, renamed into the cache) on two small sources: the
    kernels' own sources build the same way, on first use by every kernel test here (~50 s of compiler a build)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if cpu_kernels.shutil.which("c++") is None:
        pytest.skip("no C++ compiler on PATH")
    sources = [tmp_path / "one.cpp", tmp_path / "two.cpp"]
    for i, source in enumerate(sources):
        source.write_text(f'extern "C" int stagemesh_test_{i}() {{ return {i}; }}\n')
    monkeypatch.setattr(cpu_kernels, "SOURCES", sources)
    (folder := tmp_path / "stagemesh" / "kernels").mkdir(parents=True)
    path, built = cpu_kernels._build()
    assert built and path.is_file() and path.is_relative_to(folder)
    assert sorted(f.name for f in path.parent.iterdir()) == ["build.lock", path.name]  # no .part, no .o left
    assert cpu_kernels._build() == (path, False)  # the cache, not another build
    sources[1].write_text('extern "C" int stagemesh_test_1() { return 2; }\n')
    changed, built = cpu_kernels._build()
    assert built and changed != path  # another source, another key: built again, beside the first


def test_no_compiler_means_no_kernels_and_says_why(monkeypatch, caplog):
    """load() gives None (stages gather K/V for SDPA, and keep torch's Linears) and logs the reason, once."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    caplog.set_level(logging.INFO, logger="stagemesh.stage")
    assert paged_attention.load() is None
    assert paged_attention.load() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "gathers K/V" in warnings[0]
    assert "torch's layout" in warnings[0]


@needs_kernel
@pytest.mark.parametrize(("scale", "atol"), [(1e-3, 2e-6), (30.0, 1e-4)], ids=["flat", "peaked"])
def test_scores_near_equal_or_far_apart_are_weighed_as_sdpa_weighs_them(scale, atol):
    """The softmax runs 16 scores at a time with the row's tail padded: rows of every length up to two vectors and
    a bit, with scores all but equal (weights ~1/n) or far apart (most weights below e^-87), equal SDPA's. (Scores
    of ~170 carry float32 rounding of ~1e-5 into their weights, in SDPA as in the kernel: hence the wider atol.
    The outputs, weighted means of values ~1, differed by at most 2.3e-5 peaked and 3e-7 flat over 40 draws of q.
    No rtol: an output near 0 is held to atol like any other.)"""
    lengths = list(range(1, 36))
    k, v, table = scattered_pool(2, 32, lengths, 16, torch.float32, seed=3)
    q = torch.randn(len(lengths), 4, 32) * scale
    got = kernel(q, k, v, table, torch.tensor(lengths), 16, 0, 32**-0.5)
    torch.testing.assert_close(got, reference(q, k, v, table, lengths, 16, 0), atol=atol, rtol=0)
