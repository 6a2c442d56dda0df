"""Sessions (``clients/session.py``): embed calls as messages on one open EmbedStream, against
real servers on loopback: shared by threads or tasks, a refused call failing alone, late answers
dropped in order, a draining server's stream replaced on the next address."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from serving import (
    assert_same_rows,
    in_process,
    metric,
    metrics,
    random_images,
    start_server,
    wait_for,
)
from vit22b.clients import AsyncFeatureClient, FeatureClient, FeatureError, Retry
from vit22b.clients import session as session_module
from vit22b.clients.session import _EndedEarly, _Entry, _expire, _Expired, failover


@pytest.fixture(scope="module")
def server():
    srv = start_server(max_delay_ms=5)
    yield srv
    srv.stop()


def stream_calls(srv, code: str) -> float:
    return metric(metrics(srv), "vit22b_requests_total", method="EmbedStream", code=code)


def test_threads_share_one_stream_and_get_the_in_process_features(server):
    images = random_images(24, seed=60, size=(64, 64))
    want = in_process(server.engine, images)["pooled"]
    before = {m: metric(metrics(server), "vit22b_requests_total", method=m, code="OK")
              for m in ("Embed", "EmbedStream")}
    got: list = [None] * len(images)
    with FeatureClient(server.address) as client, client.session() as session:

        def calls(first: int) -> None:
            for i in range(first, len(images), 8):
                got[i] = session.embed([images[i]], ids=[f"img{i}"])

        threads = [threading.Thread(target=calls, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        several = session.embed(images[:10], batch_size=3)  # one call, four messages
    assert [r.ids for r in got] == [[f"img{i}"] for i in range(len(images))]
    assert_same_rows(np.concatenate([r.pooled for r in got]), want)
    assert several.ids == [str(i) for i in range(10)] and len(several.timings) == 4
    assert_same_rows(several.pooled, want[:10])
    after = {m: metric(metrics(server), "vit22b_requests_total", method=m, code="OK")
             for m in ("Embed", "EmbedStream")}
    assert after["EmbedStream"] - before["EmbedStream"] == 1  # one stream for 25 calls
    assert after["Embed"] == before["Embed"]


def test_a_refused_call_fails_alone_and_the_calls_behind_it_are_resent(server):
    """All requests are written before the first answer: the server ends the stream at the
    bad one, so the ones behind it ran on a new stream."""
    images = random_images(12, seed=61, size=(64, 64))
    want = in_process(server.engine, images)["pooled"]
    bad = {3: b"not an image", 8: b"\xff\xd8\xff\xe0 truncated jpeg"}
    refused_before = stream_calls(server, "INVALID_ARGUMENT")
    alone_before = metric(metrics(server), "vit22b_requests_total", method="Embed", code="OK")

    async def main():
        async with AsyncFeatureClient(server.address) as client:
            async with client.session() as session:
                async def one(i: int):
                    try:
                        return await session.embed([bad.get(i, images[i])], ids=[f"img{i}"])
                    except FeatureError as err:
                        return err

                return await asyncio.gather(*(one(i) for i in range(len(images))))

    results = asyncio.run(main())
    for i, result in enumerate(results):
        if i in bad:
            assert isinstance(result, FeatureError), i
            assert result.code == grpc.StatusCode.INVALID_ARGUMENT
            assert result.details.startswith("image 0"), result
        else:
            assert result.ids == [f"img{i}"]
            assert_same_rows(result.pooled, want[i : i + 1])
    # Each bad image ends one stream. When grpc.aio loses a stream's status and its last
    # answers (INTERNAL, see the next test), the first unanswered call, a good one, is asked
    # alone by a unary Embed and the bad one behind it ends one more stream.
    asked_alone = metric(metrics(server), "vit22b_requests_total", method="Embed",
                         code="OK") - alone_before
    assert stream_calls(server, "INVALID_ARGUMENT") - refused_before == len(bad) + asked_alone


def test_a_status_lost_under_a_write_in_flight_is_asked_again_alone(server):
    """grpc.aio replaces the server's status with INTERNAL "Internal error from Core" when a
    write is in flight as the server ends the stream (grpc/grpc#36066): large messages behind
    a refused one make that likely (about a third of the rounds here). The refused call must
    still see INVALID_ARGUMENT, asked again by itself as a unary Embed."""
    images = random_images(16, seed=65, size=(512, 512))  # raw pixels: 768 KiB a message
    want = in_process(server.engine, images)["pooled"]
    asked_alone = metric(metrics(server), "vit22b_requests_total", method="Embed",
                         code="INVALID_ARGUMENT")

    async def round_():
        async with AsyncFeatureClient(server.address) as client, client.session() as session:
            async def one(image):
                try:
                    return await session.embed([image])
                except FeatureError as err:
                    return err

            return await asyncio.gather(one(b"not an image"), *(one(x) for x in images))

    for _ in range(12):
        refused, *rows = asyncio.run(round_())
        assert isinstance(refused, FeatureError), refused
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT, refused
        assert "not an image" in refused.details
        assert not [r for r in rows if isinstance(r, FeatureError)]
        assert_same_rows(np.concatenate([r.pooled for r in rows]), want)
        lost = metric(metrics(server), "vit22b_requests_total", method="Embed",
                      code="INVALID_ARGUMENT") - asked_alone
        if lost >= 2:  # the path ran: no need for more rounds
            break


def test_failover_sends_a_request_its_stream_ended_unread_again_once_before_the_policy():
    """A stream the server ends UNAVAILABLE (its drain, its bound on a stream's wait for the
    next request) or cleanly with requests unanswered did not refuse them: the first is sent
    again at once, before the retry policy counts it; a second such end goes to the policy."""
    asked = []

    def backoff(err, attempt, first, count):
        asked.append((err.code(), attempt))
        raise FeatureError(err.code(), "no retries left", first, count)

    client = SimpleNamespace(closed=False, _backoff=backoff)
    for ended in (_EndedEarly(), _Unavailable()):
        head, later = (_Entry(None, [i], [], Future()) for i in range(2))
        plan = failover([head, later], ended, client)
        assert plan.resend == [head, later] and plan.retry is None and plan.delay_s == 0
        assert not asked and not head.answer.done()
        plan = failover([head, later], ended, client)  # its new stream ended so too
        assert asked == [(grpc.StatusCode.UNAVAILABLE, 0)] and plan.resend == [later]
        with pytest.raises(FeatureError, match="no retries left"):
            head.answer.result()
        asked.clear()


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "EmbedStream: no request message for 300 s (--grpc-message-timeout)"


def test_failover_asks_an_internal_error_again_alone():
    """INTERNAL is a server bug or a status grpc.aio lost: no backoff decides it."""

    class Internal(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INTERNAL

    def backoff(*_):
        raise AssertionError("INTERNAL does not go through the retry policy")

    head, later = (_Entry(None, [i], [], Future()) for i in range(2))
    client = SimpleNamespace(closed=False, _backoff=backoff)
    plan = failover([head, later], Internal(), client)
    assert plan.alone and plan.retry is head and plan.resend == [later]
    assert not head.answer.done()
    client.closed = True  # its channels closed under the stream: nothing can be resent
    plan = failover([head, later], Internal(), client)
    assert plan.resend == [] and plan.retry is None
    for entry in (head, later):
        with pytest.raises(RuntimeError, match="closed while the call was in flight"):
            entry.answer.result()


def test_skipped_images_are_reported_as_embed_reports_them(server, tmp_path):
    images = random_images(5, seed=64, size=(64, 64))
    inputs = [images[0], tmp_path / "missing.png", images[2], b"garbage", images[4]]
    with FeatureClient(server.address) as client, client.session() as session:
        got = session.embed(inputs, skip_invalid=True, batch_size=2)
        want = client.embed(inputs, skip_invalid=True, batch_size=2)
    assert list(got.indices) == list(want.indices) == [0, 2, 4]
    assert [(e.index, e.reason) for e in got.errors] == [(e.index, e.reason) for e in want.errors]
    assert [e.index for e in got.errors] == [1, 3]
    assert_same_rows(got.pooled, want.pooled)


def test_a_call_that_times_out_drops_its_late_answer_and_keeps_the_order(server):
    images = random_images(3, seed=62, size=(64, 64))
    want = in_process(server.engine, images)["pooled"]
    with FeatureClient(server.address) as client, client.session() as session:
        with pytest.raises(FeatureError) as err:
            session.embed([images[0]], timeout=1e-6)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        later = [session.embed([image]) for image in images[1:]]  # each its own answer
    assert_same_rows(np.concatenate([r.pooled for r in later]), want[1:])

    async def twin():
        async with AsyncFeatureClient(server.address) as client, client.session() as session:
            with pytest.raises(FeatureError) as err:
                await session.embed([images[0]], timeout=1e-6)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            return [await session.embed([image]) for image in images[1:]]

    later = asyncio.run(twin())
    assert_same_rows(np.concatenate([r.pooled for r in later]), want[1:])


def test_callers_cancelled_mid_call_leave_the_others_their_own_answers(server):
    """Tasks sharing an async session, some cancelled at random points of their calls (waiting
    for room, for the write, for the answer). A caller cancelled during its write cancelled
    grpc.aio's whole stream, and every other caller on it waited out its timeout; one cancelled
    while waiting to write left a request never sent among the pending ones, and the answers
    after it would have gone to the wrong callers. Each caller that is not cancelled gets its
    own image's features, promptly, and the session closes cleanly."""
    images = random_images(8, seed=66, size=(64, 64))
    want = in_process(server.engine, images)["pooled"]
    rng = np.random.default_rng(66)
    delays = iter(rng.uniform(0, 0.003, 4096).tolist())

    async def main():
        got = []
        async with AsyncFeatureClient(server.address) as client, client.session() as session:
            async def caller(k: int):
                for round_ in range(12):
                    i = (k + round_) % len(images)
                    call = asyncio.ensure_future(session.embed([images[i]], timeout=20))
                    if (k + round_) % 3 == 0:  # a third given up at once or a little later
                        await asyncio.sleep(next(delays))
                        call.cancel()
                    try:
                        got.append((i, (await call).pooled))
                    except asyncio.CancelledError:
                        pass

            await asyncio.wait_for(asyncio.gather(*(caller(k) for k in range(16))), 60)
        return got

    got = asyncio.run(main())
    assert len(got) >= 16 * 8  # the two thirds never cancelled, at least
    for i, pooled in got:
        np.testing.assert_allclose(pooled[0], want[i], rtol=2e-2, atol=2e-2)
        distances = np.linalg.norm(want - pooled[0], axis=-1)
        assert distances.argmin() == i  # its own image's row, not a neighbour's


def test_a_calls_timer_fails_only_the_answer_its_caller_awaits():
    """An async call's timeout is one timer (``_expire``): it fails the first unanswered
    request, the one awaited; the later ones are left for the call's cleanup to cancel (an
    exception set on them would never be retrieved)."""
    async def main():
        loop = asyncio.get_running_loop()
        entries = [_Entry(None, [i], [], loop.create_future()) for i in range(3)]
        entries[0].answer.set_result("answered")
        _expire(entries)
        assert entries[0].answer.result() == "answered"
        assert isinstance(entries[1].answer.exception(), _Expired)
        assert not entries[2].answer.done()
        _expire(entries)  # a second expiry fails the next one only
        assert isinstance(entries[2].answer.exception(), _Expired)

    asyncio.run(main())


def test_a_draining_server_ends_an_idle_stream_and_the_session_moves_on():
    first, second = start_server(max_delay_ms=5), start_server(max_delay_ms=5)
    try:
        images = random_images(4, seed=63, size=(64, 64))
        want = in_process(first.engine, images)["pooled"]
        retry = Retry(attempts=4, initial_s=0.01, max_s=0.05)
        # Round-robin: GetModelInfo goes to the first address, the session's stream to the
        # second, its replacement to the first again.
        with FeatureClient([first.address, second.address], retry=retry) as client:
            with client.session() as session:
                before = session.embed(images[:2])
                assert second.stop(timeout=10)  # drains: the idle stream must not hold it
                after = session.embed(images[2:])
        assert_same_rows(np.concatenate([before.pooled, after.pooled]), want)
        assert stream_calls(first, "OK") == 1
    finally:
        first.stop()


def test_a_session_whose_server_is_gone_opens_a_stream_per_attempt_not_a_loop(monkeypatch):
    """A stream to a stopped server dies before a request reaches it: the sync session opened
    stream after stream (and a reader thread each) until one lived long enough to take the
    request, thousands in a second. A new stream holds its first request from its start, so
    each attempt of the retry policy is one stream."""
    srv = start_server()
    opened = []
    made = session_module._SyncStream.__init__

    def counted(self, *args):
        opened.append(self)
        made(self, *args)

    monkeypatch.setattr(session_module._SyncStream, "__init__", counted)
    retry = Retry(attempts=3, initial_s=0.01, max_s=0.05)
    with FeatureClient(srv.address, retry=retry) as client, client.session() as session:
        images = random_images(1, seed=64, size=(64, 64))
        session.embed(images)
        srv.stop()
        for _ in range(3):
            del opened[:]
            with pytest.raises(FeatureError) as failed:
                session.embed(images)
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE
            # the dead stream's one free resend, then the policy's three attempts
            assert len(opened) <= 4, len(opened)


def test_a_client_closed_under_its_calls_ends_each_with_one_clear_error(server):
    """Closing a client while calls are in flight: grpc.aio cancelled the calls, so an awaiting
    task ended *cancelled* (as if its own caller had cancelled it); a session's callers waited
    out their whole timeout (the stream's reader died with the cancellation, nobody failed its
    requests); a call made just after the close raised gRPC's ``UsageError`` or ``ValueError``.
    Each call now ends at once with its result or a RuntimeError saying the client is closed."""
    images = random_images(4, seed=81, size=(64, 64))

    async def under_close(session: bool) -> set[str]:
        client = AsyncFeatureClient(server.address, timeout=30)
        await client.model_info()
        if session:
            stream = await client.session().__aenter__()
            tasks = [asyncio.create_task(stream.embed([images[i % 4]])) for i in range(40)]
        else:
            tasks = [asyncio.create_task(client.embed([images[i % 4]])) for i in range(40)]
        await asyncio.sleep(0.005)
        await client.close()
        done, pending = await asyncio.wait(tasks, timeout=10)
        assert not pending and not any(t.cancelled() for t in done)
        with pytest.raises(RuntimeError, match="the client is closed"):
            await client.embed([images[0]])
        for later in (client.model_info(), client.embed([])):  # the info cached before the close
            with pytest.raises(RuntimeError, match="the client is closed"):  # was returned
                await later
        outcomes = {"ok" if t.exception() is None else str(t.exception()) for t in done}
        assert outcomes - {"ok"}, "the close came after every call: nothing was tested"
        return outcomes

    closed = {"the client is closed", "the client was closed while the call was in flight"}
    for session in (False, True):
        assert asyncio.run(under_close(session)) <= closed | {"ok"}

    client = FeatureClient(server.address, timeout=30)
    client.model_info()
    outcomes: list[str] = []

    def call(i: int, stream) -> None:
        try:
            (stream or client).embed([images[i % 4]])
            outcomes.append("ok")
        except RuntimeError as err:
            outcomes.append(str(err))

    with client.session() as stream:
        threads = [threading.Thread(target=call, args=(i, stream if i % 2 else None))
                   for i in range(16)]
        for t in threads:
            t.start()
        client.close()
        for t in threads:
            t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 16 and set(outcomes) <= closed | {"ok"}, set(outcomes)
    assert set(outcomes) & closed  # some call was in flight, or made after the close
    for later in (client.model_info, lambda: client.embed([])):
        with pytest.raises(RuntimeError, match="the client is closed"):
            later()


def test_an_async_client_made_outside_any_loop_works_in_each_loop_in_turn(server):
    """grpc.aio binds a channel to the loop it is made in: a client made at import (no loop
    yet) failed every call with "attached to a different loop", even in the first
    ``asyncio.run``. Its channels are now made at the first call, again in a later loop once
    the earlier one has ended, and a second loop running at the same time is told plainly."""
    image = random_images(1, seed=83, size=(64, 64))
    want = in_process(server.engine, image)["pooled"]
    client = AsyncFeatureClient(server.address, timeout=30)

    async def pooled() -> np.ndarray:
        async with client.session() as session:
            return (await session.embed(image)).pooled

    for _ in range(2):  # asyncio.run after asyncio.run
        np.testing.assert_array_equal(asyncio.run(client.embed(image)).pooled, want)
        np.testing.assert_array_equal(asyncio.run(pooled()), want)

    other = asyncio.new_event_loop()  # a loop that stays open, in its own thread
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    try:
        first = asyncio.run_coroutine_threadsafe(client.embed(image), other).result(30)
        np.testing.assert_array_equal(first.pooled, want)
        with pytest.raises(RuntimeError, match="belong to another event loop, still open"):
            asyncio.run(client.embed(image))
        asyncio.run_coroutine_threadsafe(client.close(), other).result(30)
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(10)
        other.close()


def test_an_async_session_is_taken_up_again_in_a_later_event_loop(server):
    """The client works in each loop in turn; a session kept across ``asyncio.run`` queued its
    request on the stream of the ended loop: DEADLINE_EXCEEDED, or a hang with no timeout.
    It now opens a stream in the new loop, and beside a live loop says so."""
    image = random_images(1, seed=84, size=(64, 64))
    want = in_process(server.engine, image)["pooled"]
    client = AsyncFeatureClient(server.address, timeout=30)
    session = client.session()

    async def pooled() -> np.ndarray:
        return (await asyncio.wait_for(session.embed(image), 30)).pooled

    for _ in range(3):
        np.testing.assert_array_equal(asyncio.run(pooled()), want)
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    try:
        fresh = AsyncFeatureClient(server.address, timeout=30)
        shared = fresh.session()
        asyncio.run_coroutine_threadsafe(shared.embed(image), other).result(30)
        with pytest.raises(RuntimeError, match="session's stream belongs to another event loop"):
            asyncio.run(shared.embed(image))
        asyncio.run_coroutine_threadsafe(shared.close(), other).result(30)
        asyncio.run_coroutine_threadsafe(fresh.close(), other).result(30)
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(10)
        other.close()
    asyncio.run(session.close())
    with pytest.raises(RuntimeError, match="the session is closed"):
        asyncio.run(session.embed(image))


def test_one_clients_open_sessions_do_not_hold_another_clients_calls():
    """A session holds a stream until it is closed, and the server bounds the streams of one
    connection; gRPC shared one connection between a process's clients of one address, so a
    client's forgotten sessions blocked every other client's calls (DEADLINE_EXCEEDED)."""
    srv = start_server(max_streams_per_connection=2)
    image = random_images(1, seed=85, size=(64, 64))
    try:
        with FeatureClient(srv.address, timeout=30) as leaky:
            sessions = [leaky.session(), leaky.session()]
            for session in sessions:  # each opens its stream with its first call
                session.embed(image)
            with FeatureClient(srv.address, timeout=10) as other:
                assert len(other.embed(image)) == 1
                with other.session() as session:
                    assert len(session.embed(image)) == 1
            for session in sessions:
                session.close()
    finally:
        srv.stop()


def test_sessions_dropped_unclosed_end_their_streams():
    """A session's reader held the session (and its client) for ever: each one dropped unclosed
    kept a thread, a socket and its stream, so with the server's bound of streams per
    connection the next session's call waited out its timeout. Now a dropped session's
    stream ends when the session is collected, sync and async."""
    import gc

    srv = start_server(max_streams_per_connection=2)
    image = random_images(1, seed=86, size=(64, 64))
    try:
        threads = threading.active_count()
        with FeatureClient(srv.address, timeout=10) as client:
            for _ in range(6):  # three times the bound; none closed
                assert len(client.session().embed(image)) == 1
            for _ in range(3):
                FeatureClient(srv.address, timeout=10).session().embed(image)  # both dropped
        gc.collect()
        wait_for(lambda: threading.active_count() <= threads, timeout=10)

        async def dropped_in_one_loop() -> int:
            client = AsyncFeatureClient(srv.address, timeout=10)
            for _ in range(6):
                assert len(await client.session().embed(image)) == 1
            gc.collect()
            deadline = time.monotonic() + 10  # the streams' tasks end (a loaded host: later)
            while len(asyncio.all_tasks()) > 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            left = len(asyncio.all_tasks()) - 1
            await client.close()
            return left

        assert asyncio.run(dropped_in_one_loop()) == 0
    finally:
        srv.stop()
