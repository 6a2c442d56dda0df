"""Slow and silent HTTP clients, with raw sockets on loopback against a real server with short
bounds: a silent connection, a slowloris, a stalled body, a dripped one, oversized headers, a
client that does not read its responses, and more connections than the cap; each is closed (or
answered 408 / 431 / 503) in about its bound and not before, and well-behaved clients, slow ones
and kept-alive ones included, are still served."""

from __future__ import annotations

import base64
import json
import math
import select
import socket
import time

import httpx
import pytest
from serving import metric, metrics, png, random_images, start_server, wait_for

# the module server's header and body timeouts, seconds: long enough that the test's own
# pauses under them (T / 2, 0.6 T, T / 3) keep their margins on a loaded host
T = 1.5
RATE = 2000  # its body rate floor, bytes/s
# timer and clock granularity: a bound may not fire sooner than this before T (each clock is
# started before the act that starts the server's, so a late test thread cannot shorten it)
EARLY = 0.05
SLACK = 3.0  # a loaded machine's scheduling; a missing bound waits past it and fails
HEALTH = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"
OK = b"HTTP/1.1 200 "


@pytest.fixture(scope="module")
def server():
    srv = start_server(http_port=0, http_header_timeout_s=T, http_body_timeout_s=T,
                       http_min_body_rate=RATE)
    yield srv
    assert srv.stop()


def connect(srv, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting: it sets the window the server may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(T + SLACK)  # every wait bounded: a regression fails, it does not hang
    sock.connect(("127.0.0.1", srv.server.http_port))
    return sock


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or cuts) the connection."""
    reply = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return reply
        except TimeoutError:
            raise AssertionError(f"open after {sock.gettimeout()} s; got {reply[:200]!r}") from None
        if not chunk:
            return reply
        reply += chunk


def response(sock: socket.socket) -> bytes:
    """One whole response (with ``Content-Length``) off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def refusal(reply: bytes, status: int, flag: str) -> dict:
    """The refusal's error body, after checking its status line, that it closes, and its flag."""
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), reply[:300]
    assert b"\r\nconnection: close" in head.lower()
    error = json.loads(body)["error"]
    assert flag in error["message"]
    return error


def still_serves(srv) -> None:
    """A normal request and a feature call, on new connections."""
    url = srv.http_url
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    image = base64.b64encode(png(random_images(1, seed=61)[0])).decode()
    answer = httpx.post(url + "/v1/features", json={"images": [image]}, timeout=60)
    assert answer.status_code == 200, answer.text


def ended(srv, reason: str) -> float:
    """Connections the door's bounds have ended for ``reason`` (its metric)."""
    return metric(metrics(srv), "vit22b_http_connections_ended_total", reason=reason)


def test_a_silent_connection_is_closed_after_the_header_timeout(server):
    before = ended(server, "silent")
    start = time.monotonic()
    with connect(server) as sock:
        reply = until_closed(sock)
        elapsed = time.monotonic() - start
    assert reply == b""  # nothing was asked: nothing is answered
    assert T - EARLY <= elapsed < T + SLACK
    assert ended(server, "silent") == before + 1
    still_serves(server)


def trickle(sock: socket.socket, head: bytes, start: float) -> tuple[bytes, float, int]:
    """Send ``head``, then one more header byte every 50 ms until the server answers or closes:
    (its reply, seconds since ``start`` it took, bytes trickled)."""
    sock.sendall(head)
    reply, sent = b"", 0
    sock.settimeout(0.05)
    while time.monotonic() - start < T + SLACK:
        try:
            sock.sendall(b"a")
            sent += 1
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if not chunk:
            break
        reply += chunk
    return reply, time.monotonic() - start, sent


def test_a_slowloris_is_answered_408_although_it_keeps_sending(server):
    before = ended(server, "header_timeout")
    start = time.monotonic()
    with connect(server) as sock:
        reply, elapsed, sent = trickle(sock, b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: ",
                                       start)
    error = refusal(reply, 408, "--http-header-timeout")
    assert error["code"] == "DEADLINE_EXCEEDED" and error["type"] == "RequestTimeout"
    assert T - EARLY <= elapsed < T + SLACK
    assert sent >= 5  # a byte every 50 ms all along: the clock is not reset by them
    assert ended(server, "header_timeout") == before + 1
    still_serves(server)


