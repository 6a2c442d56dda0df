"""The client SDK: no jax, inputs, chunking, retries, several addresses, the async twin."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
from PIL import Image
from serving import (
    assert_same_rows,
    in_process,
    metric,
    metrics,
    png,
    random_images,
    start_server,
    wait_for,
)
from vit22b.clients import (
    AsyncFeatureClient,
    Embeddings,
    FeatureClient,
    FeatureError,
    InvalidImage,
    MixedModelsError,
    Retry,
)
from vit22b.clients.client import (
    MAX_TIMEOUT_S,
    EmbedOptions,
    build_request,
    check_count,
    check_timeout,
    chunk_items,
    chunk_result,
)
from vit22b.clients.embeddings import ImageError, merge
from vit22b.clients.inputs import Item, as_images, items, to_proto, wire_size
from vit22b.model import OutputRequest
from vit22b.model.errors import InvalidRequest
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire


def test_importing_the_client_never_imports_jax():
    code = (
        "import sys\n"
        "import vit22b.clients as c\n"
        "c.FeatureClient, c.AsyncFeatureClient, c.Embeddings, c.Retry\n"
        "import vit22b.clients.client, vit22b.clients.aio, vit22b.clients.demo\n"
        "import vit22b.clients.outputs  # the output reader: numpy alone\n"
        "import vit22b.v1.wire, vit22b.v1.features_pb2_grpc\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- inputs -----------------------------------------------------------------------------------


def test_one_image_or_many():
    array = np.zeros((8, 9, 3), np.uint8)
    assert len(as_images("a.png")) == 1 and len(as_images(b"\x89PNG")) == 1
    assert len(as_images(array)) == 1 and len(as_images(np.stack([array] * 4))) == 4
    assert len(as_images(Image.new("RGB", (4, 4)))) == 1


def test_pixels_are_sent_raw_and_converted_to_rgb():
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4)
    rgba = np.full((3, 4, 4), 255, np.uint8)
    palette = Image.fromarray(gray).convert("P")
    for image in (gray, rgba, palette, Image.fromarray(gray)):
        proto = to_proto(next(items([image])))
        pixels = wire.from_tensor(proto.pixels)
        assert pixels.shape == (3, 4, 3) and pixels.dtype == np.uint8
    np.testing.assert_array_equal(
        wire.from_tensor(to_proto(next(items([gray]))).pixels)[..., 1], gray
    )


def test_bad_local_inputs_name_their_index(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")  # read, it would wait for a writer for ever
    bad = [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4, 2), np.uint8), tmp_path / "missing.png",
           tmp_path / "pipe.png", tmp_path]
    reasons = ["must be uint8", r"must be \[H, W\]", "cannot read", "not a regular file: a FIFO",
               "not a regular file: a folder"]
    for image, reason in zip(bad, reasons):
        with pytest.raises(InvalidImage, match=f"image 1.*{reason}"):
            [to_proto(i) for i in items([np.zeros((4, 4, 3), np.uint8), image])]


def test_open_files_are_read_as_encoded_images_and_named_by_their_path(tmp_path):
    """A file opened for binary reading (or an io.BytesIO) is one image, its bytes read when
    its request is built; one open file alone is not iterated as lines; a closed file or one in
    text mode is that image's refusal, named."""
    import io

    picture = tmp_path / "x.png"
    Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3)).save(picture)
    data = picture.read_bytes()
    with open(picture, "rb") as f:
        (only,) = list(items(f))
        assert (only.index, only.id, only.image, only.size) == (0, str(picture), data, len(data))
        assert to_proto(only).encoded == data
    buffer = io.BytesIO(b"xx" + data)
    buffer.seek(2)  # read from where it stands
    listed = list(items([buffer, data]))
    assert [(i.id, i.image) for i in listed] == [("0", data), ("1", data)]
    closed = open(picture, "rb")
    closed.close()
    with open(picture) as text:
        for image, reason in ((closed, "cannot read the open file: read of closed file"),
                              (text, "an open file in text mode: open an image file with 'rb'")):
            (item,) = list(items([image]))
            with pytest.raises(InvalidImage, match=f"^image 0 \\(id '{picture}'\\): {reason}$"):
                to_proto(item)


