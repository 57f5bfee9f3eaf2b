"""The test harness itself: what it starts in this process, it stops, even when a start fails; the ports it
hands out are distinct."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.harness.fault_mesh import free_ports

ROOT = Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent('''
    import pytest

    from stagemesh.stage_server import server as server_module
    from tests.conftest import splits, start_mesh


    async def test_a_stage_whose_warm_up_fails(tiny_model, monkeypatch):
        def broken(*args):
            raise RuntimeError("the warm-up broke")

        monkeypatch.setattr(server_module, "warm_up", broken)
        with pytest.raises(RuntimeError, match="the warm-up broke"):
            await start_mesh(tiny_model, [splits(8)])
''')


def test_a_mesh_that_fails_to_start_leaves_nothing_to_hang_the_exit(tmp_path):
    """start_mesh stops the servers it started when a later start fails: a grpc.aio server left alive made
    pytest hang at exit after its last test (found when one test's failing start held a suite past its end;
    CI would have waited out its limit instead of reporting the failure)."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    args = ["-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-o", "asyncio_mode=auto", "--rootdir",
            str(tmp_path), str(probe)]
    proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed" in proc.stdout


def test_free_ports_are_distinct_however_often_they_are_asked():
    """Ports for a mesh's proxies and an etcd cluster's members: asked one at a time, a port closed and
    taken again came back from the next bind (6 ports repeated one in ~1,000 draws here; an etcd cluster
    then failed with two members on one peer port)."""
    for _ in range(3000):
        assert len(set(free_ports(6))) == 6