def test_a_kept_alive_connection_is_served_in_time_and_bounded_after(server):
    with connect(server) as sock:
        for _ in range(3):  # each next request comes within the timeout: served
            sock.sendall(HEALTH)
            assert response(sock).startswith(OK)
            time.sleep(T / 2)
        # uvicorn's keep-alive timer stops at the next request's first byte: the header clock,
        # running since the end of the last response, still bounds a trickle
        start = time.monotonic()
        sock.sendall(HEALTH)
        assert response(sock).startswith(OK)
        reply, elapsed, _ = trickle(sock, b"GET /health HTTP/1.1\r\n", start)
    refusal(reply, 408, "--http-header-timeout")
    assert T - EARLY <= elapsed < T + SLACK
    silent = ended(server, "silent")
    with connect(server) as sock:  # and an idle one is closed, without an answer
        start = time.monotonic()
        sock.sendall(HEALTH)
        assert response(sock).startswith(OK)
        assert until_closed(sock) == b""
        assert T - EARLY <= time.monotonic() - start < T + SLACK
    assert ended(server, "silent") == silent  # an idle kept-alive close is not a bound's


def features_request(length: int) -> bytes:
    return (b"POST /v1/features HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def test_a_stalled_body_is_408_and_holds_no_place(server):
    route = {"method": "POST /v1/features", "code": "DEADLINE_EXCEEDED"}
    before = metric(metrics(server), "vit22b_requests_total", **route)
    with connect(server) as sock:
        start = time.monotonic()
        sock.sendall(features_request(1000) + b'{"images": [')
        reply = until_closed(sock)
        elapsed = time.monotonic() - start
    error = refusal(reply, 408, "--http-body-timeout")
    assert error["code"] == "DEADLINE_EXCEEDED"
    assert T - EARLY <= elapsed < T + SLACK
    samples = metrics(server)
    assert metric(samples, "vit22b_requests_total", **route) == before + 1
    assert metric(samples, "vit22b_queue_images") == 0  # read before admission: nothing held
    gone = {"method": "POST /v1/features", "code": "CANCELLED"}
    left = metric(samples, "vit22b_requests_total", **gone)
    with connect(server) as sock:  # a client that goes away mid-body: nothing to answer,
        sock.sendall(features_request(1000) + b'{"images": [')  # counted (it was not)
    wait_for(lambda: metric(metrics(server), "vit22b_requests_total", **gone) == left + 1)
    still_serves(server)


def test_a_slow_body_that_keeps_coming_is_served(server):
    image = base64.b64encode(png(random_images(1, seed=62)[0])).decode()
    body = json.dumps({"images": [image]}).encode()
    third = len(body) // 3
    pieces = [body[:third], body[third:-8], body[-8:]]
    with connect(server) as sock:
        sock.sendall(features_request(len(body)))
        start = time.monotonic()
        for piece in pieces:  # each pause under the timeout, all of them over it
            time.sleep(T * 0.6)
            sock.sendall(piece)
        reply = response(sock)
        assert time.monotonic() - start > T
    assert reply.startswith(OK), reply[:300]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["outputs"]["pooled"]["shape"] == [1, 64]


def test_a_dripped_body_is_408_once_it_averages_under_the_floor(server):
    """Bytes every T / 3, never a stall: only the rate floor ends it, after its grace of T; a
    body that sent 6,000 bytes at once earned 6000 / RATE seconds (an average, not each gap)."""
    route = {"method": "POST /v1/features", "code": "DEADLINE_EXCEEDED"}
    before = metric(metrics(server), "vit22b_requests_total", **route)
    assert 6000 / RATE > T  # the second body's bound is its average's, not the grace
    for upfront, bound in ((0, T), (6000, 6000 / RATE)):
        with connect(server) as sock:
            sock.settimeout(bound + SLACK)
            start = time.monotonic()
            sock.sendall(features_request(100_000) + b'{"images": [' + b" " * upfront)
            while time.monotonic() - start < bound + SLACK:  # drip until the server answers
                if select.select([sock], [], [], T / 3)[0]:
                    break
                sock.sendall(b" " * 10)
            reply = until_closed(sock)
            elapsed = time.monotonic() - start
        error = refusal(reply, 408, "--http-min-body-rate")
        assert "bytes/s" in error["message"] and error["code"] == "DEADLINE_EXCEEDED"
        assert bound - EARLY <= elapsed < bound + SLACK, (upfront, elapsed)
    samples = metrics(server)
    assert metric(samples, "vit22b_requests_total", **route) == before + 2
    assert metric(samples, "vit22b_queue_images") == 0  # read before admission: nothing held
    still_serves(server)


def test_headers_over_the_limit_are_431(server):
    before = ended(server, "headers_too_large")
    line = b"X-Big: " + b"a" * 8000 + b"\r\n"
    with connect(server) as sock:  # 48 KB of headers pass
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n" + line * 6 + b"\r\n")
        assert response(sock).startswith(OK)
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        time.sleep(0.05)  # the request has begun when the rest comes
        try:
            # 480 KB, never ended: over the limit even where a late server's first read (up to
            # 256 KiB, the chunk a request begins in, not counted) takes much of it
            for _ in range(60):
                sock.sendall(line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused meanwhile
        reply = until_closed(sock)
    error = refusal(reply, 431, "over 64 KiB")
    assert error["type"] == "HeadersTooLarge"
    assert ended(server, "headers_too_large") == before + 1
    still_serves(server)


def pipelined(srv, reading, megabytes: int) -> tuple[int, int]:
    """Send enough pipelined ``GET /openapi.json`` for ``megabytes`` of responses (some 3 fit
    in the kernel's buffers), then ``reading(sock, count)``: (responses asked, responses read)."""
    size = len(httpx.get(srv.http_url + "/openapi.json", timeout=30).content)
    count = math.ceil((megabytes << 20) / size)
    with connect(srv, rcvbuf=4096) as sock:
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: test\r\n\r\n" * count)
        return count, reading(sock, count).count(OK)


def test_a_client_that_does_not_read_its_responses_is_cut(server):
    def late(sock: socket.socket, count: int) -> bytes:
        # reads nothing for four body timeouts: the server's first look may still see its
        # writes moving, so the cut may come at its second
        time.sleep(4 * T)
        return until_closed(sock)

    before = ended(server, "response_unread")
    asked, read = pipelined(server, late, 4)
    assert read < asked  # cut: the rest were never written
    assert ended(server, "response_unread") == before + 1
    still_serves(server)


def test_a_client_that_reads_slowly_gets_every_response(server):
    BURST = 256 << 10  # then a pause: about 2 MB/s, slower than the server writes
    def slowly(sock: socket.socket, count: int) -> bytes:
        reply, seen, pause_at = b"", 0, BURST
        while seen < count:  # not until closed: a kept-alive connection may stay open
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
            seen += reply[max(0, len(reply) - len(chunk) - len(OK) + 1) :].count(OK)
            if len(reply) >= pause_at:  # so the server's writes wait on it all along
                pause_at += BURST
                time.sleep(0.1)  # well under the body timeout each time
        return reply

    asked, read = pipelined(server, slowly, 8)
    assert read == asked


def test_connections_over_the_cap_are_503_and_the_rest_served():
    srv = start_server(http_port=0, http_max_connections=3)
    held = [connect(srv) for _ in range(3)]
    try:
        for sock in held:  # open and served (so counted by the server)
            sock.sendall(HEALTH)
            assert response(sock).startswith(OK)
        with connect(srv) as extra:
            reply = until_closed(extra)
        error = refusal(reply, 503, "--http-max-connections")
        assert error["code"] == "UNAVAILABLE"
        assert b"\r\nretry-after: 1" in reply.lower()
        assert ended(srv, "too_many_connections") == 1
        for sock in held:  # the held ones still work
            sock.sendall(HEALTH)
            assert response(sock).startswith(OK)
        held.pop().close()

        def served() -> bool:
            with connect(srv) as sock:
                sock.sendall(HEALTH)
                return sock.recv(65536).startswith(OK)

        wait_for(served, timeout=10)  # a place freed is taken again
    finally:
        for sock in held:
            sock.close()
        assert srv.stop()