def test_an_open_file_is_read_no_further_than_the_limit_per_image(monkeypatch):
    """open("/dev/zero", "rb") would be read for ever: an open file is read to one byte
    past the limit per image file, then refused."""
    import vit22b.clients.inputs as inputs

    monkeypatch.setattr(inputs, "MAX_IMAGE_BYTES", 1000)
    with open("/dev/zero", "rb") as zero:
        (item,) = list(items([zero]))
    assert item.size == 0 and isinstance(item.image, InvalidImage)
    assert str(item.image) == ("image 0 (id '/dev/zero'): the open file holds over 1000 bytes, "
                               "the limit per image file")


@pytest.mark.parametrize("dtype, hint", [
    (np.float64, "; for floats in [0, 1] pass (x * 255).round().astype(np.uint8)"),
    (np.uint16, "; for 16-bit levels pass (x / 257).round().astype(np.uint8)"),
    (np.int64, ""), (bool, ""),
])
def test_a_pixel_dtype_refusal_hints_only_at_its_own_dtype(dtype, hint):
    """uint16, int64 and bool pixels were told how to scale floats in [0, 1]."""
    with pytest.raises(InvalidImage) as refused:
        to_proto(next(items([np.zeros((4, 4, 3), dtype)])))
    assert str(refused.value) == (
        f"image 0: numpy images must be uint8 RGB, got {np.dtype(dtype)}{hint}")


def _info(max_batch=8, max_request=16, max_bytes=64 << 10) -> pb.ModelInfo:
    return pb.ModelInfo(
        width=64,
        depth=4,
        heads=4,
        num_patches=16,
        limits=pb.Limits(
            max_batch_images=max_batch, max_request_images=max_request, max_message_bytes=max_bytes
        ),
    )


def test_chunks_respect_images_per_request_and_message_size():
    small = [np.zeros((10, 10, 3), np.uint8)] * 20
    sizes = [len(c) for c in chunk_items(items(small), _info(), EmbedOptions(), None)]
    assert sizes == [8, 8, 4]  # the server's batch by default
    sizes = [len(c) for c in chunk_items(items(small), _info(), EmbedOptions(), 100)]
    assert sizes == [16, 4]  # never more than the server takes per request
    big = [np.zeros((60, 60, 3), np.uint8)] * 10  # 10.8 kB each; 64 kB messages
    chunks = list(chunk_items(items(big), _info(), EmbedOptions(), 100))
    assert [len(c) for c in chunks] == [5, 5]
    # Responses count too: pooled + 4 layers of patch tokens are 16.6 kB per image in float32.
    options = EmbedOptions(layers=(0, 1, 2, 3))
    chunks = list(chunk_items(items(small), _info(), options, 100))
    assert [len(c) for c in chunks] == [3] * 6 + [2]
    half = EmbedOptions(layers=(0, 1, 2, 3), dtype="float16")
    assert len(next(chunk_items(items(small), _info(), half, 100))) == 7
    with pytest.raises(InvalidImage, match="image 0: its outputs"):
        list(chunk_items(items(small), _info(max_bytes=16 << 10), options, None))


def test_an_image_over_the_message_limit_is_skipped_unread_with_skip_invalid(tmp_path):
    huge = tmp_path / "huge.png"
    huge.write_bytes(b"\x89PNG" + bytes(70 << 10))  # over 64 kB messages: never read or sent
    inputs = [np.zeros((10, 10, 3), np.uint8), str(huge), np.zeros((10, 10, 3), np.uint8)]
    with pytest.raises(InvalidImage, match="image 1 .*its bytes exceed"):
        list(chunk_items(items(inputs), _info(), EmbedOptions(), None))
    (chunk,) = chunk_items(items(inputs), _info(), EmbedOptions(skip_invalid=True), None)
    request, sent, errors = build_request(chunk, EmbedOptions(skip_invalid=True))
    assert sent == [0, 2] and len(request.images) == 2
    assert [(e.index, e.id) for e in errors] == [(1, str(huge))]
    assert "its bytes exceed the server's message limit" in errors[0].reason


def test_options_are_checked_before_sending():
    with pytest.raises(InvalidRequest, match="unknown output"):
        EmbedOptions(outputs=("pooled", "cls"))
    with pytest.raises(ValueError, match="float64"):
        EmbedOptions(dtype="float64")
    request = EmbedOptions(outputs=("pooled",), layers=(-1, -1, 2)).request([])
    assert list(request.patch_layers) == [-1, 2]
    assert [wire.kind_name(k) for k in request.outputs] == ["pooled", "patch_tokens"]


