"""Every stagemesh process stops cleanly on Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal


async def until_signalled() -> None:
    """Returns once SIGINT or SIGTERM arrives."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
