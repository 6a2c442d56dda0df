"""The client SDK across processes and threads: a client inherited through fork (a
multiprocessing pool, a DataLoader's workers), pickled into a spawned worker, an async client
closed from another thread. The process experiments run in a process of their own (the SDK
alone, no jax), against a real server on loopback."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest
from serving import ROOT, assert_same_rows, random_images, start_server, wait_for
from vit22b.clients import AsyncFeatureClient, FeatureClient


@pytest.fixture(scope="module")
def server():
    srv = start_server(max_delay_ms=5)
    yield srv
    srv.stop()


# Run as a script: the parent embeds 4 images, then a pool of worker processes (start method
# argv[2]) embeds them again with what the parent holds (argv[3]); prints what each got.
_WORKERS = """
import asyncio, json, multiprocessing, sys
import numpy as np
from vit22b.clients import AsyncFeatureClient, FeatureClient

ADDRESS, METHOD, CASE = sys.argv[1:4]
IMAGES = [np.random.default_rng(90 + i).integers(0, 256, (64, 64, 3), np.uint8) for i in range(4)]
HELD = None  # what the workers use: made in the parent, inherited through fork or pickled


def work(i, held=None):
    held = held if held is not None else HELD
    try:
        if CASE == "busy" and i % 2:  # a client made in the child
            held = FeatureClient(ADDRESS, timeout=5)
        if isinstance(held, AsyncFeatureClient):
            return asyncio.run(held.embed([IMAGES[i]])).pooled[0].tolist()
        return held.embed([IMAGES[i]]).pooled[0].tolist()
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def main():
    global HELD
    client = FeatureClient(ADDRESS, timeout=5)
    want = [client.embed([image]).pooled[0].tolist() for image in IMAGES]
    session = client.session()
    if CASE == "busy" or METHOD != "fork":
        session.embed([IMAGES[0]])  # its stream stays open: its reader waits in gRPC
    HELD = {"client": client, "session": session, "busy": client}.get(CASE)
    if CASE == "async":
        HELD = AsyncFeatureClient(ADDRESS, timeout=5)
        asyncio.run(HELD.model_info())
    if METHOD == "fork":  # held at the fork, as by another thread in the SDK at that moment
        client._lock.acquire()
        session._lock.acquire()
    context = multiprocessing.get_context(METHOD)
    with context.Pool(2) as pool:
        args = [(i, HELD) for i in range(4)] if METHOD != "fork" else [(i,) for i in range(4)]
        try:
            got = pool.starmap_async(work, args).get(30)
        except multiprocessing.TimeoutError:
            got = "the workers hung"
    if METHOD == "fork":
        client._lock.release()
        session._lock.release()
    got_here = session.embed([IMAGES[1]]).pooled[0].tolist()  # the parent's session works
    print(json.dumps({"want": want, "got": got, "parent": got_here}))


if __name__ == "__main__":
    main()