def test_embed_keywords_spelled_alike_share_their_options_and_refusals_repeat():
    from vit22b.clients.client import chunk_result, options_of

    first = options_of({"outputs": ["pooled"], "layers": [-1], "l2_normalize": True})
    assert first is options_of({"l2_normalize": True, "layers": [-1], "outputs": ["pooled"]})
    assert first.request([]) == EmbedOptions(("pooled",), (-1,), l2_normalize=True).request([])
    assert options_of({"l2_normalize": 1}) is not options_of({"l2_normalize": True})
    for _ in range(2):  # a refusal is not remembered as an answer
        with pytest.raises(InvalidRequest, match="unknown output"):
            options_of({"outputs": ["cls"]})
    assert options_of({"resolution": 224}).request([]).resolution == 224
    with pytest.raises(ValueError, match="resolution must be an integer >= 0, got 224.0"):
        options_of({"resolution": 224.0})  # as uncached: an int field takes no float
    with pytest.raises(InvalidRequest, match=r"layer \[1\] is not an integer"):
        options_of({"layers": [[1]]})  # unhashable: spelled anew, to its own error
    # one kind or one layer as itself, None as the default; what would be misread is refused
    assert options_of({"outputs": "pooled", "layers": -1}).asked == OutputRequest.of(
        ["pooled"], [-1])
    assert options_of({"outputs": None, "layers": None}).asked == OutputRequest.of()
    assert options_of({"dtype": np.float16}).dtype == "float16"
    for keywords, message in [
        ({"layers": [1.5]}, "layer 1.5 is not an integer"),  # was layer 1, silently
        ({"layers": [True]}, "layer True is not an integer"),
        ({"layers": [2**40]}, "layer index 1099511627776 is out of range"),
        ({"resolution": True}, "resolution must be an integer"),
        ({"resolution": 2**40}, "resolution must be an integer"),
        ({"skip_invalid": "no"}, "skip_invalid must be True or False, got 'no'"),
        ({"l2_normalize": None}, "l2_normalize must be True or False, got None"),
        ({"dense": 2}, "dense must be True or False, got 2"),
        ({"dtype": np.float64}, "dtype 'float64' is not one of"),
        ({"dtype": object()}, "dtype <object object"),
    ]:
        with pytest.raises(ValueError, match=message):
            options_of(keywords)
    # A response's rows and errors in the caller's indices: input 1 was unreadable here, so the
    # request carried inputs 0, 2 and 3; the server refused its second image (input 2).
    response = pb.EmbedResponse(ids=["a", "d"], indices=[0, 2],
                                errors=[pb.ImageError(index=1, id="c", reason="bad")])
    result = chunk_result(response, [0, 2, 3], [ImageError(1, "b", "unreadable")])
    assert list(result.indices) == [0, 3] and result.ids == ["a", "d"]
    assert [(e.index, e.id) for e in result.errors] == [(1, "b"), (2, "c")]


def test_output_requests_spelled_alike_are_one_and_refusals_repeat():
    spellings = [((), (), False), (("pooled",), (), False), (("patch_tokens",), (), True),
                 ((), (2, -1, 2), False), (["class_token", "pooled"], [0], False)]
    for kinds, layers, norm in spellings:
        once = OutputRequest.of(kinds, layers, norm)
        assert OutputRequest.of(list(kinds), tuple(layers), norm) is once  # remembered
        assert once == OutputRequest._spell(tuple(kinds), tuple(layers), norm)  # as spelled
    assert OutputRequest.of((), (2, -1, 2)).patch_layers == (2, -1)
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="unknown output 'cls'"):
            OutputRequest.of(("cls",))
        with pytest.raises(InvalidRequest, match="is not an integer"):  # an unhashable layer
            OutputRequest.of((), ([1],))  # is spelled anew, to the same error
        # as l2_normalize without pooled: it changed nothing, yet compiled a forward of its own
        with pytest.raises(InvalidRequest, match="normalize_patches applies to patch tokens"):
            OutputRequest.of(("pooled", "attention_stats"), (), True)


