"""The feature service over real gRPC on loopback: results, shapes, dtypes, ordering, bad input."""

from __future__ import annotations

import base64
import json
import re
import struct
import threading
import urllib.request
import zlib

import grpc
import ml_dtypes
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from serving import (
    ROOT,
    assert_same_rows,
    in_process,
    metric,
    metrics,
    png,
    random_images,
    raw_image,
    start_server,
    stub,
    wait_for,
)
from vit22b.clients import FeatureClient, FeatureError
from vit22b.model import OutputRequest, get_config
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

MAX_REQUEST = 16


@pytest.fixture(scope="module")
def server():
    srv = start_server(max_delay_ms=20, max_request_images=MAX_REQUEST, max_message_mb=0.25)
    yield srv
    assert srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with FeatureClient(server.address) as c:
        yield c


def test_model_info_names_model_weights_mesh_and_preprocessing(client, server):
    info = client.model_info()
    cfg = get_config("vit-22b-tiny/16")
    assert info.model.name == cfg.name
    assert info.source == "init:seed=0"  # seeded random weights, labelled as such
    assert info.model.fingerprint == server.engine.identity.fingerprint
    assert info.model.preprocess_hash == cfg.preprocess_hash()
    assert info.preprocessing.hash == cfg.preprocess_hash()
    assert info.preprocessing.image_size == 64
    assert info.preprocessing.resize == cfg.preprocess.resize
    assert "centre crop 64x64" in info.preprocessing.description
    assert info.mesh.spec == "data=2,model=4" and dict(info.mesh.axes) == {"data": 2, "model": 4}
    # multiples of the data axis, below it one image on one row, and midpoints (a CPU host's plan)
    assert list(info.limits.batch_buckets) == [1, 2, 3, 4, 6, 8]
    assert info.limits.max_request_images == MAX_REQUEST
    assert json.loads(info.config_json)["width"] == 64
    assert (info.width, info.depth, info.heads, info.num_patches) == (64, 4, 4, 16)
    names = [wire.kind_name(k) for k in info.outputs]
    assert names == ["pooled", "patch_tokens", "attention_stats"]  # no class token, no logits


def test_raw_pixels_float32_equal_the_in_process_engine_exactly(client, server):
    images = random_images(5, seed=1)
    got = client.embed(images)
    want = in_process(server.engine, images)
    assert got.pooled.dtype == np.float32 and got.pooled.shape == (5, 64)
    np.testing.assert_array_equal(got.pooled, want["pooled"])
    assert got.ids == [str(i) for i in range(5)]
    assert got.model.fingerprint == server.engine.identity.fingerprint


def test_png_bytes_and_paths_equal_the_in_process_engine(client, server, tmp_path):
    images = random_images(3, seed=2, size=(80, 50))
    paths = []
    for i, pixels in enumerate(images):
        paths.append(tmp_path / f"{i}.png")
        paths[-1].write_bytes(png(pixels))
    got = client.embed(paths)
    want = in_process(server.engine, [png(p) for p in images])
    np.testing.assert_array_equal(got.pooled, want["pooled"])
    assert got.ids == [str(p) for p in paths]
    # The PNG is lossless: same features as the raw pixels.
    np.testing.assert_array_equal(got.pooled, in_process(server.engine, images)["pooled"])


def test_layers_and_attention_stats_have_the_documented_shapes(client, server):
    images = random_images(3, seed=3)
    got = client.embed(images, outputs=["pooled", "attention_stats"], layers=[0, -1, 2])
    assert set(got.patch_tokens) == {0, -1, 2}
    for tokens in got.patch_tokens.values():
        assert tokens.shape == (3, 16, 64) and tokens.dtype == np.float32
    assert got.attention_entropy.shape == (3, 4, 4) and got.attention_max_logit.shape == (3, 4, 4)
    want = in_process(
        server.engine, images, OutputRequest(patch_layers=(0, 2, 3), attention_stats=True)
    )
    np.testing.assert_array_equal(got.patch_tokens[-1], want["patch_tokens"][3])
    np.testing.assert_array_equal(got.patch_tokens[0], want["patch_tokens"][0])
    np.testing.assert_array_equal(got.attention_entropy, want["attention_entropy"])
    # Entropy of a softmax over 16 keys lies in [0, log 16].
    assert (got.attention_entropy >= 0).all() and (got.attention_entropy <= np.log(16) + 1e-5).all()


