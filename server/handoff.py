"""One worker thread for an event loop's small blocking jobs, its results handed back in bursts
(``hand_back``: also the batcher's way back to the loops).

``loop.run_in_executor`` costs the loop a concurrent future, its asyncio wrapper and a wake-up
(a write to the loop's self-pipe) for every job. Here a job is an asyncio future and a queue
entry; the worker runs the jobs queued one after another and settles every one finished since
its last hand-back with one ``call_soon_threadsafe``, so under load the loop wakes once per
burst, not once per job. A no-op's round trip on uvloop (``python benchmarks/serve_parts.py``,
``round_trip_us``, an Intel host): 86 us through a pool alone and 16 us each in a burst of 32,
61 and 4.3 us here; decoding a 64x64 JPEG costs about 60. One thread: jobs run in order, so
only small ones belong here (a large one would hold up those behind it; callers send those to
a pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

MAX_BURST = 16  # jobs settled per hand-back at most: the first one's answer waits for no more


class Handoff:
    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name=name, daemon=True)
        self._worker.start()

    def submit(self, fn: Callable[..., Any], *args) -> asyncio.Future:
        """``fn(*args)`` in the worker; call on an event loop, await the future there."""
        if self._closed:
            raise RuntimeError("the handoff worker is closed")
        future = asyncio.get_running_loop().create_future()
        self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        """The worker ends after the jobs queued before this."""
        self._closed = True
        self._jobs.put(None)

    def _work(self) -> None:
        job = self._jobs.get()
        while job is not None:
            finished: list[tuple[asyncio.Future, Any, BaseException | None]] = []
            for _ in range(MAX_BURST):
                future, fn, args = job
                try:
                    finished.append((future, fn(*args), None))
                except BaseException as err:  # noqa: BLE001 - the caller's to raise, on its loop
                    finished.append((future, None, err))
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = ...  # none queued: hand back, then wait
                if job is None or job is ...:
                    break
            hand_back(finished)
            if job is ...:
                job = self._jobs.get()


def hand_back(finished: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    """From another thread: settle asyncio futures (future, value, error) with one
    ``call_soon_threadsafe`` per event loop, skipping those cancelled meanwhile."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for outcome in finished:
        by_loop.setdefault(outcome[0].get_loop(), []).append(outcome)
    for loop, settled in by_loop.items():
        with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(_settle, settled)


def _settle(settled: list) -> None:
    for future, value, err in settled:
        if future.done():  # cancelled while it ran
            continue
        if err is not None:
            future.set_exception(err)
        else:
            future.set_result(value)