def test_one_response_merged_is_what_the_general_merge_gives():
    from vit22b.clients.client import chunk_result
    from vit22b.clients.embeddings import Embeddings, ImageError

    pooled = np.arange(12, dtype=np.float32).reshape(3, 4)
    response = pb.EmbedResponse(
        model=pb.ModelRef(name="m"), ids=["a", "c", "d"],
        indices=[0, 2, 3], errors=[pb.ImageError(index=1, id="b", reason="bad")],
        pooled=wire.to_tensor(pooled), grid_rows=4, grid_cols=4)
    local = [ImageError(9, "z", "unreadable here")]
    part = chunk_result(response, [10, 11, 12, 13], local)
    np.testing.assert_array_equal(part.indices, [10, 12, 13])
    assert [(e.index, e.id) for e in part.errors] == [(9, "z"), (11, "b")]
    alone, general = merge([part]), merge([part, Embeddings()])  # the second: the loop
    for name in ("ids", "errors", "model", "timings", "grid"):
        assert getattr(alone, name) == getattr(general, name), name
    np.testing.assert_array_equal(alone.indices, general.indices)
    np.testing.assert_array_equal(alone.pooled, general.pooled)


class _Failure(grpc.RpcError):
    def __init__(self, code, details=""):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_retry_policy():
    retry = Retry(attempts=3, initial_s=0.1, max_s=0.3)
    assert retry.should_retry(_Failure(grpc.StatusCode.UNAVAILABLE), 0)
    assert retry.should_retry(_Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), 1)
    assert not retry.should_retry(_Failure(grpc.StatusCode.UNAVAILABLE), 2)  # attempts spent
    assert not retry.should_retry(_Failure(grpc.StatusCode.INVALID_ARGUMENT), 0)
    too_big = _Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max")
    assert not retry.should_retry(too_big, 0)
    delays = [retry.delay(a) for a in range(5)]
    assert all(0.05 <= d <= 0.3 for d in delays) and delays[-1] >= 0.15


def test_results_of_different_models_are_not_merged():
    a = Embeddings(
        pooled=np.zeros((1, 4), np.float32),
        ids=["a"],
        indices=np.array([0]),
        model=pb.ModelRef(name="m", fingerprint="1", preprocess_hash="p"),
    )
    b = Embeddings(
        pooled=np.zeros((1, 4), np.float32),
        ids=["b"],
        indices=np.array([1]),
        model=pb.ModelRef(name="m", fingerprint="2", preprocess_hash="p"),
    )
    with pytest.raises(MixedModelsError):
        merge([a, b])
    b.model = a.model
    assert merge([a, b]).pooled.shape == (2, 4)


# ---- against real servers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers():
    pair = [start_server(max_delay_ms=5), start_server(max_delay_ms=5)]
    yield pair
    for srv in pair:
        srv.stop()


def test_nothing_computed_still_gives_every_output_with_no_rows(servers, tmp_path):
    """skip_invalid with every image refused: `pooled` was None when the SDK refused them
    (or they filled several requests) and a [0, 64] array when one request's worth were
    refused by the server; now each output asked for has no rows, whichever refused, on
    every call kind."""
    from vit22b.clients import AsyncFeatureClient

    missing = [tmp_path / f"gone{i}.png" for i in range(3)]  # refused here, unsent
    junk = [b"junk"] * 3  # refused by the server
    asked = {"outputs": ["pooled"], "layers": [-1], "skip_invalid": True, "batch_size": 2,
             "dtype": "bfloat16"}

    def check(result, count: int) -> None:
        assert len(result) == 0 and len(result.errors) == count
        assert result.pooled.shape == (0, 64) and result.pooled.dtype == ml_dtypes.bfloat16
        assert result.patch_tokens[-1].shape == (0, 16, 64)

    with FeatureClient(servers[0].address) as client:
        for images in (missing, junk, missing + junk, junk[:1]):
            check(client.embed(images, **asked), len(images))
            with client.session() as session:
                check(session.embed(images, **asked), len(images))
    check(asyncio.run(AsyncFeatureClient(servers[0].address).embed(missing + junk, **asked)), 6)


