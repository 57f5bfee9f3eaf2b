"""The fault-injection link: delay, cut, black hole and restore, against a real echo server."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.harness.link_proxy import LinkProxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(address: str, payload: bytes, timeout: float) -> bytes:
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), timeout)
    finally:
        writer.close()


async def test_link_faults_switch_at_run_time():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        with LinkProxy(target) as link:
            assert await _round_trip(link.address, b"clean", 5) == b"clean"

            link.set(delay_s=0.1)
            t0 = time.monotonic()
            assert await _round_trip(link.address, b"slow", 5) == b"slow"
            assert time.monotonic() - t0 >= 0.2  # 0.1 s each way

            link.set(black_hole=True)
            with pytest.raises(TimeoutError):
                await _round_trip(link.address, b"lost", 0.5)

            link.set(cut=True)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError, OSError)):
                await _round_trip(link.address, b"cut", 5)

            link.set()
            assert await _round_trip(link.address, b"restored", 5) == b"restored"
    finally:
        server.close()
