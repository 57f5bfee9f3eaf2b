"""uvicorn inside the router's event loop: the HTTP front's server (router/http_api.py), a task beside the gRPC
server, started and stopped (drained) with it by router/server.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Awaitable
from typing import Any, TypeVar

import uvicorn
from starlette.requests import Request

from stagemesh.grpc_server import host_port

T = TypeVar("T")


class ClientGone(Exception):
    """The caller closed its connection before the answer was ready."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits work unless the caller hangs up first: then work is cancelled (the streams it holds close, so every
    stage frees the sessions) and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request was cancelled (the server stopping past its grace)
        gone.cancel()
        await _cancelled(task)
        raise
    gone.cancel()
    if task in done:
        return task.result()
    await _cancelled(task)
    raise ClientGone


async def _cancelled(task: asyncio.Future) -> None:
    """Cancels task and waits until it has unwound."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: a failure while unwinding is not logged as never read


async def _disconnect(request: Request) -> None:
    """Returns when the caller closes the connection (the body is read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _RouterUvicorn(uvicorn.Server):
    """uvicorn inside the router's loop: the router's own signal handlers stay (SIGTERM drains both fronts,
    SIGHUP reloads tokens and certificates); it is stopped by HttpServer.stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class HttpServer:
    """uvicorn serving an ASGI app as a task in the running event loop, on a socket bound when made (so that a port
    in use stops the router at start, as the gRPC port does)."""

    def __init__(self, app, host: str, port: int, tls_files: dict | None = None):
        self.host = host
        self.socket = bind(host, port)
        self.port = self.socket.getsockname()[1]
        self.tls = bool(tls_files)
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, ws="none",
                                server_header=False, **(tls_files or {}))
        self.server = _RouterUvicorn(config)
        self.task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{host_port(self.host, self.port)}"

    def reload_certificate(self) -> None:
        """Reads the certificate and key files again into the TLS context being served (SIGHUP; the caller checked
        them): new connections get the new pair, open ones keep theirs."""
        config = self.server.config
        if self.tls and config.loaded and config.ssl is not None:
            config.ssl.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self.task.done():  # it failed to start: say why
                self.task.result()
                raise OSError(f"the HTTP front on {self.url} did not start")
            await asyncio.sleep(0.01)

    async def stop(self, grace: float | None) -> None:
        """No new connections; the requests in flight finish within grace seconds (None: however long they take),
        then are cancelled (their streams close)."""
        if self.task is None:
            self.socket.close()
            return
        self.server.config.timeout_graceful_shutdown = None if grace is None else max(grace, 0.0)
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        left = list(self.server.server_state.tasks)  # cancelled past the grace: let them unwind
        if left:
            await asyncio.wait(left, timeout=5)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), not yet listening."""
    name = host.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot bind {host_port(host, port)} (--http-port): {exc}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise OSError(f"cannot bind {host_port(host, port)} (--http-port): is the port in use?") from None
    return sock


def tls_files(cert: str, key: str, client_ca: str | None) -> dict:
    """uvicorn's TLS settings: the certificate and key (PEM files), and a client CA whose certificate every
    caller must present when given."""
    files: dict[str, Any] = {"ssl_certfile": cert, "ssl_keyfile": key}
    if client_ca:
        files.update(ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return files