def test_a_refused_image_is_named_by_the_callers_index_across_requests(servers):
    """An input split into requests: the server names a bad image by its index in its
    request ("image 1 ... (request of images 2..3)"); the error now says the caller's 3, as
    ``index`` does, on every call kind."""
    from vit22b.clients import AsyncFeatureClient

    images = [*random_images(3, seed=31, size=(64, 64)), b"not an image", *random_images(
        2, seed=32, size=(64, 64))]
    ids = [f"im{i}" for i in range(len(images))]
    with FeatureClient(servers[0].address) as client:
        calls = [lambda: client.embed(images, ids=ids, batch_size=2)]
        session = client.session()
        calls.append(lambda: session.embed(images, ids=ids, batch_size=2))
        calls.append(lambda: asyncio.run(AsyncFeatureClient(servers[0].address).embed(
            images, ids=ids, batch_size=2)))
        for call in calls:
            with pytest.raises(FeatureError) as refused:
                call()
            assert refused.value.index == 3 and refused.value.details.startswith("image 1 ")
            assert str(refused.value).startswith("INVALID_ARGUMENT: image 3 (id 'im3'): ")
            assert "request of images" not in str(refused.value)
        session.close()


def test_leaving_a_split_embed_early_ends_its_running_calls_at_once():
    """Ctrl-C (here a signal whose handler raises) while the pool's calls wait on the server:
    the exit waited for them to finish or time out (120 s by default, for ever with no
    timeout). Their gRPC calls are cancelled now, and the interruption is the caller's."""
    import signal
    import time

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    srv = start_server(max_delay_ms=8_000, batch_wait="delay")  # lone calls wait 8 s
    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        with FeatureClient(srv.address, concurrency=2, timeout=60) as client:
            images = random_images(4, seed=33, size=(64, 64))
            start = time.monotonic()
            timer.start()
            with pytest.raises(Interrupted):
                client.embed(images, batch_size=1)  # two calls in flight, waiting
            assert time.monotonic() - start < 5
            wait_for(lambda: metric(metrics(srv), "vit22b_queue_images") == 0, timeout=30)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
        srv.stop()


def test_requests_are_spread_over_several_addresses(servers):
    images = random_images(24, seed=30, size=(64, 64))
    before = [
        metric(metrics(s), "vit22b_requests_total", method="Embed", code="OK") for s in servers
    ]
    with FeatureClient([s.address for s in servers]) as client:
        got = client.embed(images, batch_size=4)
    assert got.ids == [str(i) for i in range(24)]
    assert_same_rows(got.pooled, in_process(servers[0].engine, images)["pooled"])
    calls = [
        metric(metrics(s), "vit22b_requests_total", method="Embed", code="OK") - b
        for s, b in zip(servers, before)
    ]
    assert calls == [3, 3]  # six requests, round-robin


def _dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"  # closed again: nothing listens


def test_an_unreachable_address_is_retried_on_the_next(servers):
    images = random_images(12, seed=31, size=(64, 64))
    retry = Retry(attempts=4, initial_s=0.01, max_s=0.05)
    with FeatureClient([_dead_address(), servers[0].address], retry=retry) as client:
        got = client.embed(images, batch_size=4)
    assert_same_rows(got.pooled, in_process(servers[0].engine, images)["pooled"])


def test_iter_embed_reads_a_generator_lazily_and_keeps_order(servers, tmp_path):
    images = random_images(10, seed=32, size=(64, 64))
    paths = []
    for i, pixels in enumerate(images):
        paths.append(tmp_path / f"{i}.png")
        paths[-1].write_bytes(png(pixels))
    paths[4] = tmp_path / "missing.png"
    with FeatureClient(servers[0].address, concurrency=2) as client:
        parts = list(
            client.iter_embed((p for p in paths), batch_size=3, skip_invalid=True, progress=True)
        )
    assert [len(p) for p in parts] == [3, 2, 3, 1]
    merged = merge(parts)
    assert list(merged.indices) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert [(e.index, "cannot read" in e.reason) for e in merged.errors] == [(4, True)]
    kept = [images[i] for i in merged.indices]
    assert_same_rows(merged.pooled, in_process(servers[0].engine, kept)["pooled"])


