"""The server's bound on each wait for a request message (``server/parsing.py``,
``MessageWaits``), on a bare event loop: the order of events within one loop pass, which a
server on loopback reaches only by chance, set up exactly here."""

from __future__ import annotations

import asyncio

import pytest
from vit22b.model.errors import Draining
from vit22b.server.parsing import MessageWaits


async def _waiting(waits: MessageWaits, held: bool = False):
    """A task waiting through ``waits`` for a future; (the task, the future)."""
    message = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(waits.wait(_read(message), held))
    await asyncio.sleep(0)  # it is waiting now
    return task, message


async def _read(message: asyncio.Future):  # as grpc.aio's read: awaits its receive operation
    return await message


def test_a_message_that_came_as_its_bound_passed_is_kept():
    """The sweep and the message's arrival in one loop pass, the message first: the waiting
    task is about to resume with it, and cancelling it would drop a message already read."""
    async def main():
        loop = asyncio.get_running_loop()
        waits = MessageWaits(4.0)
        task, message = await _waiting(waits)
        waits._sweep_handle.cancel()  # the due sweep is run by hand, in the message's pass
        waits._due[task] = loop.time() - 0.001  # past its bound

        def one_pass():
            message.set_result(b"request")
            waits._sweep(loop)

        loop.call_soon(one_pass)
        return await task

    assert asyncio.run(main()) == b"request"


def test_a_wait_past_its_bound_times_out_and_a_held_one_only_once_its_clock_starts():
    async def main():
        loop = asyncio.get_running_loop()
        waits = MessageWaits(0.2)  # swept every 50 ms
        late, late_message = await _waiting(waits)
        held, message = await _waiting(waits, held=True)
        started = loop.time()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(late, 5)
        assert loop.time() - started >= 0.2 and late_message.cancelled()
        await asyncio.sleep(0.3)
        assert not held.done()  # not timed while held (a stream owing an answer)
        waits.start_clock(held)  # timed from now
        started = loop.time()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(held, 5)
        assert loop.time() - started >= 0.2 and message.cancelled()
        assert not waits._due  # nothing left to sweep: the sweep stopped
        await asyncio.sleep(0.1)
        assert waits._sweep_handle is None

    asyncio.run(main())


def test_a_drain_ends_every_wait_now_and_each_later_one_at_once():
    async def main():
        draining = asyncio.Event()
        waits = MessageWaits(300.0, draining)
        tasks = [(await _waiting(waits, held=held))[0] for held in (False, True)]
        waits.drain()
        draining.set()
        for task in tasks:
            with pytest.raises(Draining):
                await task
        later = _read(asyncio.get_running_loop().create_future())
        with pytest.raises(Draining):
            await waits.wait(later)
        assert later.cr_frame is None  # closed, never awaited

    asyncio.run(main())


def test_another_cancel_of_a_waiting_task_is_not_taken_for_the_bound():
    """The call ending (grpc cancels its handler) reaches the handler as a cancellation."""
    async def main():
        waits = MessageWaits(300.0)
        task, _ = await _waiting(waits)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not waits._due

    asyncio.run(main())


def test_the_bound_and_the_calls_end_in_one_pass_end_it_as_cancelled():
    """The sweep's cancel and grpc's own (the call ended) in one loop pass: the handler must
    see the cancellation, not a timeout it would go on to answer."""
    async def main():
        loop = asyncio.get_running_loop()
        waits = MessageWaits(4.0)
        task, _ = await _waiting(waits)
        waits._sweep_handle.cancel()
        waits._due[task] = loop.time() - 0.001

        def one_pass():
            waits._sweep(loop)
            task.cancel()  # grpc ends the call

        loop.call_soon(one_pass)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
