"""A TCP link on loopback whose faults are switched at run time: one-way delay, throttling, a cut
(every connection reset, new ones refused) and a black hole (connections accepted, nothing forwarded).

The kernel on our machines has no `netem`, so tests and benchmarks put one of these in front of a
server instead: clients dial the proxy's port and the proxy dials the server. It runs on its own
thread and event loop, so a test can stall its own loop (or a server process) without stalling the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

CHUNK = 64 * 1024


@dataclass
class LinkFaults:
    delay_s: float = 0.0
    """Each chunk is held this long, each way (one-way latency)."""
    bytes_per_s: float = 0.0
    """Throttle each direction to this rate (0: unlimited)."""
    cut: bool = False
    """Reset every connection and refuse new ones."""
    black_hole: bool = False
    """Accept connections, forward nothing (a host that stopped answering, packets dropped)."""


class LinkProxy:
    """`with LinkProxy("127.0.0.1:50061") as link:` dial `link.address`; set `link.faults` at any time."""

    def __init__(self, target: str, host: str = "127.0.0.1", port: int = 0):
        self.target_host, _, target_port = target.rpartition(":")
        self.target_port = int(target_port)
        self.host, self.port = host, port
        self.faults = LinkFaults()
        self.connections = 0
        self.bytes_in = 0
        """Bytes read from clients so far (toward the server: forwarded, or held by a delay or a black hole)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"link-proxy-{target}", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> LinkProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def set(self, **faults) -> None:
        """Switches faults, e.g. set(delay_s=0.2) or set(cut=True); set() restores a clean link.
        Cutting resets the connections open now."""
        self.faults = LinkFaults(**faults)
        if self.faults.cut:
            self._loop.call_soon_threadsafe(self._reset_all)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server:
            self._server.close()
        self._reset_all()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()  # RST, not a clean close: what a cut link looks like
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.faults.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer, inbound=True), self._pipe(up_reader, writer))
        except asyncio.CancelledError:
            pass  # stop(): asyncio's stream callback would report the cancelled handler as an unhandled error

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, inbound: bool = False) -> None:
        """Forwards one direction, each chunk released at (arrival + delay), in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.get_running_loop().create_task(self._send(queue, dst))
        try:
            while data := await src.read(CHUNK):
                if inbound:
                    self.bytes_in += len(data)
                queue.put_nowait((time.monotonic(), data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await sender

    async def _send(self, queue: asyncio.Queue, dst: asyncio.StreamWriter) -> None:
        while True:
            arrived, data = await queue.get()
            if not data:
                break
            while self.faults.black_hole:  # held: nothing moves until the hole closes (or the link goes)
                await asyncio.sleep(0.05)
            faults = self.faults
            if faults.delay_s:
                await asyncio.sleep(max(0.0, arrived + faults.delay_s - time.monotonic()))
            if faults.bytes_per_s:
                await asyncio.sleep(len(data) / faults.bytes_per_s)
            if self.faults.cut:
                break
            dst.write(data)
            await dst.drain()
        with contextlib.suppress(Exception):
            dst.close()
