"""Operating the server: overload, deadlines, cancellation, auth, TLS, draining, SIGTERM."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from jax._src.compilation_cache import decompress_executable
from serving import (
    assert_same_rows,
    in_process,
    metric,
    metrics,
    random_images,
    raw_image,
    self_signed,
    serve_process,
    sigterm_under_load,
    start_server,
    stub,
    wait_for,
)
from vit22b.clients import AsyncFeatureClient, FeatureClient, FeatureError, Retry
from vit22b.model.compile_cache import _check_cache_folder
from vit22b.server.settings import ServeConfig
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

SERVICE = "vit22b.v1.FeatureService"
# a long batching delay keeps admitted requests waiting in the queue: what a test checks
# before their batch runs (refusals, retries, cancellations) has the delay to happen in, on a
# loaded host too
DELAY_MS = 6000
# a deadline that passes while admitted images wait out DELAY_MS: 0.3 s, then 1.0 s, did not
# always reach the queue on a loaded host (parsing, decoding; three pytest workers on two
# cores), and a call gone before it counts no image
IN_QUEUE_TIMEOUT_S = DELAY_MS / 1e3 / 2
WAIT = "delay"  # ... with the policy that always waits it out (not only for decoding images)
QUEUE = 6


def request(n: int, seed: int = 0) -> pb.EmbedRequest:
    return pb.EmbedRequest(images=[raw_image(p) for p in random_images(n, seed, (64, 64))])


def wait_for_images(server, before: dict, outcome: str, count: int) -> None:
    """Until the server counts ``count`` more images with this outcome than ``before``."""
    start = metric(before, "vit22b_images_total", outcome=outcome)
    wait_for(
        lambda: metric(metrics(server), "vit22b_images_total", outcome=outcome) - start == count
    )


def queued(server) -> float:
    return metric(metrics(server), "vit22b_queue_images")


@pytest.fixture(scope="module")
def slow():
    srv = start_server(max_delay_ms=DELAY_MS, batch_wait=WAIT, max_queue_images=QUEUE,
                       max_request_images=QUEUE)
    yield srv
    srv.stop()


def test_overload_is_refused_at_once_while_admitted_requests_complete(slow):
    s = stub(slow.address)
    before = metrics(slow)
    admitted = [s.Embed.future(request(3, seed=i), timeout=60) for i in range(2)]
    wait_for(lambda: queued(slow) == QUEUE)
    with pytest.raises(grpc.RpcError) as info:
        s.Embed(request(1), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue full" in info.value.details()
    # Refused while the admitted requests were still waiting for their batch.
    assert not any(f.done() for f in admitted)
    for i, future in enumerate(admitted):
        pooled = wire.from_tensor(future.result().pooled)
        assert_same_rows(pooled, in_process(slow.engine, random_images(3, i, (64, 64)))["pooled"])
    after = metrics(slow)
    assert (
        metric(after, "vit22b_images_total", outcome="rejected")
        - metric(before, "vit22b_images_total", outcome="rejected")
        == 1
    )
    assert metric(after, "vit22b_requests_total", method="Embed", code="RESOURCE_EXHAUSTED") >= 1


def test_client_retries_resource_exhausted_with_backoff(slow):
    s = stub(slow.address)
    before = metrics(slow)
    admitted = [s.Embed.future(request(3, seed=i), timeout=60) for i in range(2)]
    wait_for(lambda: queued(slow) == QUEUE)
    images = random_images(2, seed=9, size=(64, 64))
    retry = Retry(attempts=50, initial_s=0.1, max_s=0.3)
    with FeatureClient(slow.address, retry=retry) as client:
        got = client.embed(images)
    assert_same_rows(got.pooled, in_process(slow.engine, images)["pooled"])
    for future in admitted:
        future.result()
    rejected = metric(metrics(slow), "vit22b_images_total", outcome="rejected")
    assert rejected - metric(before, "vit22b_images_total", outcome="rejected") >= 2  # retried


def test_expired_deadline_in_the_queue_is_not_computed(slow):
    s = stub(slow.address)
    before = metrics(slow)
    with pytest.raises(grpc.RpcError) as info:
        s.Embed(request(2), timeout=IN_QUEUE_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the client's deadline comes before the server's by the request's transit: its
    # cancellation can reach the server first (a loaded host), and the server counts a caller
    # gone. Either way the images are dropped uncomputed (the HTTP door's deadline is the
    # server's own: its twin in test_http.py counts "expired" alone).
    wait_for(lambda: sum(
        metric(metrics(slow), "vit22b_images_total", outcome=outcome)
        - metric(before, "vit22b_images_total", outcome=outcome)
        for outcome in ("expired", "cancelled")) == 2)
    after = metrics(slow)
    for name in ("vit22b_batch_images_count", "vit22b_batch_images_sum"):
        assert metric(after, name) == metric(before, name)  # no batch ran
    assert metric(after, "vit22b_queue_images") == 0


def test_a_call_its_client_ends_at_its_deadline_counts_as_expired(slow):
    """A gRPC client's deadline comes before the server's (the request's transit, the timeout
    header's rounding), so its cancellation reaches the server a little early: counted as the
    caller gone (CANCELLED) where the caller saw DEADLINE_EXCEEDED. Here the client ends the
    call 20 ms before its deadline (a try where the host overslept past the deadline would test
    the server's own expiry instead: it is tried again)."""
    s = stub(slow.address)
    for _ in range(3):
        before = metrics(slow)
        start = time.monotonic()
        future = s.Embed.future(request(2, seed=4), timeout=2.0)
        wait_for(lambda: queued(slow) == 2)
        time.sleep(max(0.0, start + 2.0 - 0.02 - time.monotonic()))
        lead = start + 2.0 - time.monotonic()  # the deadline's is later: it started after
        future.cancel()
        wait_for_images(slow, before, "expired", 2)
        if lead > 0.005:
            break
        wait_for(lambda: metric(metrics(slow), "vit22b_queue_images") == 0)
    else:
        pytest.skip("the host overslept the client's cancel past its deadline three times")
    code = {"method": "Embed", "code": "DEADLINE_EXCEEDED"}
    wait_for(lambda: metric(metrics(slow), "vit22b_requests_total", **code)
             - metric(before, "vit22b_requests_total", **code) == 1)
    after = metrics(slow)
    assert metric(after, "vit22b_images_total", outcome="cancelled") == \
        metric(before, "vit22b_images_total", outcome="cancelled")
    assert metric(after, "vit22b_queue_images") == 0


def test_cancelled_call_is_not_computed(slow):
    s = stub(slow.address)
    before = metrics(slow)
    future = s.Embed.future(request(2), timeout=60)
    wait_for(lambda: queued(slow) == 2)
    future.cancel()
    wait_for_images(slow, before, "cancelled", 2)
    after = metrics(slow)
    assert metric(after, "vit22b_batch_images_count") == metric(before, "vit22b_batch_images_count")
    assert metric(after, "vit22b_queue_images") == 0


# ---- answers their clients do not read -----------------------------------------------------

def _unreading_channel(address: str) -> grpc.Channel:
    """A channel whose calls take 64 KiB of an answer until they are read (no BDP growth): a
    call whose answer is never read keeps it in the server's memory."""
    return grpc.insecure_channel(address, [
        ("grpc.http2.lookahead_bytes", 1 << 16), ("grpc.http2.bdp_probe", 0),
        ("grpc.max_receive_message_length", 64 << 20)])


def _big_answer(n: int = 48) -> bytes:
    """Patch tokens of every layer for ``n`` images: about 1 MB of answer for the tiny model."""
    return pb.EmbedRequest(
        images=request(n).images, outputs=[pb.OUTPUT_KIND_POOLED],
        patch_layers=[0, 1, 2, 3]).SerializeToString()


def test_answers_their_clients_do_not_read_are_bounded_and_released(caplog):
    """A client that opens calls and never reads their answers held each in the server's
    memory, with no bound and no deadline (an outside tester held 1.9 GB with 300 such calls).
    Past --max-unread-mb new calls are refused RESOURCE_EXHAUSTED, a call opened early too
    when its body comes; an answer read, or its call gone, is released (a unary call's answer
    and a stream's alike)."""
    srv = start_server(max_unread_mb=0.5)
    try:
        unread = lambda: metric(metrics(srv), "vit22b_unread_response_bytes")  # noqa: E731
        held = _unreading_channel(srv.address)
        gate = threading.Event()

        def late_body():
            gate.wait(30)
            yield request(1).SerializeToString()

        early = held.stream_stream(f"/{SERVICE}/Embed")(late_body(), timeout=60)
        # the unary method, called as a stream so that its answer is read only when asked for
        call = held.stream_stream(f"/{SERVICE}/Embed")(iter([_big_answer()]), timeout=60)
        wait_for(lambda: unread() > 0.5 * 2**20)
        with pytest.raises(grpc.RpcError) as refused:
            stub(srv.address).Embed(request(1), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "not read, over --max-unread-mb (0.5)" in refused.value.details()
        gate.set()  # opened before the bound was reached, its body sent after
        with pytest.raises(grpc.RpcError) as refused:
            next(early)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        answer = pb.EmbedResponse.FromString(next(call))  # read at last: released
        assert len(answer.patch_tokens) == 4 and answer.patch_tokens[3].shape[0] == 48
        wait_for(lambda: unread() == 0)
        assert len(stub(srv.address).Embed(request(1), timeout=30).ids) == 1
        # sessions admitted together: each answer counts from its admission, so the first
        # takes the bound before any answer exists and the others are refused (counted only
        # once made, 200 such sessions held 4x an outside tester's bound)
        burst = [held.stream_stream(f"/{SERVICE}/EmbedStream")(iter([_big_answer()]),
                                                               timeout=60) for _ in range(4)]
        wait_for(lambda: sum(session.done() for session in burst) == 3)
        assert {s.code() for s in burst if s.done()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert 0 < unread() < 2 * answer.ByteSize()
        for session in burst:
            session.cancel()
        wait_for(lambda: unread() == 0)
        held.close()
    finally:
        srv.stop()
    # a session's answers count from their making (they wait in its window while one is sent)
    # until sent; its client gone, they are released
    srv = start_server(max_unread_mb=16)
    try:
        unread = lambda: metric(metrics(srv), "vit22b_unread_response_bytes")  # noqa: E731
        held = _unreading_channel(srv.address)
        with caplog.at_level(logging.INFO):
            session = held.stream_stream(f"/{SERVICE}/EmbedStream")(
                iter([_big_answer()] * 3), timeout=60)
            wait_for(lambda: unread() > 2.5 * answer.ByteSize())
            session.cancel()
            wait_for(lambda: unread() == 0)
            held.close()
            assert len(stub(srv.address).Embed(request(1), timeout=30).ids) == 1
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        srv.stop()


def test_one_connection_that_stops_reading_takes_half_the_unread_bound_at_most():
    """The bound was shared: one client whose reader stuck (a zero window) filled it, and every
    other client was refused. A connection holds at most half of it now (or one answer, where
    one is larger), the answer being admitted counted; the others go on."""
    srv = start_server(max_unread_mb=2.5)
    try:
        unread = lambda: metric(metrics(srv), "vit22b_unread_response_bytes")  # noqa: E731
        held = _unreading_channel(srv.address)
        embed = held.stream_stream(f"/{SERVICE}/Embed")
        first = embed(iter([_big_answer()]), timeout=60)  # about 0.8 MiB: under the half
        wait_for(lambda: unread() > 0.5 * 2**20)
        second = embed(iter([_big_answer()]), timeout=60)  # 1.6 MiB would be over 1.25
        with pytest.raises(grpc.RpcError) as refused:
            next(second)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert re.search(r"this connection holds 0\.\d MiB of answers it has not read "
                         r"\(0\.\d MiB more with this one\)", refused.value.details())
        assert "over 1/2 of --max-unread-mb (2.5)" in refused.value.details()
        assert unread() < 1.25 * 2**20
        assert len(stub(srv.address).Embed(request(1), timeout=30).ids) == 1
        first.cancel()
        wait_for(lambda: unread() == 0)
        held.close()
    finally:
        srv.stop()
    srv = start_server(max_unread_mb=1.5)  # an answer over the half: taken when it is alone
    try:
        held = _unreading_channel(srv.address)
        first = held.stream_stream(f"/{SERVICE}/Embed")(
            iter([_big_answer(128)]), timeout=60)  # about 2.1 MiB
        wait_for(lambda: metric(metrics(srv), "vit22b_unread_response_bytes") > 1.5 * 2**20)
        first.cancel()
        held.close()
    finally:
        srv.stop()


def test_every_stream_is_counted_once_as_it_ended():
    """An outside tester's soak: a session whose client left while its answer was being sent
    was never counted (the handler, suspended at ``yield``, is closed with GeneratorExit): it is
    CANCELLED now. A session its client cancels once every request is answered counts once,
    OK or CANCELLED (its request stream ends and the reset comes with it: grpcio's context
    says not cancelled whenever the end is seen first); one its client closes is OK."""
    srv = start_server()
    try:
        def count(code: str) -> float:
            return metric(metrics(srv), "vit22b_requests_total", method="EmbedStream", code=code)

        def counted() -> float:
            return count("OK") + count("CANCELLED")

        def then_wait(message: bytes, gate: threading.Event):
            yield message
            gate.wait(30)

        before = {code: count(code) for code in ("OK", "CANCELLED")}
        held = _unreading_channel(srv.address)  # answers waiting in an unread window
        for _ in range(4):
            gate = threading.Event()
            session = held.stream_stream(f"/{SERVICE}/EmbedStream")(
                then_wait(_big_answer(), gate), timeout=60)
            wait_for(lambda: metric(metrics(srv), "vit22b_unread_response_bytes") > 0)
            time.sleep(0.3)  # the answer in its write
            session.cancel()
            gate.set()
            wait_for(lambda: metric(metrics(srv), "vit22b_unread_response_bytes") == 0)
        wait_for(lambda: count("CANCELLED") - before["CANCELLED"] == 4)
        assert count("OK") == before["OK"]

        channel = grpc.insecure_channel(srv.address)
        open_stream = channel.stream_stream(f"/{SERVICE}/EmbedStream")
        start = counted()
        for i in range(8):  # an answer read, then the client cancels (the stream left open)
            gate = threading.Event()
            session = open_stream(then_wait(request(1, seed=i).SerializeToString(), gate),
                                  timeout=30)
            next(session)
            session.cancel()
            gate.set()
        wait_for(lambda: counted() - start == 8)
        ok = count("OK")
        closed = list(open_stream(iter([request(1).SerializeToString()] * 2), timeout=30))
        assert len(closed) == 2
        wait_for(lambda: count("OK") - ok == 1)
        time.sleep(0.5)  # nothing else comes
        assert counted() - start == 9
        channel.close()
        held.close()
    finally:
        srv.stop()


def test_a_stream_answer_cancelled_before_it_ran_gives_its_room_back():
    """A session's answer task cancelled before its first step (the stream ended in the loop's
    pass that queued it) never ran ``Infer.run``, whose ``finally`` gives the call's room in the
    queue back: the room was held for good, and the queue filled over time."""
    from vit22b.server.service import to_call

    class NoDeadline:  # what ``to_call`` reads of a gRPC context
        def time_remaining(self):
            return None

    srv = start_server()
    try:
        service, infer = srv.server.service, srv.server.infer

        async def admit_then_cancel() -> tuple[bool, int]:
            call = to_call(request(2), NoDeadline(), infer.limits, streamed=True)
            admitted = await infer.admit(call, infer.validate(call))
            task = service._answer_task(call, admitted)
            task.cancel()  # before its first step
            await asyncio.sleep(0.1)
            return task.cancelled(), admitted.held

        cancelled, held = asyncio.run_coroutine_threadsafe(  # on the server's own loop
            admit_then_cancel(), srv._loop).result(30)
        assert cancelled and held == 0
        assert metric(metrics(srv), "vit22b_queue_images") == 0
    finally:
        srv.stop()


def test_grpcs_traceback_for_a_call_gone_while_sending_is_one_info_line():
    """grpcio logs eight lines at ERROR for each call that ends while its answer is being sent
    (its client gone): a log any client can fill."""
    from grpc._cython.cygrpc import ExecuteBatchError
    from vit22b.server.logs import call_gone_while_sending

    def record() -> logging.LogRecord:
        try:
            raise ExecuteBatchError("Failed execute_batch")
        except ExecuteBatchError:
            return logging.LogRecord(
                "grpc._cython.cygrpc", logging.ERROR, __file__, 1, "ExecuteBatchError raised in "
                "core by servicer method [%s]", ("/vit22b.v1.FeatureService/Embed",),
                sys.exc_info())

    root = logging.getLogger()
    level = root.level
    try:
        root.setLevel(logging.INFO)
        assert call_gone_while_sending(line := record())
        assert (line.levelname, line.exc_info) == ("INFO", None)
        assert line.getMessage() == ("/vit22b.v1.FeatureService/Embed: the call ended (its "
                                     "client gone, or its deadline passed) as grpcio finished it")
        root.setLevel(logging.WARNING)
        assert not call_gone_while_sending(record())  # an INFO line, under --log-level WARNING
    finally:
        root.setLevel(level)
    other = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 1, "x", (), None)
    assert call_gone_while_sending(other) and other.levelname == "ERROR"


# ---- authentication and TLS ---------------------------------------------------------------

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    d = self_signed(tmp_path_factory.mktemp("tls"))
    (d / "tokens").write_text(f"# clients\n{TOKEN}\nanother-token\n")
    srv = start_server(
        token_file=str(d / "tokens"), tls_cert=str(d / "cert.pem"), tls_key=str(d / "key.pem")
    )
    yield srv, d / "cert.pem"
    srv.stop()


def test_tls_client_with_token_round_trips(secure):
    srv, cert = secure
    images = random_images(3, seed=11)
    with FeatureClient(srv.address, tls=cert, token=TOKEN) as client:
        got = client.embed(images)
        assert client.model_info().model.name == "vit-22b-tiny/16"
    np.testing.assert_array_equal(got.pooled, in_process(srv.engine, images)["pooled"])


def test_sessions_carry_tls_and_the_token(secure):
    srv, cert = secure
    images = random_images(3, seed=12)
    want = in_process(srv.engine, images)["pooled"]
    with FeatureClient(srv.address, tls=cert, token=TOKEN) as client, client.session() as s:
        np.testing.assert_array_equal(s.embed(images).pooled, want)

    async def twin():
        async with AsyncFeatureClient(srv.address, tls=cert, token=TOKEN) as client:
            async with client.session() as session:
                return await session.embed(images)

    np.testing.assert_array_equal(asyncio.run(twin()).pooled, want)


def test_token_files_and_tls_pairs_that_cannot_work_are_refused_at_start(tmp_path):
    """Each started before: a token file of binary bytes failed in the codec's words (no file
    named), a non-ASCII token started a server no gRPC client could ever present it to, and a
    certificate that is not one (or a key of another certificate) failed as a port gRPC could
    not bind."""
    from vit22b.server.auth import check_tls_pair, read_tokens

    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00token")
    with pytest.raises(ValueError, match="binary is not text"):
        read_tokens(tmp_path / "binary")
    (tmp_path / "accented").write_text("# ok\nplain\ncaf\u00e9\n", encoding="utf-8")
    with pytest.raises(ValueError, match="accented, line 3: a token must be printable ASCII"):
        read_tokens(tmp_path / "accented")
    (tmp_path / "crlf").write_bytes(b"one\r\n\r\n  two  \r\n")
    assert read_tokens(tmp_path / "crlf") == ("one", "two")

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = self_signed(tmp_path / "a"), self_signed(tmp_path / "b")
    check_tls_pair(a / "cert.pem", a / "key.pem")
    for cert, key in ((a / "cert.pem", b / "key.pem"), (tmp_path / "crlf", a / "key.pem"),
                      (a / "cert.pem", tmp_path / "missing.pem")):
        with pytest.raises(ValueError, match="cannot be loaded as a PEM certificate chain"):
            check_tls_pair(cert, key)
    with pytest.raises(ValueError, match="--tls-cert .* cannot be loaded"):
        start_server(tls_cert=str(a / "cert.pem"), tls_key=str(b / "key.pem"))


def test_token_files_and_keys_an_operator_gets_wrong(tmp_path):
    """A byte order mark (Notepad's) refused the first token; a FIFO blocked the start for
    ever; a token gRPC metadata cannot carry (over 16 KiB in all) was taken; an encrypted key
    asked for its pass phrase on the terminal (or failed as 'Invalid argument'); each was read
    only after the model was built and compiled."""
    from vit22b.server.app import FeatureServer
    from vit22b.server.auth import check_tls_pair, read_tokens

    (tmp_path / "bom").write_bytes(b"\xef\xbb\xbfone\r\ntwo\r\n")
    assert read_tokens(tmp_path / "bom") == ("one", "two")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="--token-file .*fifo: not a regular file"):
        read_tokens(tmp_path / "fifo")
    with pytest.raises(ValueError, match="--token-file .*missing: No such file"):
        read_tokens(tmp_path / "missing")
    (tmp_path / "long").write_text("x" * 8193 + "\n")
    with pytest.raises(ValueError, match="line 1: a token of 8193 characters, over 8192"):
        read_tokens(tmp_path / "long")
    self_signed(tmp_path)
    encrypted = tmp_path / "encrypted.pem"
    subprocess.run(["openssl", "pkey", "-in", str(tmp_path / "key.pem"), "-aes256", "-passout",
                    "pass:secret", "-out", str(encrypted)], check=True, capture_output=True)
    with pytest.raises(ValueError, match="the key is encrypted .*give an unencrypted PEM key"):
        check_tls_pair(tmp_path / "cert.pem", encrypted)
    (tmp_path / "empty").write_text("# nobody yet\n")
    config = ServeConfig(token_file=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="holds no token"):
        FeatureServer(config)  # no engine yet: said before any model work


def test_client_credentials_that_cannot_work_are_refused_when_made(secure, tmp_path):
    """An empty token (an unset variable) sent no token at all; a private key given as the
    trusted roots failed 2.6 s into the first call as 'Failed to create security handshaker'."""
    srv, cert = secure
    with pytest.raises(ValueError, match="token is empty"):
        FeatureClient(srv.address, tls=cert, token="")
    key = cert.parent / "key.pem"
    with pytest.raises(ValueError, match=r"tls='.*key.pem' holds no PEM certificate"):
        FeatureClient(srv.address, tls=key, token=TOKEN)
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        AsyncFeatureClient(srv.address, tls=key, token=TOKEN)


@pytest.mark.parametrize("token, why", [(None, "missing bearer token (metadata 'authorization: "
                                                "Bearer <token>')"),
                                        ("wrong-token", "wrong bearer token (not one of the "
                                                        "server's --token-file)")])
def test_missing_or_wrong_token_is_unauthenticated(secure, token, why):
    srv, cert = secure
    with FeatureClient(srv.address, tls=cert, token=token) as client:
        with pytest.raises(FeatureError) as info:
            client.model_info()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert why in str(info.value)


def test_two_authorization_values_are_refused_saying_so(secure):
    """Two values, both the right token, were "missing or wrong bearer token": the refusal
    (the doors would each pick one) says what it refuses."""
    srv, cert = secure
    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    twice = [("authorization", f"Bearer {TOKEN}")] * 2
    with pytest.raises(grpc.RpcError) as info:
        stub(srv.address, creds).GetModelInfo(pb.GetModelInfoRequest(), metadata=twice,
                                              timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "2 authorization values: send one" in info.value.details()


def test_stream_without_token_is_unauthenticated(secure):
    srv, cert = secure
    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    responses = stub(srv.address, creds).EmbedStream(iter([request(1)]), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        list(responses)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_stays_open_and_plaintext_is_refused(secure):
    srv, cert = secure
    channel = grpc.secure_channel(srv.address, grpc.ssl_channel_credentials(cert.read_bytes()))
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    with pytest.raises(grpc.RpcError) as info:
        stub(srv.address).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- draining -------------------------------------------------------------------------------


def test_drain_goes_not_serving_and_finishes_accepted_calls():
    srv = start_server(max_delay_ms=DELAY_MS * 4, batch_wait=WAIT)
    s = stub(srv.address)
    accepted = s.Embed.future(request(2, seed=3), timeout=60)
    wait_for(lambda: queued(srv) == 2)
    channel = grpc.insecure_channel(srv.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=SERVICE), timeout=60
    )
    live = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service="liveness"), timeout=60
    )
    assert next(watch).status == next(live).status == health_pb2.HealthCheckResponse.SERVING
    outcome = {}
    stopper = threading.Thread(target=lambda: outcome.update(clean=srv.stop()))
    stopper.start()
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    response = accepted.result()  # not cut: drained without waiting out the batching delay
    assert wire.from_tensor(response.pooled).shape == (2, 64)
    stopper.join(60)
    assert outcome["clean"] is True
    # alive all through the drain (a liveness probe must not cut it short): its watch saw no
    # change, and ended with the server
    with pytest.raises(grpc.RpcError):
        next(live)
    channel.close()
    with pytest.raises(grpc.RpcError) as info:
        s.Embed(request(1), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_startup_heap_is_left_out_of_cycle_collections_while_serving():
    import gc

    srv = start_server()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # jax, the compiled forwards, the libraries
        s = stub(srv.address)
        for seed in range(3):
            assert s.Embed(request(2, seed=seed), timeout=60).pooled.shape == [2, 64]
        gc.collect()  # a full collection while serving leaves the frozen objects be (those
        assert gc.get_freeze_count() > frozen * 0.9  # freed by reference counting leave it)
    finally:
        srv.stop()
    assert gc.get_freeze_count() == 0  # a stopped server's objects may be collected again


def test_serving_is_said_only_once_sigterm_drains(monkeypatch):
    """The SERVING line came before the signal handlers: a supervisor's SIGTERM on reading it
    killed the server by the default action (exit -15, no drain; an outside tester saw 4 of 8
    starts). At the line, SIGTERM must already be the server's: sent then, it drains."""
    from types import SimpleNamespace

    from vit22b.server import app as app_module

    said = []

    def announce(line: str) -> None:
        said.append(line)
        if "SERVING" in line:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), \
                "SERVING said while SIGTERM still kills"
            os.kill(os.getpid(), signal.SIGTERM)  # as a supervisor would, at once

    async def drain_and_stop():
        return True

    engine = SimpleNamespace(cfg=SimpleNamespace(name="m"), identity=SimpleNamespace(source="s"),
                             mesh_spec="data=1,model=1", buckets=(1,))
    server = SimpleNamespace(engine=engine, address="127.0.0.1:1", http_url=None,
                             metrics_port=None, drain_and_stop=drain_and_stop)
    monkeypatch.setattr(app_module, "_announce", announce)
    assert asyncio.run(app_module.serve_started(server)) == 0
    assert said[-1] == "vit22b serve: stopped (clean)"


def test_sigterm_during_load_loses_no_accepted_request():
    proc, address = serve_process(
        "--mesh", "data=2,model=4", "--max-batch-images", "8", "--max-delay-ms", "100",
        "--log-level", "WARNING", "--compile-cache", "off",
    )
    try:

        def load(seed: int, outcomes: list, stop: threading.Event) -> None:
            s = stub(address)
            while not stop.is_set():
                try:
                    response = s.Embed(request(2, seed), timeout=60)
                    assert wire.from_tensor(response.pooled).shape == (2, 64)
                    outcomes.append(("OK", ""))
                except grpc.RpcError as err:
                    outcomes.append((err.code().name, err.details() or ""))
                    if err.code() == grpc.StatusCode.UNAVAILABLE:
                        return

        loads = [functools.partial(load, i) for i in range(8)]
        outcomes = sigterm_under_load(proc, loads, lambda done: len(done) >= 40)
        codes = {code for code, _ in outcomes}
        assert codes <= {"OK", "UNAVAILABLE"}, outcomes
        assert sum(code == "OK" for code, _ in outcomes) >= 40
        for code, details in outcomes:  # refused at the door, never cut mid-call
            if code == "UNAVAILABLE":
                assert re.search(r"shutting down|connect|refused", details), details
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_empty_compile_cache_entries_are_removed_at_start(tmp_path):
    """JAX writes an entry in place and never replaces one: the empty entries a full disk
    left failed to load and compiled afresh at every start."""
    folder = tmp_path / "jax-version"
    folder.mkdir()
    (folder / "jit_forward-00ff-cache").write_bytes(b"")
    (folder / "jit_forward-11aa-cache").write_bytes(b"x\x9c")
    (folder / "notes").write_bytes(b"")
    _check_cache_folder(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["jit_forward-11aa-cache", "notes"]


_COMPILE_ONCE = """
import logging, sys
import jax, jax.numpy as jnp
from vit22b.model.compile_cache import enable_compile_cache
logging.basicConfig(level=logging.WARNING)
enable_compile_cache(sys.argv[1])
x = jnp.arange(12.0).reshape(3, 4)
print(float(jax.jit(lambda x: (jnp.sin(x) @ x.T).sum())(x)))
"""


def test_an_unreadable_compile_cache_entry_is_written_afresh(tmp_path):
    """JAX never replaces an entry: one cut short (a process killed while writing it) was
    read, refused by zlib and compiled afresh at every start."""

    def start() -> str:
        done = subprocess.run([sys.executable, "-c", _COMPILE_ONCE, str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr

    first = start()
    entries = [p for p in tmp_path.rglob("*-cache") if "sin" in p.name or "lambda" in p.name]
    assert len(entries) == 1, sorted(p.name for p in tmp_path.rglob("*"))
    whole = entries[0].read_bytes()
    entries[0].write_bytes(whole[: len(whole) // 2])
    second = start()
    assert "Error reading persistent compilation cache entry" in second
    assert f"removed the unreadable entry {entries[0].name}" in second
    decompress_executable(entries[0].read_bytes())  # written whole in its place
    third = start()
    assert "Error reading" not in third and "removed" not in third
    assert first.splitlines()[0] == second.splitlines()[0] == third.splitlines()[0]


_SWITCH_FOLDERS = """
import sys
import jax, jax.numpy as jnp
from vit22b.model.compile_cache import use_compile_cache
x = jnp.arange(12.0)
for folder, function in zip(sys.argv[1:], (jnp.sin, jnp.cos, jnp.tanh)):
    use_compile_cache(folder)
    jax.jit(lambda x: function(x).sum())(x).block_until_ready()
"""


def test_each_engine_compiles_into_its_own_cache_folder(tmp_path):
    """JAX opens its cache at the first compile and keeps it: a second LocalBackend in the
    same process, with another folder or 'off', wrote its programs into the first's folder."""
    first, second = tmp_path / "first", tmp_path / "second"
    done = subprocess.run([sys.executable, "-c", _SWITCH_FOLDERS, str(first), str(second), "off"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    def programs(folder):
        return sorted(p.name.split("-")[0] for p in folder.rglob("*-cache"))

    assert programs(first) == ["jit__lambda"] and programs(second) == ["jit__lambda"]
    assert [p.read_bytes() for p in first.rglob("*-cache")] != \
        [p.read_bytes() for p in second.rglob("*-cache")]  # sin's and cos's, not one twice


def test_a_warm_compile_cache_gives_identical_outputs(tmp_path):
    cache = str(tmp_path / "xla")
    flags = ("--mesh", "data=2,model=4", "--max-batch-images", "4", "--compile-cache", cache,
             "--log-level", "WARNING")
    got = []
    for _ in range(2):  # cold, then warm
        proc, address = serve_process(*flags)
        try:
            got.append(stub(address).Embed(request(3, 9), timeout=60))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        assert proc.returncode == 0
        entries = [p for p in (tmp_path / "xla").rglob("*") if p.is_file()]
        assert entries, "nothing was written to the compilation cache"
    assert got[0].pooled.data == got[1].pooled.data  # bit for bit