def test_async_client_matches_the_blocking_one(servers):
    images = random_images(9, seed=33)

    async def main():
        async with AsyncFeatureClient([s.address for s in servers], concurrency=3) as client:
            info = await client.model_info()
            got = await client.embed(
                images, outputs=["pooled"], layers=[-1], batch_size=2, dtype="bfloat16"
            )
            return info, got

    info, got = asyncio.run(main())
    assert info.model.name == "vit-22b-tiny/16"
    assert got.ids == [str(i) for i in range(9)] and len(got.timings) == 5
    want = in_process(servers[0].engine, images, OutputRequest(patch_layers=(-1,)))
    assert_same_rows(got.pooled.astype(np.float32), want["pooled"])
    assert_same_rows(
        got.patch_tokens[-1].astype(np.float32).reshape(9, -1),
        want["patch_tokens"][3].reshape(9, -1),
    )


def test_sdk_inputs_follow_the_pixel_contract():
    """PIL images and RGBA arrays get the server's rules (16-bit scaled, alpha over the
    background, EXIF orientation), never a silent clip or a dropped alpha channel."""
    from PIL import Image
    from vit22b.clients.inputs import Item, to_proto
    from vit22b.model.pixels import BACKGROUND

    values = np.array([[0, 65535], [32768, 257]], "<u2")
    grey16 = Image.frombytes("I;16", (2, 2), values.tobytes())
    got = wire.from_tensor(to_proto(Item(0, grey16, "a", 0)).pixels)
    np.testing.assert_array_equal(got[..., 0], [[0, 255], [128, 1]])
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque; the others fully transparent
    got = wire.from_tensor(to_proto(Item(0, rgba, "b", 0)).pixels)
    np.testing.assert_array_equal(got[0, 0], (10, 20, 30))
    np.testing.assert_array_equal(got[1, 1], np.broadcast_to(BACKGROUND, (3,)))
    with pytest.raises(InvalidImage, match="image 2.*: in-memory image in mode F"):
        to_proto(Item(2, Image.fromarray(np.zeros((2, 2), np.float32)), "c", 0))
    # An RGBX / BGRX buffer (a screen capture's, padding 0) read as RGBA showed nothing: every
    # such array was embedded as the same white image. Refused, naming the way out.
    rgbx = np.random.default_rng(0).integers(0, 256, (5, 6, 4), dtype=np.uint8)
    rgbx[..., 3] = 0
    with pytest.raises(InvalidImage, match=r"image 4 \(id 'd'\): .*every pixel's alpha .* is 0: "
                                           r"it would be embedded as a blank white image.*"
                                           r"image\[\.\.\., :3\]"):
        to_proto(Item(4, rgbx, "d", 0))
    got = wire.from_tensor(to_proto(Item(0, rgbx[..., :3], "e", 0)).pixels)
    np.testing.assert_array_equal(got, rgbx[..., :3])


@pytest.mark.parametrize("value, kind", [(None, "NoneType"), (5, "int"), (2.5, "float"),
                                         ({"a": 1}, "dict"), (object(), "object")])
def test_what_is_no_image_is_named_by_its_type(value, kind):
    with pytest.raises(InvalidImage, match=rf"image 3 \(id 'x'\): a {kind}, not an image: pass "
                                           r"a path, encoded bytes, a PIL image or a uint8"):
        to_proto(Item(3, value, "x", 0))


def test_a_memoryview_or_bytearray_travels_as_the_files_bytes():
    encoded = png(random_images(1, 2, (6, 5))[0])
    for view in (memoryview(encoded), bytearray(encoded)):
        assert to_proto(Item(0, view, "v", 0)).encoded == encoded
        assert wire_size(view) == len(encoded)
        assert list(as_images(view)) == [view]


def _response(ids, indices, pooled, patch=None, **fields) -> pb.EmbedResponse:
    response = pb.EmbedResponse(ids=ids, indices=indices, **fields)
    response.pooled.CopyFrom(wire.to_tensor(np.asarray(pooled, np.float32)))
    if patch is not None:
        response.patch_tokens[-1].CopyFrom(wire.to_tensor(np.asarray(patch, np.float32)))
    return response