"""


def _workers(tmp_path, server, method: str, case: str) -> dict:
    script = tmp_path / "workers.py"  # a file: spawn's workers import it as __mp_main__
    script.write_text(_WORKERS)
    run = subprocess.run([sys.executable, str(script), server.address, method, case],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert_same_rows(np.array([out["parent"]]), np.array(out["want"][1:2]))
    assert isinstance(out["got"], list), out["got"]
    return out


@pytest.mark.parametrize("case", ["client", "session"])
def test_a_client_or_session_made_before_a_fork_works_in_the_children(tmp_path, server, case):
    """A fork copies a lock another thread holds, locked: a child forked while a thread of the
    parent was inside the client's round-robin (or a session's send) waited for it for ever.
    A child now takes each client and session up afresh: its own lock, window, channels and
    stream, opened at its first call there (the parent's are left alone)."""
    out = _workers(tmp_path, server, "fork", case)
    assert all(isinstance(row, list) for row in out["got"]), out["got"]
    assert_same_rows(np.array(out["got"]), np.array(out["want"]))


def test_a_child_forked_mid_call_refuses_every_call_at_once(tmp_path, server):
    """A fork while the parent was in a gRPC call (here a session's open stream, whose reader
    waits in gRPC): gRPC skips its fork handlers then, and a child's call on the inherited
    channel hung past its deadline; new channels' calls crashed the child in up to half the
    pools tried (SIGABRT in gRPC's epoll poller). Every call there now fails at once saying
    what to do, the inherited client's and a new one's alike."""
    out = _workers(tmp_path, server, "fork", "busy")
    said = "RuntimeError: this process was forked while its parent was in a gRPC call"
    assert all(got.startswith(said) and "spawn" in got for got in out["got"]), out["got"]


@pytest.mark.parametrize("case", ["client", "session", "async"])
def test_a_client_or_session_pickles_into_spawned_workers(tmp_path, server, case):
    """Pickling a client failed with gRPC's "no default __reduce__ due to non-trivial __cinit__"
    (a session's too; an async client's with "cannot pickle '_thread.lock'"), so a dataset
    holding one could not go to a spawn or forkserver worker. Each now pickles as its settings
    and opens its own channels where it is unpickled (the parent's session open meanwhile)."""
    out = _workers(tmp_path, server, "spawn", case)
    assert all(isinstance(row, list) for row in out["got"]), out["got"]
    assert_same_rows(np.array(out["got"]), np.array(out["want"]))


def test_an_async_client_in_a_child_forked_from_grpc_aio_fails_at_once(tmp_path, server):
    """grpc.aio's state is the process's: a child forked from a process holding an async client
    that had made calls hung in each grpc.aio call past its timeout (or died of SIGSEGV or
    SIGABRT), in the inherited client or one made there. It now says so at its first call."""
    out = _workers(tmp_path, server, "fork", "async")
    said = "RuntimeError: grpc.aio does not work in a process made by fork"
    assert all(got.startswith(said) and "spawn" in got for got in out["got"]), out["got"]


def test_a_pickled_client_keeps_its_settings_and_state(server):
    image = random_images(1, seed=91, size=(64, 64))
    with FeatureClient(server.address, timeout=30, concurrency=3) as client:
        want = client.embed(image).pooled
        for twin in (pickle.loads(pickle.dumps(client)), copy.copy(client)):
            assert (twin.addresses, twin.timeout, twin.concurrency, twin.retry) == (
                client.addresses, client.timeout, client.concurrency, client.retry)
            assert_same_rows(twin.embed(image).pooled, want)
            with twin.session() as session:
                assert_same_rows(pickle.loads(pickle.dumps(session)).embed(image).pooled, want)
            twin.close()
        client.close()
        with pytest.raises(RuntimeError, match="the client is closed"):
            pickle.loads(pickle.dumps(client)).embed(image)
    secure = pickle.loads(pickle.dumps(FeatureClient("127.0.0.1:1", tls=True, token="t")))
    assert secure.metadata == (("authorization", "Bearer t"),)
    assert callable(secure._pick("GetModelInfo"))  # its TLS channel, made from the roots kept
    secure.close()


def test_an_async_client_or_session_closed_from_another_thread_ends_its_stream_there(server):
    """``close`` from another thread's loop closed nothing while the client's own loop kept
    running: its channels and a session's stream stayed open (a stream slot of the server's
    connection bound) as long as that loop ran. They are now closed in their own loop."""
    image = random_images(1, seed=92, size=(64, 64))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(30)

    try:
        for closed in ("client", "session"):
            client = AsyncFeatureClient(server.address, timeout=30)
            session = client.session()
            run(session.embed(image))
            stream = session._stream
            asyncio.run((client if closed == "client" else session).close())  # another loop
            wait_for(lambda stream=stream: stream.dead, timeout=10)
            if closed == "session":
                assert len(run(client.embed(image))) == 1  # the client itself stays open
                run(client.close())
            else:
                with pytest.raises(RuntimeError, match="the client is closed"):
                    run(client.embed(image))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
