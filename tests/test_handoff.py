"""server/handoff.py: jobs run in the worker in order, each result or error reaches its own
future on its own loop, cancelled ones are skipped, and close ends the worker; ``hand_back``
(the batcher's way back) wakes each loop once per hand-back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from vit22b.server.handoff import MAX_BURST, Handoff, hand_back


def test_results_errors_and_order_reach_each_future():
    handoff, ran = Handoff("test-handoff"), []

    def job(i):
        ran.append((i, threading.current_thread().name))
        if i % 7 == 3:
            raise ValueError(f"job {i}")
        return i * i

    async def main():
        futures = [handoff.submit(job, i) for i in range(5 * MAX_BURST + 3)]  # several bursts
        return await asyncio.gather(*futures, return_exceptions=True)

    results = asyncio.run(main())
    for i, result in enumerate(results):
        if i % 7 == 3:
            assert isinstance(result, ValueError) and str(result) == f"job {i}"
        else:
            assert result == i * i
    assert [i for i, _ in ran] == list(range(len(results)))  # in order, in one thread
    assert {name for _, name in ran} == {"test-handoff"}
    handoff.close()
    handoff._worker.join(5)
    assert not handoff._worker.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(handoff.submit(abs, 1))


def test_a_cancelled_job_is_skipped_and_two_loops_are_served():
    handoff, gate, seen = Handoff("test-handoff-2"), threading.Event(), []

    async def one_loop(tag):
        slow = handoff.submit(gate.wait, 5)
        later = handoff.submit(lambda: tag)
        slow.cancel()  # its caller left while it runs: the result is dropped, not set
        gate.set()
        seen.append((await later, slow.cancelled()))

    threads = [threading.Thread(target=asyncio.run, args=(one_loop(t),)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert sorted(seen) == [("a", True), ("b", True)]
    started = time.monotonic()  # the worker still serves
    assert asyncio.run(_one(handoff)) == 42 and time.monotonic() - started < 5
    handoff.close()


async def _one(handoff):
    return await handoff.submit(int, "42")


def test_hand_back_wakes_each_loop_once_and_skips_cancelled_and_closed():
    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (wakeups.append(args), real(*args))[1]
        futures = [loop.create_future() for _ in range(5)]
        futures[2].cancel()  # its caller left: skipped, not set
        outcomes = [(f, i * 10, None) for i, f in enumerate(futures)]
        outcomes[4] = (futures[4], None, ValueError("four"))
        closed = asyncio.new_event_loop()
        gone = closed.create_future()
        closed.close()  # a loop that ended meanwhile: nobody waits, nothing raises
        worker = threading.Thread(target=hand_back, args=([(gone, 1, None), *outcomes],))
        worker.start()
        worker.join(5)
        results = await asyncio.gather(*(futures[i] for i in (0, 1, 3, 4)),
                                       return_exceptions=True)
        return len(wakeups), results

    wakeups, results = asyncio.run(main())
    assert wakeups == 1
    assert results[:3] == [0, 10, 30]
    assert isinstance(results[3], ValueError) and str(results[3]) == "four"