@pytest.mark.parametrize("response, reason", [
    (_response(["a"], [0], np.zeros((3, 4))), "pooled of shape [3, 4] for 1 images"),
    (_response(["a", "b"], [0, 1], np.zeros(8)), "pooled of shape [8] for 2 images"),
    (_response(["a", "b"], [0, 1], np.zeros((2, 4)), patch=np.zeros((5, 4, 4))),
     "patch_tokens[-1] of shape [5, 4, 4] for 2 images"),
    (_response(["a", "b"], [1], np.zeros((1, 4))), "1 indices for 2 ids"),
    (_response(["a"], [-1], np.zeros((1, 4))), "image index -1 is not one of the request's 2"),
    (_response(["a"], [5], np.zeros((1, 4))), "image index 5 is not one of"),
    (_response([], [], np.zeros((0, 4)), errors=[pb.ImageError(index=-2, id="b", reason="x")]),
     "image index -2"),
])
def test_a_malformed_response_is_refused_not_misattributed(response, reason):
    """The SDK checks a response's rows against its ids and its indices against the request:
    a row count that disagrees or a negative index was returned silently, and after a merge
    another image's row stood under an id (found by fuzzing responses)."""
    with pytest.raises(wire.WireError, match=re.escape(f"malformed response: {reason}")):
        chunk_result(response, [10, 11], [])
    good = chunk_result(_response(["a", "b"], [1, 0], np.eye(2, 4)), [10, 11], [])
    assert good.indices.tolist() == [11, 10] and good.pooled.shape == (2, 4)


def test_float_tensor_shapes_beyond_any_array_are_wire_errors():
    for dtype in ("float32", "float16", "bfloat16"):  # 0 bytes, yet 2**62 items of 2-4 bytes
        tensor = pb.Tensor(dtype=wire.dtype_code(dtype), shape=[0, 1 << 62])
        with pytest.raises(wire.WireError, match="beyond any array's size"):
            wire.from_tensor(tensor)


def test_ids_must_be_one_per_image():
    """Misaligned ids would label every row after the gap with another image's id: refused,
    before any image when both have a length, else when they part."""
    images = [np.zeros((4, 4, 3), np.uint8)] * 2
    assert [i.id for i in items(images, ["x", "y"])] == ["x", "y"]
    assert [i.id for i in items(images, (str(i) for i in range(2)))] == ["0", "1"]
    for ids, words in ((["x"], "1 ids for 2 images"), (["x", "y", "z"], "3 ids for 2 images")):
        with pytest.raises(ValueError, match=words):
            list(items(images, ids))
    with pytest.raises(ValueError, match="the ids ran out at image 1"):
        list(items(iter(images), iter(["x"])))
    with pytest.raises(ValueError, match="more ids than the 2 images"):
        list(items(iter(images), iter(["x", "y", "z"])))
    # ids are text: an int or a path as written; bytes or None were labels like "b'a'"
    assert [i.id for i in items(images, [7, Path("a/b.png")])] == ["7", "a/b.png"]
    for odd, kind in ((b"a", "bytes"), (None, "NoneType"), (1.5, "float"), (True, "bool")):
        with pytest.raises(TypeError, match=f"the id of image 1 is a {kind}, not text"):
            list(items(images, ["x", odd]))


def test_paths_that_no_file_or_wire_text_can_hold_are_that_images_refusal(tmp_path):
    """A name whose bytes are not UTF-8 (os.listdir gives it with lone surrogates) made its
    default id unsendable: a raw UnicodeEncodeError, skip_invalid or not; a NUL byte a raw
    ValueError. The id writes the odd bytes \\xNN, as the embed job does, and a NUL path is
    that image's refusal."""
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "x.png")
    odd = tmp_path / os.fsdecode(b"caf\xe9.png")
    (tmp_path / "x.png").rename(odd)
    (item,) = list(items([odd]))
    assert item.id == str(tmp_path / "caf\\xe9.png") and item.size > 0
    assert to_proto(item).id == item.id and to_proto(item).encoded.startswith(b"\x89PNG")
    with open(odd, "rb") as f:
        assert list(items([f]))[0].id == item.id
    assert list(items([odd], [str(odd)]))[0].id == item.id  # a given id, the same rule
    (nul,) = list(items(["x\0.png"]))
    assert nul.size == 0
    with pytest.raises(InvalidImage, match="image 0.*a path with a NUL byte names no file"):
        to_proto(nul)


