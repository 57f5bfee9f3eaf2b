"""Every stagemesh process stops cleanly on Ctrl-C or SIGTERM, and reads its certificates (and the router its tokens)
again on SIGHUP."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable


async def until_signalled() -> None:
    """Returns once SIGINT or SIGTERM arrives."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def on_reload(*reloads: Callable[[], object]) -> None:
    """SIGHUP runs each of reloads (a certificate's, the tokens'): renewed files without a restart; each reload logs
    its own outcome and keeps what is in force when the new files do not work."""
    with contextlib.suppress(NotImplementedError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: [reload() for reload in reloads])