def test_normalised_patches_differ_from_raw(client):
    images = random_images(2, seed=4)
    raw = client.embed(images, outputs=["patch_tokens"], layers=[1])
    normed = client.embed(images, outputs=["patch_tokens"], layers=[1], normalize_patches=True)
    assert raw.pooled is None and normed.patch_tokens[1].shape == (2, 16, 64)
    assert not np.allclose(raw.patch_tokens[1], normed.patch_tokens[1])
    rms = np.sqrt((normed.patch_tokens[1] ** 2).mean(-1))  # RMSNorm with unit scale at init
    np.testing.assert_allclose(rms, 1.0, rtol=1e-3)


@pytest.mark.parametrize(
    "dtype,numpy_dtype", [("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)]
)
def test_reduced_precision_outputs_round_trip_through_numpy(client, server, dtype, numpy_dtype):
    images = random_images(4, seed=5)
    got = client.embed(images, outputs=["pooled"], layers=[-1], dtype=dtype)
    want = in_process(server.engine, images, OutputRequest(patch_layers=(3,)))
    assert got.pooled.dtype == np.dtype(numpy_dtype)
    np.testing.assert_array_equal(got.pooled, want["pooled"].astype(numpy_dtype))
    np.testing.assert_array_equal(got.patch_tokens[-1], want["patch_tokens"][3].astype(numpy_dtype))


def test_l2_normalised_pooled_features(client, server):
    images = random_images(3, seed=6)
    got = client.embed(images, l2_normalize=True)
    np.testing.assert_allclose(np.linalg.norm(got.pooled, axis=-1), 1.0, rtol=1e-6)
    want = in_process(server.engine, images, l2_normalize=True)["pooled"]
    np.testing.assert_array_equal(got.pooled, want)


def test_large_inputs_are_split_into_requests_and_batches(client, server):
    images = random_images(37, seed=7, size=(64, 64))
    got = client.embed(images, batch_size=16)
    assert len(got.timings) == 3  # 16 + 16 + 5
    assert got.ids == [str(i) for i in range(37)]
    assert_same_rows(got.pooled, in_process(server.engine, images)["pooled"])


def test_32_concurrent_clients_get_their_own_results_in_order(server):
    per_client = [random_images(3, seed=100 + i, size=(64, 64)) for i in range(32)]
    before = metrics(server)
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(32)

    def run(i: int) -> None:
        try:
            with FeatureClient(server.address) as c:
                start.wait()
                results[i] = c.embed(per_client[i], ids=[f"c{i}-{j}" for j in range(3)])
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    engine = server.engine
    for i in range(32):
        assert results[i].ids == [f"c{i}-{j}" for j in range(3)]
        assert_same_rows(results[i].pooled, in_process(engine, per_client[i])["pooled"])
    after = metrics(server)
    batches = metric(after, "vit22b_batch_images_count") - metric(
        before, "vit22b_batch_images_count"
    )
    single = metric(after, "vit22b_batch_images_bucket", le="1.0") - metric(
        before, "vit22b_batch_images_bucket", le="1.0"
    )
    images = metric(after, "vit22b_batch_images_sum") - metric(before, "vit22b_batch_images_sum")
    assert images == 96
    assert batches < 96 / 3  # images from several requests were packed together
    assert batches - single > 0  # batches larger than one image


def test_embed_stream_answers_in_request_order(server):
    s = stub(server.address)
    groups = [random_images(n, seed=200 + n, size=(64, 64)) for n in (3, 1, 8, 2, 5)]
    requests = [
        pb.EmbedRequest(images=[raw_image(p, f"g{g}-{i}") for i, p in enumerate(group)])
        for g, group in enumerate(groups)
    ]
    responses = list(s.EmbedStream(iter(requests), timeout=60))
    assert len(responses) == len(groups)
    for g, (group, response) in enumerate(zip(groups, responses)):
        assert list(response.ids) == [f"g{g}-{i}" for i in range(len(group))]
        pooled = wire.from_tensor(response.pooled)
        assert_same_rows(pooled, in_process(server.engine, group)["pooled"])
        assert response.model.preprocess_hash == server.engine.identity.preprocess_hash
        assert response.timings.total_ms > 0 and response.timings.compute_ms > 0


def test_skip_invalid_images_reports_them_and_returns_the_rest(client, server):
    images = random_images(3, seed=8)
    mixed = [images[0], b"not an image", images[1], b"", images[2]]
    got = client.embed(mixed, skip_invalid=True)
    assert list(got.indices) == [0, 2, 4]
    assert [e.index for e in got.errors] == [1, 3]
    assert "not an image file of a known format" in got.errors[0].reason
    assert "empty" in got.errors[1].reason
    np.testing.assert_array_equal(got.pooled, in_process(server.engine, images)["pooled"])


# ---- bad input: each kind its own case; the server keeps serving --------------------------


def _png_with_declared_size(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims another size (a decompression bomb's signature)."""
    data = bytearray(png(np.zeros((1, 1, 3), np.uint8)))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


def _raw(array: np.ndarray, dtype: int | None = None, length_delta: int = 0) -> pb.Image:
    tensor = wire.to_tensor(array)
    if dtype is not None:
        tensor.dtype = dtype
    if length_delta:
        tensor.data = tensor.data[:length_delta] if length_delta < 0 else tensor.data + b"\0"
    return pb.Image(id="bad", pixels=tensor)


GOOD = np.full((64, 64, 3), 128, np.uint8)
_TRUNCATED = png(random_images(1, seed=9, size=(64, 64))[0])

BAD_INPUTS = {
    "no images": (pb.EmbedRequest(), "no images"),
    "empty bytes": (pb.EmbedRequest(images=[pb.Image(id="bad", encoded=b"")]), "empty"),
    "not an image": (
        pb.EmbedRequest(images=[pb.Image(id="bad", encoded=b"GIF89a this is text")]),
        "GIF file, but its header is unusable",
    ),
    "truncated png": (
        pb.EmbedRequest(images=[pb.Image(id="bad", encoded=_TRUNCATED[: len(_TRUNCATED) // 2])]),
        "cannot decode PNG",
    ),
    "decompression bomb": (
        pb.EmbedRequest(images=[pb.Image(id="bad", encoded=_png_with_declared_size(10**5, 10**5))]),
        "decompression bomb",
    ),
    "over the pixel limit": (
        pb.EmbedRequest(images=[pb.Image(id="bad", encoded=_png_with_declared_size(8000, 8000))]),
        "over the limit of 40000000",
    ),
    "raw wrong length": (pb.EmbedRequest(images=[_raw(GOOD, length_delta=-5)]), "bytes, got"),
    "raw wrong dtype": (
        pb.EmbedRequest(images=[_raw(GOOD.astype(np.float32))]),
        "must be uint8, got dtype float32",
    ),
    "raw wrong channels": (
        pb.EmbedRequest(images=[_raw(np.zeros((8, 8, 4), np.uint8))]),
        "[height, width, 3]",
    ),
    "zero-sized": (pb.EmbedRequest(images=[_raw(np.zeros((0, 8, 3), np.uint8))]),
                   "raw pixels of shape [0, 8, 3] are zero-sized"),  # not "8x0", as a file's
    "raw with 66 dimensions": (  # numpy holds 64: its own error was INTERNAL
        pb.EmbedRequest(images=[pb.Image(id="bad", pixels=pb.Tensor(
            dtype=pb.DTYPE_UINT8, shape=[1] * 65 + [3], data=b"\0" * 3))]),
        "[height, width, 3] (RGB), got 66 dimensions",
    ),
    "raw shape beyond any array": (  # no bytes, yet sides whose product overflows
        pb.EmbedRequest(images=[pb.Image(id="bad", pixels=pb.Tensor(
            dtype=pb.DTYPE_UINT8, shape=[1 << 40, 1 << 40, 3]))]),
        "is beyond any array's size",
    ),
    "raw with no shape": (  # its shape's fault, not the 1 byte a scalar would need
        pb.EmbedRequest(images=[pb.Image(id="bad", pixels=pb.Tensor(dtype=pb.DTYPE_UINT8))]),
        "must have shape [height, width, 3] (RGB), got []",
    ),
    "raw dtype unset": (
        pb.EmbedRequest(images=[pb.Image(id="bad", pixels=pb.Tensor(shape=[1, 1, 3],
                                                                    data=b"\0" * 3))]),
        "got dtype DTYPE_UNSPECIFIED (unset: raw pixels are DTYPE_UINT8)",
    ),
    "unknown output kind": (
        pb.EmbedRequest(images=[raw_image(GOOD)], outputs=[99]),
        "unknown output kind 99",
    ),
    "too many layers": (  # a client's long list is refused before it is spelled (or cached)
        pb.EmbedRequest(images=[raw_image(GOOD)], patch_layers=[0] * 1025),
        "1025 layers requested; at most 1024",
    ),
    "too many outputs": (
        pb.EmbedRequest(images=[raw_image(GOOD)], outputs=[pb.OUTPUT_KIND_POOLED] * 1025),
        "1025 outputs requested; at most 1024",
    ),
    "layer out of range": (
        pb.EmbedRequest(images=[raw_image(GOOD)], patch_layers=[4]),
        "layer index 4 is out of range",
    ),
    "unknown dtype": (pb.EmbedRequest(images=[raw_image(GOOD)], dtype=77), "unknown dtype code 77"),
    "uint8 output dtype": (
        pb.EmbedRequest(images=[raw_image(GOOD)], dtype=pb.DTYPE_UINT8),
        "not an output dtype",
    ),
    "no class token": (
        pb.EmbedRequest(images=[raw_image(GOOD)], outputs=[pb.OUTPUT_KIND_CLASS_TOKEN]),
        "has no class token",
    ),
    "too many images": (
        pb.EmbedRequest(images=[raw_image(GOOD)] * (MAX_REQUEST + 1)),
        f"exceed the limit of {MAX_REQUEST}",
    ),
    "response over the message limit": (
        pb.EmbedRequest(images=[raw_image(GOOD)] * MAX_REQUEST, patch_layers=[0, 1, 2, 3]),
        "over the message limit",
    ),
}
IMAGE_LEVEL = {
    "empty bytes",
    "not an image",
    "truncated png",
    "decompression bomb",
    "over the pixel limit",
    "raw wrong length",
    "raw wrong dtype",
    "raw wrong channels",
    "zero-sized",
    "raw with 66 dimensions",
    "raw shape beyond any array",
    "raw with no shape",
    "raw dtype unset",
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_invalid_argument_and_the_server_survives(server, case):
    request, reason = BAD_INPUTS[case]
    s = stub(server.address)
    if case in IMAGE_LEVEL:  # put the bad image at index 2, behind two good ones
        images = [raw_image(GOOD), raw_image(GOOD), *request.images]
        request = pb.EmbedRequest(images=images)
    with pytest.raises(grpc.RpcError) as info:
        s.Embed(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert reason in info.value.details()
    if case in IMAGE_LEVEL:
        assert info.value.details().startswith("image 2 (id 'bad'): ")
    _assert_still_serving(server)


def test_message_over_the_size_limit_is_resource_exhausted(server):
    s = stub(server.address)
    big = np.zeros((300, 300, 3), np.uint8)  # 270 kB raw, over the 256 kB limit
    before = metrics(server)
    with pytest.raises(grpc.RpcError) as info:
        s.Embed(pb.EmbedRequest(images=[raw_image(big)]), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    def counted(code: str) -> float:
        return (metric(metrics(server), "vit22b_requests_total", method="Embed", code=code)
                - metric(before, "vit22b_requests_total", method="Embed", code=code))

    # gRPC refuses the message itself and the handler reads none: counted as what the client
    # got (it was counted INVALID_ARGUMENT, as a call closed with no message)
    wait_for(lambda: counted("RESOURCE_EXHAUSTED") == 1)
    assert counted("INVALID_ARGUMENT") == 0
    _assert_still_serving(server)


def test_client_reports_bad_input_with_index_and_reason(client):
    with pytest.raises(FeatureError) as info:
        client.embed([GOOD, GOOD, GOOD, b"junk"], ids=["a", "b", "c", "d"])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 3 (id 'd')" in str(info.value)
    with pytest.raises(ValueError, match="unknown output"):
        client.embed([GOOD], outputs=["everything"])
    with pytest.raises(ValueError, match="image 1: numpy images must be uint8"):
        client.embed([GOOD, GOOD.astype(np.float32)])


def test_invalid_images_are_counted_in_metrics(server):
    samples = metrics(server)
    assert metric(samples, "vit22b_images_total", outcome="invalid") >= len(IMAGE_LEVEL)
    assert metric(samples, "vit22b_requests_total", method="Embed", code="INVALID_ARGUMENT") > 0
    assert metric(samples, "vit22b_queue_images") == 0  # nothing leaked from failed calls


def test_the_readme_lists_every_exported_metric(server):
    """The README's metrics table names each series /metrics exports, and no other (it named 3
    of 11)."""
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    exported = {f.name + ("_total" if f.type == "counter" else "")
                for f in text_string_to_metric_families(text)
                if f.name.startswith("vit22b_") and not f.name.endswith("_created")}
    readme = (ROOT / "README.md").read_text()
    table = readme.split("### Metrics\n", 1)[1].split("\n#", 1)[0]
    listed = set(re.findall(r"^\| `(vit22b_\w+)`", table, re.MULTILINE))
    assert exported and listed == exported


def _assert_still_serving(server) -> None:
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "vit22b.v1.FeatureService", "liveness"):  # readiness twice, liveness
        status = health.Check(health_pb2.HealthCheckRequest(service=name))
        assert status.status == health_pb2.HealthCheckResponse.SERVING, name
    response = stub(server.address).Embed(pb.EmbedRequest(images=[raw_image(GOOD)]), timeout=30)
    assert wire.from_tensor(response.pooled).shape == (1, 64)
    channel.close()


def test_a_calls_one_image_decodes_in_the_handoff_worker_or_the_pool_by_its_size(
        server, monkeypatch):
    """A call's one small image (a stream message's or a unary call's) decodes in the handoff
    worker, a larger one in the pool, also when only its header tells (server/infer.py,
    SMALL_DECODE_*): both give what the engine gives, and a bad small image is refused in the
    same words on both doors' calls."""
    import io

    from PIL import Image
    from vit22b.server.infer import SMALL_DECODE_BYTES, SMALL_DECODE_PIXELS, Infer

    decoded_on: dict[str, list[str]] = {}
    load = Infer._load

    def watched(self, index, image, pre, opened=None):  # where each image was decoded
        thread = threading.current_thread().name
        where = "pool" if thread.startswith("vit22b-preprocess") else (
            "handoff" if thread == "vit22b-decode" else thread)
        decoded_on.setdefault(image.id, []).append(where)
        return load(self, index, image, pre, opened)

    monkeypatch.setattr(Infer, "_load", watched)

    small, other = random_images(2, seed=210, size=(64, 64))
    noisy = random_images(1, seed=211, size=(300, 300))[0]
    flat = np.full((1000, 1000, 3), (30, 140, 200), np.uint8)  # small bytes, large declared
    jpeg = io.BytesIO()
    Image.fromarray(noisy).save(jpeg, format="JPEG", quality=95)
    inputs = {"small png": png(small), "small raw": other, "flat png": png(flat),
              "noisy jpeg": jpeg.getvalue()}
    assert len(inputs["small png"]) <= SMALL_DECODE_BYTES and 64 * 64 <= SMALL_DECODE_PIXELS
    assert len(inputs["flat png"]) <= SMALL_DECODE_BYTES < len(inputs["noisy jpeg"])

    def image(name):
        data = inputs[name]
        return raw_image(data, name) if isinstance(data, np.ndarray) else pb.Image(
            id=name, encoded=data)

    s = stub(server.address)
    requests = [pb.EmbedRequest(images=[image(name)]) for name in inputs]
    streamed = [wire.from_tensor(r.pooled) for r in s.EmbedStream(iter(requests), timeout=60)]
    want_on = {"small png": ["handoff"], "small raw": ["handoff"], "flat png": ["pool"],
               "noisy jpeg": ["pool"]}
    assert decoded_on == want_on
    unary = [wire.from_tensor(s.Embed(r, timeout=60).pooled) for r in requests]
    assert decoded_on == {name: where * 2 for name, where in want_on.items()}
    want = in_process(server.engine, list(inputs.values()))["pooled"]
    assert_same_rows(np.concatenate(streamed), want)
    assert_same_rows(np.concatenate(unary), want)

    bad = pb.EmbedRequest(images=[pb.Image(id="junk", encoded=b"\x89PNG\r\n\x1a\n short")])
    with pytest.raises(grpc.RpcError) as on_stream:
        list(s.EmbedStream(iter([bad]), timeout=60))
    with pytest.raises(grpc.RpcError) as unary_err:
        s.Embed(bad, timeout=60)
    assert on_stream.value.code() == unary_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert on_stream.value.details() == unary_err.value.details()
    assert on_stream.value.details().startswith("image 0 (id 'junk'): PNG")
    _assert_still_serving(server)


def test_embed_stream_ends_with_the_first_bad_request_after_the_good_ones(server):
    good = pb.EmbedRequest(images=[raw_image(GOOD, "ok")])
    bad = pb.EmbedRequest(images=[raw_image(GOOD), pb.Image(id="junk", encoded=b"junk")])
    responses = stub(server.address).EmbedStream(iter([good, good, bad, good]), timeout=60)
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in responses:
            received.append(list(response.ids))
    assert received == [["ok"], ["ok"]]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("image 1 (id 'junk'): ")
    _assert_still_serving(server)


def test_reflection_lists_the_services_and_describes_the_contract(server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    channel = grpc.insecure_channel(server.address)
    database = ProtoReflectionDescriptorDatabase(channel)
    services = set(database.get_services())
    assert {"vit22b.v1.FeatureService", "grpc.health.v1.Health"} <= services
    service = DescriptorPool(database).FindServiceByName("vit22b.v1.FeatureService")
    assert [m.name for m in service.methods] == ["Embed", "EmbedStream", "GetModelInfo"]
    channel.close()


def test_reflection_answers_under_v1_as_under_v1alpha(server):
    """Current clients (grpcurl, Postman) ask for reflection v1 first; both names answer alike."""
    from grpc_reflection.v1alpha import reflection_pb2

    asks = [reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="vit22b.v1.FeatureService"),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol")]
    answers = {}
    with grpc.insecure_channel(server.address) as channel:
        for version in ("v1alpha", "v1"):
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            answers[version] = list(call(iter(asks), timeout=20))
    assert answers["v1"] == answers["v1alpha"] and len(answers["v1"]) == 3
    listed, described, missing = answers["v1"]
    assert {s.name for s in listed.list_services_response.service} >= {
        "vit22b.v1.FeatureService", "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection"}
    assert described.file_descriptor_response.file_descriptor_proto
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_a_client_built_from_reflection_alone_gets_the_sdks_features(server, client):
    """What grpcurl or a client in another language does: every message type from the
    server's reflection (none of this package's generated code), fields set by name."""
    from google.protobuf import json_format, message_factory
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    channel = grpc.insecure_channel(server.address)
    pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    method = pool.FindServiceByName("vit22b.v1.FeatureService").FindMethodByName("Embed")
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    embed = channel.unary_unary(
        "/vit22b.v1.FeatureService/Embed",
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )
    image = png(random_images(1, seed=9)[0])
    request = json_format.ParseDict(  # JSON names, as grpcurl -d takes them
        {"images": [{"id": "a", "encoded": base64.b64encode(image).decode()}],
         "outputs": ["OUTPUT_KIND_POOLED"], "dtype": "DTYPE_FLOAT32"}, request_type())
    response = embed(request, timeout=60)
    pooled = response.pooled
    values = np.frombuffer(pooled.data, np.float32).reshape(list(pooled.shape))
    np.testing.assert_array_equal(values, client.embed([image]).pooled)
    request.dtype = 99  # an enum value the contract lacks (proto3 enums are open)
    with pytest.raises(grpc.RpcError) as refused:
        embed(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_the_doors_run_on_uvloop_where_installed(server):
    uvloop = pytest.importorskip("uvloop")
    assert isinstance(server._loop, uvloop.Loop)