def test_timeouts_are_positive_numbers_and_long_ones_mean_no_limit():
    """A hostile timeout (NaN, 0, negative, a string) was a deadline exceeded at once, a
    TypeError from inside asyncio, or never enforced, by client kind; inf and 1e30 overflowed
    gRPC's deadline (DEADLINE_EXCEEDED at once) or the sync session's wait (OverflowError)."""
    assert check_timeout(None) is None
    assert check_timeout(2) == 2.0 and check_timeout(0.5) == 0.5
    assert check_timeout(float("inf")) == check_timeout(1e30) == MAX_TIMEOUT_S
    for bad in (0, -1, float("nan"), -float("inf")):
        with pytest.raises(ValueError, match="more than 0 seconds"):
            check_timeout(bad)
    for bad in ("5", True, [1], b"1"):
        with pytest.raises(TypeError, match="a number of seconds or None"):
            check_timeout(bad)
    with pytest.raises(ValueError, match="more than 0 seconds"):
        FeatureClient("127.0.0.1:1", timeout=float("nan"))
    client = FeatureClient("127.0.0.1:1", timeout=30)
    try:  # a call's own timeout replaces the client's, checked the same way
        assert client._timeout(None) == 30 and client._timeout(5) == 5
        with pytest.raises(ValueError):
            client._timeout(0)
    finally:
        client.close()


def test_batch_size_and_concurrency_are_counts():
    """batch_size 0, -1, 1.5 and NaN were ignored silently (one request for every image), True
    was 1 and "2" a TypeError from a comparison; concurrency 0 and -3 became 1 silently."""
    assert check_count("batch_size", None) is None and check_count("batch_size", 3) == 3
    assert check_count("batch_size", np.int64(2)) == 2
    for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                       ("2", TypeError), (float("nan"), TypeError)):
        with pytest.raises(error, match="batch_size must be"):
            check_count("batch_size", bad)
    with pytest.raises(TypeError, match="concurrency must be an int"):
        check_count("concurrency", None, default_none=False)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="concurrency must be at least 1"):
            FeatureClient("127.0.0.1:1", concurrency=bad)



def test_addresses_tokens_and_retries_are_checked_when_the_client_is_made():
    """Each was taken before and failed later, in gRPC's or Python's words: an empty address
    (a channel to nowhere), a non-string address (AttributeError), a token with a newline
    (gRPC refusing the metadata at every call), ``retry=5`` (AttributeError at the first
    retry), Retry waits of -1, NaN or inf (raised by the sleep when a retry was due)."""
    for bad, error, words in (
        ("", ValueError, "a server address is 'host:port', got ''"),
        (["127.0.0.1:1", 5], ValueError, "got 5"),
        (None, TypeError, "address must be 'host:port' or a list of them, not NoneType"),
        (5, TypeError, "not int"),
    ):
        with pytest.raises(error, match=words):
            FeatureClient(bad)
    for token in ("a\nb", 5, "caf\u00e9"):
        with pytest.raises(ValueError, match="token must be a string of printable ASCII"):
            FeatureClient("127.0.0.1:1", token=token)
    with pytest.raises(TypeError, match="retry must be a Retry, not int"):
        FeatureClient("127.0.0.1:1", retry=5)
    FeatureClient("127.0.0.1:1", token="tok-1_=.", retry=Retry(attempts=1)).close()
    for fields, words in (({"attempts": 0}, "attempts must be at least 1"),
                          ({"attempts": 2.5}, "attempts must be an int"),
                          ({"initial_s": -1}, "Retry.initial_s must be a finite number >= 0"),
                          ({"initial_s": float("nan")}, "Retry.initial_s"),
                          ({"max_s": float("inf")}, "Retry.max_s"),
                          ({"max_s": 0.01}, "Retry.max_s must be a finite number >= 0.1"),
                          ({"multiplier": 0.5}, "Retry.multiplier")):
        with pytest.raises((ValueError, TypeError), match=words):
            Retry(**fields)

def test_images_that_are_neither_an_image_nor_several_are_named():
    for bad in (None, 5, 3.5):
        with pytest.raises(TypeError, match=f"or an iterable of them, not {type(bad).__name__}"):
            as_images(bad)
    assert list(as_images(iter([b"x"]))) == [b"x"]  # an iterator is taken as it comes
    # a 0-d array is one image, refused by what it is (numpy's "iteration over a 0-d array")
    with pytest.raises(InvalidImage, match="image 0: a ndarray, not an image"):
        [to_proto(i) for i in items(np.array(5))]
    from vit22b.clients.client import options_of

    with pytest.raises(ValueError, match="dtype None is not one of"):  # not "'float64'"
        options_of({"dtype": None})
