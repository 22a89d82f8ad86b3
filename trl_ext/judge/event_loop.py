"""`BackgroundEventLoop`: an asyncio event loop on a daemon thread, from which synchronous code (a trainer step)
starts the judges' coroutines and collects them later."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class BackgroundEventLoop:
    """An asyncio event loop on a daemon thread, so synchronous code (a trainer step) can start coroutines that run
    while it keeps working, and collect them later.

    ``submit(coro)`` returns a `concurrent.futures.Future`; ``close()`` stops the loop (also at interpreter exit).
    """

    name: str = "trl-ext-judge-loop"
    _loop: asyncio.AbstractEventLoop = field(init=False, repr=False)
    _thread: threading.Thread = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(ready.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        weakref.finalize(self, _stop_loop, self._loop, self._thread)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._loop.is_closed() or not self._thread.is_alive():
            raise RuntimeError("BackgroundEventLoop is closed; create a new one.")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from a thread other than the loop's)."""

        async def wrapper() -> T:
            return await coro

        return self.submit(wrapper()).result(timeout)

    def close(self) -> None:
        _stop_loop(self._loop, self._thread)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    if thread.is_alive():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
    if not thread.is_alive():
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())  # closes the HTTP clients opened on this loop
        except Exception as error:  # best effort at shutdown
            logger.debug("Could not finalise the judge loop's async generators: %r", error)
        loop.close()
