"""Every stagemesh process stops cleanly on Ctrl-C or SIGTERM, and reads its certificates (and the router its tokens)
again on SIGHUP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

log = logging.getLogger("stagemesh.signals")


async def until_signalled() -> None:
    """Returns once SIGINT or SIGTERM arrives."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def on_reload(*reloads: Callable[[], object] | None) -> None:
    """SIGHUP runs each of reloads (a certificate's, the tokens'; None: nothing of that kind to reload): renewed files
    without a restart; each reload logs its own outcome and keeps what is in force when the new files do not work.
    Installed in every process, so that SIGHUP (`systemctl reload`) never ends one, even with nothing to reload."""
    given = [reload for reload in reloads if reload is not None]

    def run() -> None:
        if not given:
            log.info("SIGHUP: nothing to reload (no --tls)")
        for reload in given:
            reload()

    with contextlib.suppress(NotImplementedError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, run)
