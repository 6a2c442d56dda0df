"""The batcher's wait policy: a batch waits for company only while admitted images are still being
decoded (``--batch-wait decoding``, the default), or always up to the delay (``delay``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from serving import (
    assert_same_rows,
    in_process,
    metric,
    metrics,
    random_images,
    raw_image,
    start_server,
    stub,
    wait_for,
)
from vit22b.server.settings import ServeConfig
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

LONG_DELAY_MS = 30_000  # far longer than any test may take: a request that waits it out fails


@pytest.fixture(scope="module")
def server():
    srv = start_server(max_delay_ms=LONG_DELAY_MS, preprocess_threads=2)  # one held, one free
    yield srv
    srv.stop()


def batches(server) -> tuple[float, float]:
    """(batches, images) computed so far."""
    samples = metrics(server)
    return (metric(samples, "vit22b_batch_images_count"),
            metric(samples, "vit22b_batch_images_sum"))


def embed(server, images: list, timeout: float = 60) -> pb.EmbedResponse:
    return stub(server.address).Embed(pb.EmbedRequest(images=images), timeout=timeout)


def test_a_lone_request_does_not_wait_for_company_that_is_not_coming(server):
    pixels = random_images(2, seed=1, size=(64, 64))
    start = time.monotonic()
    response = embed(server, [raw_image(p) for p in pixels])
    assert time.monotonic() - start < LONG_DELAY_MS / 3e3  # a behaviour check, not a timing
    assert_same_rows(wire.from_tensor(response.pooled), in_process(server.engine, pixels)["pooled"])


def test_requests_queued_behind_a_running_batch_pack_into_one(server):
    engine, hold, entered = server.engine, threading.Event(), threading.Event()
    original = engine.forward

    def held(images, outputs):  # the compute thread busy: the others queue meanwhile
        entered.set()
        hold.wait(30)
        return original(images, outputs)

    pixels = random_images(6, seed=2, size=(64, 64))
    before = batches(server)
    engine.forward = held
    try:
        first = stub(server.address).Embed.future(pb.EmbedRequest(images=[raw_image(pixels[0])]),
                                                  timeout=60)
        assert entered.wait(30)  # its batch is running
        rest = [stub(server.address).Embed.future(pb.EmbedRequest(images=[raw_image(p)]),
                                                  timeout=60) for p in pixels[1:]]
        wait_for(lambda: len(server.server.batcher._queue) == 5)
        hold.set()
        responses = [first.result()] + [f.result() for f in rest]
    finally:
        hold.set()
        del engine.forward
    after = batches(server)
    assert after[1] - before[1] == 6
    assert after[0] - before[0] == 2  # the held one, then the five queued behind it together
    got = [wire.from_tensor(r.pooled)[0] for r in responses]
    assert_same_rows(np.stack(got), in_process(engine, pixels)["pooled"])


def test_a_queued_request_waits_for_images_still_being_decoded(server):
    infer, release = server.server.infer, threading.Event()
    original = infer._load

    def load(index, image, pre, opened=None):  # "slow" is still decoding while "fast" queues
        if image.id == "slow":
            release.wait(30)
        return original(index, image, pre, opened)

    pixels = random_images(3, seed=3, size=(64, 64))
    before = batches(server)
    infer._load = load  # the pool's and the handoff worker's step
    try:
        slow = stub(server.address).Embed.future(pb.EmbedRequest(
            images=[raw_image(pixels[0], "slow"), raw_image(pixels[1], "other")]), timeout=60)
        wait_for(lambda: server.server.batcher._decoding == 2)
        fast = stub(server.address).Embed.future(
            pb.EmbedRequest(images=[raw_image(pixels[2], "fast")]), timeout=60)
        wait_for(lambda: len(server.server.batcher._queue) == 1)  # "fast" waits in the queue
        release.set()
        responses = [slow.result(), fast.result()]
    finally:
        release.set()
        del infer._load
    after = batches(server)
    assert after[1] - before[1] == 3 and after[0] - before[0] == 1  # one batch of all three
    assert [list(r.ids) for r in responses] == [["slow", "other"], ["fast"]]


def test_the_wait_policy_is_a_declared_setting():
    assert ServeConfig().batch_wait == "decoding"
    with pytest.raises(ValueError, match="--batch-wait must be one of decoding, delay"):
        ServeConfig(batch_wait="never").check()
