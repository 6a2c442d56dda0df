"""The HTTP door on loopback with real clients (httpx, the openai package, curl): the same
features as gRPC, every bad input of the gRPC tests with its HTTP status and message, auth and
TLS, overload, deadlines, disconnects, draining, and the OpenAPI document."""

from __future__ import annotations

import base64
import json
import logging
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import zlib

import grpc
import httpx
import ml_dtypes
import numpy as np
import openai
import pytest
import safetensors.numpy
from serving import (
    in_process,
    metric,
    metrics,
    png,
    random_images,
    raw_image,
    self_signed,
    serve_process,
    sigterm_under_load,
    start_server,
    stub,
    wait_for,
)
from test_server import BAD_INPUTS, GOOD, IMAGE_LEVEL, MAX_REQUEST
from test_server_ops import (
    DELAY_MS,
    IN_QUEUE_TIMEOUT_S,
    QUEUE,
    WAIT,
    queued,
    wait_for_images,
)
from vit22b.model import OutputRequest
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

MODEL = "vit-22b-tiny/16"


@pytest.fixture(scope="module")
def server():
    srv = start_server(http_port=0, max_delay_ms=20, max_request_images=MAX_REQUEST,
                       max_message_mb=0.25)
    yield srv
    assert srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as client:
        yield client


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def pngs(images) -> list[str]:
    return [b64(png(p)) for p in images]


def tensor(t: dict) -> np.ndarray:
    dtype = np.dtype(ml_dtypes.bfloat16) if t["dtype"] == "bfloat16" else np.dtype(t["dtype"])
    return np.frombuffer(base64.b64decode(t["data"]), dtype).reshape(t["shape"])


def grpc_features(server, images, **fields) -> pb.EmbedResponse:
    request = pb.EmbedRequest(images=[pb.Image(encoded=png(p)) for p in images], **fields)
    return stub(server.address).Embed(request, timeout=60)


# ---- the same features as gRPC -------------------------------------------------------------


def test_features_equal_grpc_features_exactly(server, http):
    images = random_images(3, seed=21)
    body = {"images": pngs(images), "outputs": ["pooled", "attention_stats"], "layers": [-1, 0]}
    response = http.post("/v1/features", json=body)
    assert response.status_code == 200, response.text
    got = response.json()
    want = grpc_features(server, images, outputs=[pb.OUTPUT_KIND_POOLED,
                                                  pb.OUTPUT_KIND_ATTENTION_STATS],
                         patch_layers=[-1, 0])
    outputs = got["outputs"]
    assert outputs["pooled"]["dtype"] == "float32" and outputs["pooled"]["shape"] == [3, 64]
    for name in ("pooled", "attention_entropy", "attention_max_logit"):
        np.testing.assert_array_equal(tensor(outputs[name]), wire.from_tensor(getattr(want, name)))
    assert set(outputs["patch_tokens"]) == {"-1", "0"}
    for layer in (-1, 0):
        np.testing.assert_array_equal(tensor(outputs["patch_tokens"][str(layer)]),
                                      wire.from_tensor(want.patch_tokens[layer]))
    assert got["indices"] == [0, 1, 2] and got["errors"] == []
    identity = server.engine.identity
    assert got["model"] == {"name": MODEL, "fingerprint": identity.fingerprint,
                            "preprocess_hash": identity.preprocess_hash,
                            "compute_dtype": identity.compute_dtype}
    assert got["timings"]["compute_ms"] > 0


def test_raw_pixels_data_uris_bfloat16_and_l2(server, http):
    images = random_images(2, seed=22, size=(40, 70))
    body = {
        "images": [
            {"id": "a", "pixels": {"dtype": "uint8", "shape": [40, 70, 3],
                                   "data": b64(images[0].tobytes())}},
            {"id": "b", "data": "data:image/png;base64," + b64(png(images[1]))},
        ],
        "dtype": "bfloat16", "l2_normalize": True,
    }
    got = http.post("/v1/features", json=body).json()
    assert got["ids"] == ["a", "b"]
    pooled = tensor(got["outputs"]["pooled"])
    assert pooled.dtype == np.dtype(ml_dtypes.bfloat16)
    want = in_process(server.engine, images, l2_normalize=True)["pooled"]
    np.testing.assert_array_equal(pooled, want.astype(ml_dtypes.bfloat16))


def test_a_json_response_is_sized_as_json(server, http):
    """JSON carries tensors as base64, 4/3 of their bytes: a call whose safetensors body fits
    the message limit is 413 as JSON (it was sent, over the limit)."""
    info = stub(server.address).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    layers, limit = list(range(info.depth)), 256 << 10  # the fixture's --max-message-mb 0.25
    row = wire.row_bytes(info, ["pooled", "patch_tokens"], layers, "float32", info.num_patches)
    n = next(n for n in range(1, MAX_REQUEST + 1)
             if wire.response_bytes(row * 4 // 3, [""] * n) > limit)
    assert wire.response_bytes(row, [""] * n) <= limit
    body = {"images": [b64(png(GOOD))] * n, "layers": layers,  # a small body
            "outputs": ["pooled", "patch_tokens"]}
    as_json = http.post("/v1/features", json=body)
    assert as_json.status_code == 413, as_json.text[:200]
    assert "the response for" in as_json.json()["error"]["message"]
    as_safetensors = http.post("/v1/features", json=body,
                               headers={"Accept": "application/vnd.safetensors"})
    assert as_safetensors.status_code == 200 and len(as_safetensors.content) <= limit


def test_safetensors_body_holds_every_tensor_and_the_metadata(server, http):
    images = random_images(3, seed=23)
    body = {"images": [pngs(images)[0], "junk", *pngs(images)[1:]], "layers": [-1],
            "outputs": ["pooled"], "skip_invalid": True}
    response = http.post("/v1/features", json=body,
                         headers={"Accept": "application/vnd.safetensors"})
    assert response.headers["content-type"] == "application/vnd.safetensors"
    tensors = safetensors.numpy.load(response.content)
    assert set(tensors) == {"pooled", "patch_tokens.-1"}
    want = in_process(server.engine, images, OutputRequest(patch_layers=(3,)))
    np.testing.assert_array_equal(tensors["pooled"], want["pooled"])
    np.testing.assert_array_equal(tensors["patch_tokens.-1"], want["patch_tokens"][3])
    header = json.loads(response.content[8 : 8 + int.from_bytes(response.content[:8], "little")])
    meta = {k: json.loads(v) for k, v in header["__metadata__"].items()}
    assert meta["indices"] == [0, 2, 3]
    assert meta["errors"][0]["index"] == 1 and "not an image file" in meta["errors"][0]["reason"]
    assert meta["model"]["fingerprint"] == server.engine.identity.fingerprint


def test_a_bfloat16_safetensors_body_is_BF16_as_the_readme_says(server, http):
    """safetensors.numpy has no BF16 (the README says so and how to read it): the body's
    tensors are read here by the format's spec, as ml_dtypes.bfloat16."""
    images = random_images(2, seed=24)
    response = http.post("/v1/features", json={"images": pngs(images), "dtype": "bfloat16"},
                         headers={"Accept": "application/vnd.safetensors"})
    body = response.content
    size = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + size])
    assert header["pooled"]["dtype"] == "BF16" and header["pooled"]["shape"] == [2, 64]
    start, end = header["pooled"]["data_offsets"]
    pooled = np.frombuffer(body[8 + size + start : 8 + size + end], ml_dtypes.bfloat16)
    want = in_process(server.engine, images)["pooled"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(pooled.reshape(2, 64), want)
    with pytest.raises(KeyError, match="BF16"):  # the README's warning, while it holds
        safetensors.numpy.load(body)


def test_ids_are_counted_as_each_encoding_writes_them(server, http):
    """JSON writes an id ASCII-escaped ('é': 6 bytes, 2 in UTF-8), safetensors inside its
    header's JSON: an id that fits as UTF-8 could make a JSON answer over the limit (it was
    sent, 264 kB against 256 KiB) and a safetensors header escaped twice ('é': 7 bytes)."""
    image_id = "é" * 44_000  # 88 kB in UTF-8; 264 kB as JSON writes it
    body = json.dumps({"images": [{"id": image_id, "data": b64(png(GOOD))}]},
                      ensure_ascii=False).encode()
    as_json = http.post("/v1/features", content=body)
    assert as_json.status_code == 413, len(as_json.content)
    assert "the response for 1 images would be about" in as_json.json()["error"]["message"]
    as_safetensors = http.post("/v1/features", content=body,
                               headers={"Accept": "application/vnd.safetensors"})
    assert as_safetensors.status_code == 200 and len(as_safetensors.content) < 100_000
    size = int.from_bytes(as_safetensors.content[:8], "little")
    header = json.loads(as_safetensors.content[8 : 8 + size])
    assert json.loads(header["__metadata__"]["ids"]) == [image_id]


def test_the_safetensors_header_is_counted_and_bounded_before_the_forward():
    """safetensors refuses to write a header over 100 MB whatever the message limit (a 500
    after the forward had run); an id's share is counted as the library writes it."""
    from vit22b.model.errors import TooLarge
    from vit22b.server.http import (
        SAFETENSORS_MAX_HEADER,
        _check_safetensors_header,
        _safetensors_id_bytes,
    )

    odd = ["a\x00\"\\é\n\x7f\x1f\u2028😀" * 5, "plain", ""]
    tensors = {"pooled": np.zeros((3, 2), np.float32)}
    bare = safetensors.numpy.save(tensors, {"ids": "[]"})
    written = safetensors.numpy.save(
        tensors, {"ids": json.dumps(odd, separators=(",", ":"), ensure_ascii=False)})
    grown = int.from_bytes(written[:8], "little") - int.from_bytes(bare[:8], "little")
    counted = sum(_safetensors_id_bytes(i) - 2 for i in odd) + len(odd) - 1  # quotes, commas
    assert abs(grown - counted) < 8  # the header is padded to 8 bytes
    nul_ids = ["\x00" * (SAFETENSORS_MAX_HEADER // 7 + 1)]  # 6 bytes each in JSON, 7 escaped again
    with pytest.raises(safetensors.SafetensorError, match="header too large"):
        safetensors.numpy.save(tensors, {"ids": json.dumps(nul_ids, ensure_ascii=False)})
    with pytest.raises(TooLarge, match="over safetensors' limit of 100000000 bytes"):
        _check_safetensors_header(nul_ids)
    _check_safetensors_header(["\x00" * 1000] * 256)


@pytest.mark.parametrize("route, body, key", [
    ("/v1/features", '{"images": ["%(a)s"], "images": ["%(b)s"]}', "images"),
    ("/v1/features", '{"images": [{"id": "x", "data": "%(a)s", "id": "y"}]}', "id"),
    ("/v1/features", '{"images": ["%(a)s"], "skip_invalid": true, "skip_invalid": false}',
     "skip_invalid"),
    ("/v1/embeddings", '{"model": "nope", "input": "%(a)s", "model": "' + MODEL + '"}', "model"),
])
def test_a_key_twice_in_an_object_is_refused(http, route, body, key):
    """pydantic keeps the last value: a body joined from pieces lost its first images without
    a word. Refused as TEI's serde readers refuse them, naming the key."""
    images = pngs(random_images(2, seed=41))
    response = http.post(route, content=(body % {"a": images[0], "b": images[1]}).encode())
    assert response.status_code == 400, response.text[:300]
    message = response.json()["error"]["message"]
    assert f'duplicate key "{key}"' in message and "each key once per object" in message


def test_an_all_refused_call_keeps_every_output_with_no_rows(server, http):
    """skip_invalid with every image refused: each output asked for, with 0 rows, on both doors
    (the JSON had no `outputs` keys at all, the gRPC answer no tensors)."""
    body = {"images": ["junk", {"id": "b", "data": "AAAA"}], "skip_invalid": True,
            "outputs": ["pooled", "attention_stats"], "layers": [-1, 0],  # a set compiled above
            "dtype": "bfloat16"}
    got = http.post("/v1/features", json=body).json()
    assert [e["index"] for e in got["errors"]] == [0, 1] and got["ids"] == []
    outputs = got["outputs"]
    assert outputs["pooled"]["shape"] == [0, 64] and outputs["pooled"]["dtype"] == "bfloat16"
    assert outputs["attention_entropy"]["shape"] == [0, 4, 4]
    assert outputs["patch_tokens"]["-1"]["shape"] == outputs["patch_tokens"]["0"]["shape"] == [
        0, 16, 64]
    assert tensor(outputs["pooled"]).shape == (0, 64)
    request = pb.EmbedRequest(images=[pb.Image(encoded=b"junk")], skip_invalid_images=True,
                              patch_layers=[-1], outputs=[pb.OUTPUT_KIND_POOLED])
    answer = stub(server.address).Embed(request, timeout=60)
    assert wire.from_tensor(answer.pooled).shape == (0, 64)
    assert wire.from_tensor(answer.patch_tokens[-1]).shape == (0, 16, 64)


def test_a_request_timeout_counts_from_the_requests_arrival(server):
    """X-Request-Timeout is the call's deadline as gRPC's is: a body that takes longer to
    arrive than the timeout is 504, not computed (the clock started after the body was read)."""
    body = json.dumps({"images": pngs(random_images(1, seed=43))}).encode()

    def slowly():
        for i in range(0, len(body), len(body) // 4 + 1):
            time.sleep(0.25)
            yield body[i : i + len(body) // 4 + 1]

    before = metrics(server)
    response = httpx.post(server.http_url + "/v1/features", content=slowly(), timeout=60,
                          headers={"X-Request-Timeout": "0.5", "Content-Length": str(len(body))})
    assert response.status_code == 504, response.text[:300]
    after = metrics(server)
    assert metric(after, "vit22b_batch_images_count") == metric(before, "vit22b_batch_images_count")


def test_a_refusal_before_the_body_is_read_closes_the_connection(http):
    """The unread body would be the next request's bytes: the connection closes at once
    (it idled for uvicorn's keep-alive timeout)."""
    big = json.dumps({"images": ["A" * (300 << 10)]}).encode()
    response = http.post("/v1/features", content=big)
    assert response.status_code == 413 and response.headers["connection"] == "close"


def test_an_upgrade_header_is_served_as_http_1_1_without_a_warning(http, caplog):
    """An h2c or websocket Upgrade header is answered as plain HTTP/1.1; uvicorn logged two
    warnings for each such request ("Unsupported upgrade request.", "No supported WebSocket
    library detected"): a log any client could fill."""
    with caplog.at_level(logging.INFO):
        for upgrade in ("h2c", "websocket"):
            response = http.get("/v1/models", headers={"Connection": "Upgrade",
                                                      "Upgrade": upgrade})
            assert response.status_code == 200 and response.json()["data"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_pipelined_requests_on_a_connection_closed_unread_log_no_error(caplog):
    """Three requests pipelined on one connection, their 5 MB answers unread, and the
    connection closed: uvicorn marked only the last one parsed as gone, so the one being
    answered wrote to the closed transport, and uvloop's refusal was a 60-line traceback at
    ERROR per connection."""
    srv = start_server(http_port=0, max_message_mb=16)
    body = json.dumps({"images": pngs(random_images(256, seed=29, size=(16, 16))),
                       "outputs": ["pooled"], "layers": [0, 1, 2, 3]}).encode()
    one = (b"POST /v1/features HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def requests() -> float:
        return sum(value for (name, labels), value in metrics(srv).items()
                   if name == "vit22b_requests_total" and ("method", "POST /v1/features")
                   in labels)

    try:
        with caplog.at_level(logging.INFO):
            for _ in range(2):
                with socket.socket() as raw:
                    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    raw.connect(("127.0.0.1", srv.server.http_port))
                    before = requests()
                    raw.sendall(one * 3)
                    wait_for(lambda: requests() > before)  # noqa: B023 - the first, answering
                    time.sleep(0.5)
            time.sleep(1.0)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        srv.stop()


@pytest.mark.parametrize("accept, safetensors", [
    ("application/vnd.safetensors", True),
    ("application/json;q=0.5, application/vnd.safetensors", True),
    ("application/vnd.safetensors;q=0, application/json", False),  # refused by its weight
    ("application/vnd.safetensors;q=0.2, application/json;q=0.9", False),
    ("application/vnd.safetensors;Q=0.2, application/json;q=0.9", False),  # names: any case
    ("*/*", False),
])
def test_the_accept_header_is_weighed(http, accept, safetensors):
    body = {"images": pngs(random_images(1, seed=29)), "outputs": ["pooled"]}
    response = http.post("/v1/features", json=body, headers={"Accept": accept})
    assert response.status_code == 200
    kind = "application/vnd.safetensors" if safetensors else "application/json"
    assert response.headers["content-type"] == kind


def test_openai_client_embeddings_equal_grpc_l2_pooled(server):
    images = random_images(4, seed=24, size=(64, 64))
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    default = client.embeddings.create(model=MODEL, input=pngs(images))  # sends base64
    floats = client.embeddings.create(model=MODEL, input=pngs(images), encoding_format="float")
    single = client.embeddings.create(model=MODEL, input=pngs(images)[0])
    want = wire.from_tensor(grpc_features(server, images, l2_normalize=True).pooled)
    for result in (default, floats):
        assert [d.index for d in result.data] == [0, 1, 2, 3]
        np.testing.assert_array_equal(np.array([d.embedding for d in result.data], np.float32),
                                      want)
        assert result.model == MODEL
        assert result.usage.prompt_tokens == result.usage.total_tokens == 4 * 16  # patches
    alone = wire.from_tensor(grpc_features(server, images[:1], l2_normalize=True).pooled)
    np.testing.assert_array_equal(np.float32(single.data[0].embedding), alone[0])
    raw = httpx.post(server.http_url + "/v1/embeddings", timeout=60,
                     json={"model": MODEL, "input": pngs(images), "encoding_format": "base64"})
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw.json()["data"]]
    np.testing.assert_array_equal(np.stack(vectors), want)


def test_openai_client_sees_refusals_as_its_errors(server):
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    image = pngs(random_images(1, seed=25))[0]
    with pytest.raises(openai.BadRequestError, match="not served here"):
        client.embeddings.create(model="text-embedding-3-small", input=[image])
    with pytest.raises(openai.BadRequestError, match="dimensions=32 is not supported"):
        client.embeddings.create(model=MODEL, input=[image], dimensions=32)
    client.embeddings.create(model=MODEL, input=[image], dimensions=64)
    with pytest.raises(openai.BadRequestError, match="image 1: .*not base64"):
        client.embeddings.create(model=MODEL, input=[image, "a text, not an image"])
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model=MODEL, input=[[1, 2, 3]])  # token ids
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_embeddings_and_features(server, tmp_path):
    images = random_images(2, seed=26)
    (tmp_path / "body.json").write_text(json.dumps({"model": MODEL, "input": pngs(images)}))
    out = subprocess.run(
        ["curl", "-sS", "--fail-with-body", f"{server.http_url}/v1/embeddings",
         "-H", "Content-Type: application/json", "-d", f"@{tmp_path / 'body.json'}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    got = np.array([d["embedding"] for d in json.loads(out)["data"]], np.float32)
    want = wire.from_tensor(grpc_features(server, images, l2_normalize=True).pooled)
    np.testing.assert_array_equal(got, want)
    # no Content-Type (curl -d sends a form type): the body is read as JSON all the same
    (tmp_path / "f.json").write_text(json.dumps({"images": pngs(images)}))
    out = subprocess.run(["curl", "-sS", f"{server.http_url}/v1/features", "-d",
                          f"@{tmp_path / 'f.json'}"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out)["outputs"]["pooled"]["shape"] == [2, 64]


def test_health_ready_models_and_openapi(server, http):
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "SERVING"}
    model = http.get("/v1/models").json()["data"][0]
    assert model["id"] == MODEL and model["object"] == "model"
    assert model["model"]["compute_dtype"] == server.engine.identity.compute_dtype
    assert model["preprocessing"]["hash"] == server.engine.identity.preprocess_hash
    assert model["limits"]["max_request_images"] == MAX_REQUEST
    assert model["limits"]["max_message_bytes"] == 1 << 18
    assert model["outputs"] == ["pooled", "patch_tokens", "attention_stats"]
    assert model["config"]["width"] == 64 and model["parameter_count"] > 0
    assert all(isinstance(v, (int, float, list)) for v in model["limits"].values())  # no int64
    before = metric(metrics(server), "vit22b_requests_total", method="HEAD /v1/models",
                    code="OK")
    for path in ("/health", "/ready", "/v1/models"):  # load balancers probe with HEAD too
        assert http.head(path).status_code == 200
    # counted as what it was, not as a GET
    assert metric(metrics(server), "vit22b_requests_total", method="HEAD /v1/models",
                  code="OK") == before + 1
    for method, path, status, code in (("GET", "/nowhere", 404, "NOT_FOUND"),
                                       ("GET", "/v1/features", 405, "UNIMPLEMENTED"),
                                       # not a bare 307 to the Host header the client sent
                                       ("POST", "/v1/features/", 404, "NOT_FOUND"),
                                       ("GET", "/health/", 404, "NOT_FOUND")):
        refused = http.request(method, path, headers={"Host": "elsewhere.example"})
        assert refused.status_code == status  # in the refusals' own shape
        assert "location" not in refused.headers
        assert refused.json()["error"]["code"] == code and path in refused.json()["error"][
            "message"]
    assert http.request("GET", "/v1/features").headers["allow"] == "POST"
    doc = http.get("/openapi.json").json()
    assert {"/v1/embeddings", "/v1/features", "/v1/models", "/health", "/ready"} <= set(
        doc["paths"])
    ids = [op["operationId"] for path in doc["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))  # code generators need them unique (HEAD is left out)
    body = doc["paths"]["/v1/features"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/FeaturesRequest"
    schemas = doc["components"]["schemas"]
    assert {"images", "outputs", "layers", "dtype", "skip_invalid"} <= set(
        schemas["FeaturesRequest"]["properties"])
    assert "Image" in schemas and "EmbeddingsRequest" in schemas
    # the GET answers are declared too (their schemas were open), and the live ones match
    from vit22b.server.http import Liveness, ModelList, Readiness

    for path, model in (("/v1/models", ModelList), ("/health", Liveness), ("/ready", Readiness)):
        declared = doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]
        assert declared["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}, path
        model.model_validate(http.get(path).json())
    # every refusal declared with its body; safetensors beside JSON
    responses = doc["paths"]["/v1/features"]["post"]["responses"]
    assert {"400", "401", "408", "413", "422", "429", "431", "503", "504"} <= set(responses)
    error = {"$ref": "#/components/schemas/ErrorBody"}
    assert responses["413"]["content"]["application/json"]["schema"] == error
    assert "application/vnd.safetensors" in responses["200"]["content"]
    assert {"error"} == set(schemas["ErrorBody"]["properties"])
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]  # open
    assert "securitySchemes" not in doc["components"]  # this server holds no token
    assert schemas["FeaturesRequest"]["properties"]["images"]["maxItems"] == MAX_REQUEST
    assert schemas["EmbeddingsRequest"]["properties"]["model"]["enum"] == [MODEL]
    refused = http.post("/v1/features", json={"images": []}).json()
    assert set(refused["error"]) <= set(schemas["ErrorDetail"]["properties"])


# ---- bad input: the gRPC tests' cases, each with its HTTP status and message ---------------

# The same request in JSON. Good images travel as PNG: a base64 body is 4/3 of the proto's.
_GOOD_PIXELS = raw_image(GOOD).pixels
# Where JSON spells a case differently (names for kinds and dtypes), its HTTP message.
HTTP_REASONS = {
    "unknown output kind": "unknown output 'kind99'",
    "unknown dtype": "unknown output dtype 'code77'",
    "uint8 output dtype": "unknown output dtype 'uint8'",
    "raw dtype unset": "raw pixels: unknown dtype 'code0'",  # JSON's dtype is a name
    # pydantic counts the lists first, by the same bounds
    "too many layers": "layers: List should have at most 1024 items",
    "too many outputs": "outputs: List should have at most 1024 items",
}
HTTP_STATUS = {"response over the message limit": 413}


def as_json(request: pb.EmbedRequest) -> dict:
    images = []
    for image in request.images:
        if image.WhichOneof("source") == "pixels" and image.pixels == _GOOD_PIXELS:
            images.append({"id": image.id, "data": b64(png(GOOD))})
        elif image.WhichOneof("source") == "pixels":
            p = image.pixels
            images.append({"id": image.id, "pixels": {"dtype": _dtype(p.dtype),
                                                      "shape": list(p.shape), "data": b64(p.data)}})
        else:
            images.append({"id": image.id, "data": b64(image.encoded)})
    body: dict = {"images": images}
    if request.outputs:
        body["outputs"] = [wire.KIND_NAMES.get(code, f"kind{code}") for code in request.outputs]
    if request.patch_layers:
        body["layers"] = list(request.patch_layers)
    if request.dtype:
        body["dtype"] = _dtype(request.dtype)
    return body


def _dtype(code: int) -> str:
    try:
        return wire.dtype_name(code)
    except wire.WireError:
        return f"code{code}"


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_every_grpc_bad_input_has_its_http_status_and_message(server, http, case):
    request, reason = BAD_INPUTS[case]
    body = as_json(request)
    if case in IMAGE_LEVEL:  # behind two good images, as in the gRPC test
        body["images"] = [{"data": b64(png(GOOD))}] * 2 + body["images"]
    response = http.post("/v1/features", json=body)
    assert response.status_code == HTTP_STATUS.get(case, 400), response.text
    error = response.json()["error"]
    reason = HTTP_REASONS.get(case, reason)
    assert reason in error["message"]
    assert error["code"] == "INVALID_ARGUMENT"
    if case in IMAGE_LEVEL:
        assert error["message"].startswith("image 2 (id 'bad'): ")
        assert (error["index"], error["id"]) == (2, "bad") and reason in error["reason"]
    assert http.post("/v1/features", json={"images": [b64(png(GOOD))]}).status_code == 200


def test_base64_wrapped_in_lines_is_read_as_base64(server, http):
    """`base64 photo.jpg` and MIME wrap their output at 76 columns (CRLF in MIME): the lines
    decode as one, in a file's data, a data: URI and raw pixels alike."""
    image = random_images(1, seed=31, size=(40, 56))[0]

    def wrapped(data: bytes, end: str) -> str:
        text = b64(data)
        return end.join(text[i : i + 76] for i in range(0, len(text), 76)) + end

    want = http.post("/v1/features", json={"images": [b64(png(image))]}).json()
    bodies = [
        {"images": [wrapped(png(image), "\n")]},
        {"images": [{"data": "data:image/png;base64," + wrapped(png(image), "\r\n")}]},
        {"images": ["DATA:IMAGE/PNG;BASE64," + b64(png(image))]},  # RFC 2397: any case
        {"images": [{"pixels": {"dtype": "uint8", "shape": [40, 56, 3],
                                "data": wrapped(image.tobytes(), "\n")}}]},
    ]
    for body in bodies:
        got = http.post("/v1/features", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["outputs"]["pooled"] == want["outputs"]["pooled"]


HTTP_ONLY = {
    "not base64": ({"images": ["not base64!"]}, 400, "image 0: image data is not base64"),
    "url": ({"images": ["https://example.com/cat.jpg"]}, 400, "fetching is off"),
    "data uri without base64": ({"images": ["data:image/png,abc"]}, 400, "must carry base64"),
    "data and pixels": ({"images": [{"data": "", "pixels": {"dtype": "uint8", "shape": [1],
                                                            "data": ""}}]}, 400,
                        "set exactly one of `data` (an encoded file as base64 or a data: URI) "
                        "and `pixels` (both were set)"),
    "neither data nor pixels": ({"images": [{"id": "a"}]}, 400, "(neither was set)"),
    "a url in capitals": ({"images": ["HTTPS://example.com/cat.jpg"]}, 400,
                          "image URLs ('HTTPS'://...) are not fetched"),
    "a file url": ({"images": ["file:///etc/passwd"]}, 400, "URLs ('file'://...) are not fetched"),
    "an s3 url": ({"images": ["s3://bucket/cat.jpg"]}, 400, "are not fetched"),
    "url-safe base64": ({"images": ["iVBORw0KGgo-_w=="]}, 400,
                        "not the URL-safe one (- and _)"),
    "normalize_patches without patches": ({"images": [b64(png(GOOD))], "normalize_patches": True},
                                          400, "normalize_patches applies to patch tokens"),
    "pixels not base64": ({"images": [{"pixels": {"dtype": "uint8", "shape": [1, 1, 3],
                                                  "data": "@@"}}]}, 400, "raw pixels: "),
    "pixels unknown dtype": ({"images": [{"pixels": {"dtype": "int7", "shape": [1, 1, 3],
                                                     "data": ""}}]}, 400, "unknown dtype 'int7'"),
    "a typo in a field": ({"images": ["x"], "layer": [1]}, 400, "layer: Extra inputs"),
    "a wrong type": ({"images": ["x"], "layers": "1"}, 400, "layers: Input should be"),
    "no images field": ({"outputs": ["pooled"]}, 400, "images: Field required"),
    "l2 without pooled": ({"images": [b64(png(GOOD))], "outputs": ["patch_tokens"],
                           "l2_normalize": True}, 400, "l2_normalize applies to pooled"),
    # refused unread: pydantic would build every item first, holding the interpreter lock
    "more items than any request": ({"images": [""] * 30_000}, 400, "holds 29999 commas"),
    "a long model name": (None, 400, "'mmmm"),
}


@pytest.mark.parametrize("case", list(HTTP_ONLY))
def test_http_bad_input_is_named(http, case):
    body, status, reason = HTTP_ONLY[case]
    if case == "a long model name":  # quoted in part: the refusal does not echo 100 kB back
        response = http.post("/v1/embeddings", json={"model": "m" * 100_000, "input": "x"})
        assert len(response.content) < 1000 and "(100000 characters)" in response.text
    else:
        response = http.post("/v1/features", json=body)
    assert response.status_code == status, response.text
    assert reason in response.json()["error"]["message"]


def test_bodies_that_are_not_json_or_too_large(server, http):
    response = http.post("/v1/features", content=b"\xff{ not json")
    assert response.status_code == 400 and "Invalid JSON" in response.json()["error"]["message"]
    big = json.dumps({"images": ["A" * (300 << 10)]}).encode()
    response = http.post("/v1/features", content=big)  # Content-Length over 256 KiB
    assert response.status_code == 413
    assert "over the message limit of 262144 bytes" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * (10 << 10)

    response = http.post("/v1/features", content=chunks())
    assert response.status_code == 413
    for soon in ("soon", "1_0"):  # not Python's float("1_0"), 10 s
        bad_timeout = http.post("/v1/features", json={"images": [b64(png(GOOD))]},
                                headers={"X-Request-Timeout": soon})
        assert bad_timeout.status_code == 400 and "X-Request-Timeout" in bad_timeout.text
    samples = metrics(server)
    assert metric(samples, "vit22b_requests_total", method="POST /v1/features",
                  code="INVALID_ARGUMENT") >= 3
    assert metric(samples, "vit22b_queue_images") == 0


def gzip(data: bytes) -> bytes:
    writer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return writer.compress(data) + writer.flush()


def test_compressed_bodies_are_inflated_and_bounded_once_inflated(server, http):
    """gzip and deflate bodies (RFC 9110's content codings) give the plain body's features; the
    message limit applies to the inflated body (a 1 KiB bomb of 1 MiB is 413, not parsed), and
    a coding the door does not read is 415 naming it, not a JSON error or silently ignored."""
    images = random_images(2, seed=31)
    plain = json.dumps({"images": pngs(images)}).encode()
    want = http.post("/v1/features", content=plain).json()["outputs"]["pooled"]
    half = len(plain) // 2
    gzipped, first, second = (gzip(part) for part in (plain, plain[:half], plain[half:]))
    for coding, body in (("gzip", gzipped), ("deflate", zlib.compress(plain)),
                         ("GZip, identity", gzipped),  # names in any case, identity a no-op
                         ("x-gzip", first + second)):  # two members, as `cat a.gz b.gz` makes
        response = http.post("/v1/features", content=body,
                             headers={"Content-Encoding": coding})
        assert response.status_code == 200, (coding, response.text)
        assert response.json()["outputs"]["pooled"] == want
    bomb = zlib.compress(json.dumps({"images": ["A" * (1 << 20)]}).encode(), 9)
    assert len(bomb) < 4096  # far under the 256 KiB limit until inflated
    for route in ("/v1/features", "/v1/embeddings"):
        response = http.post(route, content=bomb, headers={"Content-Encoding": "deflate"})
        assert response.status_code == 413, response.text
        assert "inflates (deflate) to over the message limit of 262144 bytes" in response.text
    refusals = {
        ("gzip", gzipped[:-12]): (400, "its gzip data ends early"),
        ("gzip", plain): (400, "declared Content-Encoding 'gzip' but is not gzip data"),
        ("br", plain): (415, "Content-Encoding 'br', which this server does not read"),
        ("gzip, zstd", gzipped): (415, "Content-Encoding 'zstd'"),
    }
    for (coding, body), (status, reason) in refusals.items():
        response = http.post("/v1/features", content=body, headers={"Content-Encoding": coding})
        assert response.status_code == status, (coding, response.text)
        assert reason in response.json()["error"]["message"], response.text
        if status == 415:
            assert response.headers["Accept-Encoding"] == "gzip, x-gzip, deflate"
    samples = metrics(server)
    assert metric(samples, "vit22b_queue_images") == 0


def test_bodies_that_are_not_json_are_named_by_what_they_are(server, http):
    """An image file, a form or a multipart upload posted as the body is 415 naming its media
    type; a UTF-8 byte-order mark is skipped (RFC 8259) and curl -d's form type with a JSON
    object is read; UTF-16 is refused as not UTF-8."""
    images = random_images(1, seed=32)
    plain = json.dumps({"images": pngs(images)}).encode()
    want = http.post("/v1/features", content=plain).json()["outputs"]["pooled"]
    for headers, body in (({"Content-Type": "application/json"}, b"\xef\xbb\xbf" + plain),
                          ({"Content-Type": "application/x-www-form-urlencoded"}, plain),
                          ({"Content-Type": "text/plain; charset=utf-8"}, b"\n " + plain),
                          ({"Content-Type": "application/vnd.api+json"}, plain)):
        response = http.post("/v1/features", content=body, headers=headers)
        assert response.status_code == 200, (headers, response.text)
        assert response.json()["outputs"]["pooled"] == want
    photo = png(images[0])
    sent = {
        "image/png": http.post("/v1/features", content=photo,
                               headers={"Content-Type": "image/png"}),
        "multipart/form-data": http.post("/v1/embeddings",
                                         files={"file": ("a.png", photo, "image/png")}),
        "application/x-www-form-urlencoded": http.post("/v1/embeddings",
                                                       data={"input": b64(photo)}),
        "application/octet-stream": http.post("/v1/features", content=plain, headers={
            "Content-Type": "Application/Octet-Stream"}),
        # a safetensors body (the answers' format) was "not UTF-8 (UTF-16 or UTF-32)"
        "application/vnd.safetensors": http.post("/v1/features", content=b"\x10" + bytes(7),
                                                 headers={"Content-Type":
                                                          "application/vnd.safetensors"}),
    }
    long = http.post("/v1/features", content=photo, headers={"Content-Type": "image/" + "x" * 5000})
    assert long.status_code == 415 and "(5006 characters)" in long.json()["error"]["message"]
    assert len(long.text) < 1000
    for media, response in sent.items():
        assert response.status_code == 415, (media, response.text)
        assert f"request body is '{media}', not JSON" in response.json()["error"]["message"]
    for wide in ("utf-16", "utf-16-le", "utf-32-be"):
        utf16 = http.post("/v1/features", content=plain.decode().encode(wide))
        assert utf16.status_code == 400 and "not UTF-8" in utf16.json()["error"]["message"]
    nul = http.post("/v1/features", content=b"\x00", headers={"Content-Type": "application/json"})
    assert nul.status_code == 400  # one NUL byte is no UTF-16: said as what it is
    assert "starts with binary data (a NUL byte), not JSON" in nul.json()["error"]["message"]
    assert http.post("/v1/features", content=plain).json()["outputs"]["pooled"] == want


def _json_mutations(rng: np.random.Generator, seeds: list[dict], odd: list, count: int):
    """Bodies a hostile client might send: each seed with a few of its values (at any depth)
    swapped for an odd one, keys dropped or added, lists repeated or extended."""

    def mutate(value):
        if rng.random() < 0.15:
            return odd[int(rng.integers(len(odd)))]
        if isinstance(value, dict):
            out = {k: mutate(v) if rng.random() < 0.3 else v for k, v in value.items()
                   if rng.random() > 0.05}
            if rng.random() < 0.1:
                out[str(rng.choice(["id", "data", "pixels", "images", "extra"]))] = mutate(None)
            return out
        if isinstance(value, list):
            out = [mutate(v) if rng.random() < 0.3 else v for v in value]
            if rng.random() < 0.1:
                out = out * int(rng.choice([2, 7]))
            return out + [mutate(None)] if rng.random() < 0.1 else out
        return value

    for i in range(count):
        yield i % len(seeds), mutate(seeds[i % len(seeds)])


def test_mutated_json_bodies_get_features_or_a_named_400(server, http):
    """Hundreds of structurally mutated bodies on both POST routes: each is answered 200 with
    well-formed, finite outputs, or refused with a status and a message; then a good call."""
    image = random_images(1, seed=5, size=(40, 56))[0]
    encoded = b64(png(image))
    seeds = [
        ("/v1/features", {
            "images": [{"id": "a", "data": encoded}, encoded,
                       {"id": "p", "pixels": {"dtype": "uint8", "shape": [40, 56, 3],
                                              "data": b64(image.tobytes())}}],
            "outputs": ["pooled", "patch_tokens", "attention_stats"], "layers": [0, -1],
            "dtype": "float32", "normalize_patches": True, "skip_invalid": True,
            "resolution": 0, "dense": False}),
        ("/v1/embeddings", {"input": [encoded, "data:image/png;base64," + encoded],
                            "model": MODEL, "encoding_format": "float", "user": "u"}),
    ]
    odd = [None, True, 0, -1, 2**31, 2**63, -(2**63), 10**30, 1e308, 0.5, "", "x", "\u0000",
           [], {}, [[]], [None], "NaN", "-0", "data:,", "=", "////", b64(b"\xff\xd8\xff"),
           b64(png(image[:1, :1])), "float16", "bfloat16", "uint8", "int64", [40, 56, 3],
           [0, 56, 3], [40, 56, 4], [-1, 56, 3], [2**31, 2, 3], [1] * 300, "A" * 5000]
    rng = np.random.default_rng(23)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + 90
    for which, body in _json_mutations(rng, [b for _, b in seeds], odd, 400):
        if time.monotonic() > deadline:
            break
        route = seeds[which][0]
        response = http.post(route, content=json.dumps(body).encode(),
                             headers={"content-type": "application/json"})
        codes[response.status_code] = codes.get(response.status_code, 0) + 1
        assert response.status_code in (200, 400, 413), (route, body, response.text[:300])
        got = response.json()
        if response.status_code != 200:
            assert got["error"]["message"] and got["error"]["code"], got
        elif route == "/v1/features":
            rows = len(got["indices"])
            assert rows + len(got["errors"]) == len(body["images"]), got["errors"]
            for name, value in got["outputs"].items():
                for t in value.values() if name == "patch_tokens" else [value]:
                    array = tensor(t)
                    assert array.shape[0] == rows and np.isfinite(array.astype(np.float32)).all()
        else:
            vectors = [item["embedding"] for item in got["data"]]
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            assert len(vectors) == len(inputs) and np.isfinite(vectors).all()
    assert sum(codes.values()) >= 100 and codes.get(200, 0) > 0 and codes.get(400, 0) > 0, codes
    assert http.get("/ready").status_code == 200
    again = http.post("/v1/features", json={"images": [encoded]})
    assert again.status_code == 200 and again.json()["indices"] == [0]


# ---- non-finite outputs ----------------------------------------------------------------------


def test_non_finite_outputs_are_422_or_per_image_errors():
    from tiny_models import random_params
    from vit22b.model import get_config
    from vit22b.model.sharding import make_mesh, shard_params
    from vit22b.server.app import BackgroundServer
    from vit22b.server.engine import Engine
    from vit22b.server.settings import ServeConfig

    cfg = get_config(MODEL)
    mesh = make_mesh("data=2,model=4")
    params = random_params(cfg, 6)
    params["encoder_norm"]["scale"] = np.full_like(params["encoder_norm"]["scale"], np.nan)
    engine = Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="nan", source="s",
                    max_batch_images=8)
    config = ServeConfig(mesh="data=2,model=4", port=0, http_port=0, metrics_port=None,
                         max_batch_images=8)
    with BackgroundServer(config, engine=engine) as srv:
        body = {"images": pngs(random_images(2, 3)), "layers": [-1], "normalize_patches": True}
        response = httpx.post(srv.http_url + "/v1/features", json=body, timeout=120)
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["code"] == "OUT_OF_RANGE" and "image 0" in error["message"]
        assert "NaN or Inf" in error["message"]
        body["skip_invalid"] = True
        got = httpx.post(srv.http_url + "/v1/features", json=body, timeout=120).json()
        assert got["indices"] == [] and [e["index"] for e in got["errors"]] == [0, 1]
        assert got["outputs"] == {"patch_tokens": {"-1": {"dtype": "float32", "data": "",
                                                          "shape": [0, 16, 64]}}}


# ---- operating it: auth and TLS, overload, deadlines, disconnects, draining -----------------

TOKEN = "h77p-token"


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    d = self_signed(tmp_path_factory.mktemp("tls"))
    (d / "tokens").write_text(f"# clients\n{TOKEN}\n")
    srv = start_server(http_port=0, token_file=str(d / "tokens"), tls_cert=str(d / "cert.pem"),
                       tls_key=str(d / "key.pem"))
    yield srv, ssl.create_default_context(cafile=str(d / "cert.pem"))
    srv.stop()


def test_tls_and_token_shared_with_grpc(secure):
    srv, cert = secure
    assert srv.http_url.startswith("https://")
    image = pngs(random_images(1, seed=27))
    with httpx.Client(base_url=srv.http_url, verify=cert, timeout=60) as client:
        twice = [("Authorization", f"Bearer {TOKEN}")] * 2  # the doors would each pick one
        for headers, why in (({}, "missing bearer token (header 'Authorization: Bearer"),
                             ({"Authorization": "Bearer wrong"}, "wrong bearer token"),
                             ({"Authorization": TOKEN}, "not a bearer token"),
                             (twice, "2 authorization values: send one")):
            for method, path in (("POST", "/v1/features"), ("GET", "/v1/models")):
                response = client.request(method, path, headers=headers, content=b"\xff junk")
                assert response.status_code == 401, (headers, path)  # before the body is read
                assert response.headers["www-authenticate"] == "Bearer"
                assert why in response.json()["error"]["message"], (headers, path)
        for path in ("/health", "/ready", "/openapi.json"):  # open, like gRPC health
            assert client.get(path).status_code == 200
        doc = client.get("/openapi.json").json()
        assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http",
                                                                   "scheme": "bearer"}}
        assert doc["paths"]["/v1/features"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in doc["paths"]["/health"]["get"]
        ok = client.post("/v1/features", json={"images": image},
                         headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
    with socket.create_connection(("127.0.0.1", srv.server.http_port)) as raw:
        with cert.wrap_socket(raw, server_hostname="127.0.0.1") as tls:  # 100 MiB announced
            tls.sendall(b"POST /v1/features HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 104857600\r\n\r\n")
            assert tls.recv(4096).startswith(b"HTTP/1.1 401")  # answered before any body
    with pytest.raises(httpx.HTTPError):  # plaintext is refused
        httpx.get(srv.http_url.replace("https", "http") + "/health", timeout=5)
    client = openai.OpenAI(base_url=srv.http_url + "/v1", api_key=TOKEN, max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=cert))
    assert len(client.embeddings.create(model=MODEL, input=image).data) == 1
    wrong = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="nope", max_retries=0,
                          http_client=openai.DefaultHttpxClient(verify=cert))
    with pytest.raises(openai.AuthenticationError):
        wrong.embeddings.create(model=MODEL, input=image)


def test_two_authorization_values_are_refused_on_both_doors(secure):
    """With two Authorization headers the HTTP door took the last and gRPC the first: a good
    and a bad token were admitted in one order on one door and the other on the other."""
    srv, cert = secure
    image = pngs(random_images(1, seed=28))
    good, bad = f"Bearer {TOKEN}", "Bearer wrong"
    with httpx.Client(base_url=srv.http_url, verify=cert, timeout=60) as client:
        for pair in ((good, bad), (bad, good), (good, good)):
            response = client.post("/v1/features", json={"images": image},
                                   headers=[("Authorization", v) for v in pair])
            assert response.status_code == 401, pair
    with open(srv.server.config.tls_cert, "rb") as f:
        channel = grpc.secure_channel(srv.address, grpc.ssl_channel_credentials(f.read()))
    with channel:
        info = channel.unary_unary("/vit22b.v1.FeatureService/GetModelInfo",
                                   request_serializer=pb.GetModelInfoRequest.SerializeToString,
                                   response_deserializer=pb.ModelInfo.FromString)
        assert info(pb.GetModelInfoRequest(), metadata=[("authorization", good)], timeout=10)
        for pair in ((good, bad), (bad, good), (good, good)):
            with pytest.raises(grpc.RpcError) as refused:
                info(pb.GetModelInfoRequest(), timeout=10,
                     metadata=[("authorization", v) for v in pair])
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, pair


def test_browser_pages_of_the_allowed_origins_may_call_with_a_token(tmp_path):
    """--http-cors-allow-origin: a preflight (which carries no token) is answered for the
    allowed origin and refused for others; answers, refusals included, carry the origin so a
    page can read them; without the setting no CORS header is sent (the module's server)."""
    (tmp_path / "tokens").write_text(f"{TOKEN}\n")
    srv = start_server(http_port=0, token_file=str(tmp_path / "tokens"),
                       http_cors_allow_origin=("https://app.example",))
    page = "https://app.example"
    try:
        with httpx.Client(base_url=srv.http_url, timeout=60) as client:
            preflight = client.options("/v1/embeddings", headers={
                "Origin": page, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})
            assert preflight.status_code == 200, preflight.text
            assert preflight.headers["access-control-allow-origin"] == page
            allowed = preflight.headers["access-control-allow-headers"].lower()
            assert "authorization" in allowed and "content-type" in allowed
            other = client.options("/v1/embeddings", headers={
                "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
            assert other.status_code == 400
            assert "access-control-allow-origin" not in other.headers
            body = {"input": pngs(random_images(1, seed=33)), "model": MODEL}
            ok = client.post("/v1/embeddings", json=body,
                             headers={"Origin": page, "Authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == page
            refused = client.post("/v1/embeddings", json=body, headers={"Origin": page})
            assert refused.status_code == 401
            assert refused.headers["access-control-allow-origin"] == page
    finally:
        srv.stop()


def test_without_an_allowed_origin_no_cors_header_is_sent(http):
    preflight = http.options("/v1/embeddings", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405
    assert not any(h.startswith("access-control-") for h in preflight.headers)


@pytest.fixture(scope="module")
def slow():
    srv = start_server(http_port=0, max_delay_ms=DELAY_MS, batch_wait=WAIT,
                       max_queue_images=QUEUE, max_request_images=QUEUE)
    yield srv
    srv.stop()


def _post_in_thread(url: str, body: dict, out: list, **options) -> threading.Thread:
    def run():
        try:
            out.append(httpx.post(url, json=body, **options))
        except httpx.HTTPError as err:
            out.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_overload_is_429_with_retry_after_while_admitted_calls_complete(slow):
    url = slow.http_url + "/v1/features"
    admitted: list = []
    threads = [_post_in_thread(url, {"images": pngs(random_images(3, i, (64, 64)))}, admitted,
                               timeout=60) for i in range(2)]
    wait_for(lambda: queued(slow) == QUEUE)
    refused = httpx.post(url, json={"images": pngs(random_images(1))}, timeout=60)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "RESOURCE_EXHAUSTED" and "queue full" in error["message"]
    assert not admitted  # refused while the admitted calls still waited for their batch
    for thread in threads:
        thread.join(60)
    assert [r.status_code for r in admitted] == [200, 200]


def test_deadline_is_504_and_the_images_are_not_computed(slow):
    before = metrics(slow)
    response = httpx.post(slow.http_url + "/v1/features", timeout=60,
                          json={"images": pngs(random_images(2, 5, (64, 64)))},
                          headers={"X-Request-Timeout": str(IN_QUEUE_TIMEOUT_S)})
    assert response.status_code == 504 and response.json()["error"]["code"] == "DEADLINE_EXCEEDED"
    wait_for_images(slow, before, "expired", 2)
    after = metrics(slow)
    assert metric(after, "vit22b_batch_images_count") == metric(before, "vit22b_batch_images_count")
    assert metric(after, "vit22b_queue_images") == 0


def test_a_client_that_disconnects_is_not_computed(slow):
    before = metrics(slow)
    out: list = []
    thread = _post_in_thread(slow.http_url + "/v1/features",
                             {"images": pngs(random_images(2, 6, (64, 64)))}, out, timeout=0.5)
    thread.join(30)
    assert isinstance(out[0], httpx.TimeoutException)  # the client gave up and closed
    wait_for_images(slow, before, "cancelled", 2)
    after = metrics(slow)
    assert metric(after, "vit22b_batch_images_count") == metric(before, "vit22b_batch_images_count")
    assert metric(after, "vit22b_queue_images") == 0


def test_drain_finishes_accepted_calls_on_both_doors_then_refuses():
    srv = start_server(http_port=0, max_delay_ms=DELAY_MS * 4, batch_wait=WAIT)
    url = srv.http_url
    accepted: list = []
    thread = _post_in_thread(url + "/v1/features", {"images": pngs(random_images(2, 7))},
                             accepted, timeout=60)
    wait_for(lambda: queued(srv) == 2)
    rpc = stub(srv.address).Embed.future(pb.EmbedRequest(images=[raw_image(GOOD)]), timeout=60)
    wait_for(lambda: queued(srv) == 3)
    # the drained batch is held while the draining doors are asked: once it is done the port
    # stays open only for the linger (0.5 s), too short for a loaded host's three calls
    engine, hold, entered = srv.engine, threading.Event(), threading.Event()
    original = engine.forward

    def held(images, outputs):
        entered.set()
        hold.wait(30)
        return original(images, outputs)

    engine.forward = held
    outcome = {}
    stopper = threading.Thread(target=lambda: outcome.update(clean=srv.stop()))
    try:
        stopper.start()
        assert entered.wait(30)  # the drain runs the queued batch at once
        wait_for(lambda: httpx.get(url + "/ready").status_code == 503)
        not_ready = httpx.get(url + "/ready")
        assert not_ready.json() == {"status": "NOT_SERVING"} and not_ready.headers["retry-after"]
        refused = httpx.post(url + "/v1/features", json={"images": pngs(random_images(1))})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "shutting down" in refused.json()["error"]["message"]
    finally:
        hold.set()
        del engine.forward
    thread.join(60)
    assert accepted[0].status_code == 200  # not cut: drained without waiting out the delay
    assert wire.from_tensor(rpc.result().pooled).shape == (1, 64)
    stopper.join(60)
    assert outcome["clean"] is True
    with pytest.raises(httpx.ConnectError):  # the port is closed after the drain
        httpx.get(url + "/health", timeout=5)


def test_grpc_and_http_calls_share_one_batcher(slow):
    before = metrics(slow)
    images = random_images(3, seed=28, size=(64, 64))
    answers: list = []
    thread = _post_in_thread(slow.http_url + "/v1/features", {"images": pngs(images[:2])},
                             answers, timeout=60)
    wait_for(lambda: queued(slow) == 2)
    rpc = stub(slow.address).Embed.future(pb.EmbedRequest(images=[raw_image(images[2])]),
                                          timeout=60)
    thread.join(60)
    after = metrics(slow)
    count = "vit22b_batch_images_count"
    assert metric(after, count) - metric(before, count) == 1  # one batch of both doors' images
    assert metric(after, "vit22b_batch_images_sum") - metric(before, "vit22b_batch_images_sum") == 3
    assert tensor(answers[0].json()["outputs"]["pooled"]).shape == (2, 64)
    assert wire.from_tensor(rpc.result().pooled).shape == (1, 64)


def test_sigterm_drains_both_doors_and_loses_no_accepted_call():
    proc, address = serve_process(
        "--mesh", "data=2,model=4", "--max-batch-images", "8", "--max-delay-ms", "50",
        "--log-level", "WARNING", "--compile-cache", "off", "--http-port", "0",
    )
    try:
        body = {"images": pngs(random_images(2, 8, (64, 64)))}

        def grpc_load(outcomes: list, stop: threading.Event) -> None:
            s = stub(address)
            while not stop.is_set():
                try:
                    response = s.Embed(pb.EmbedRequest(images=[raw_image(GOOD)] * 2), timeout=60)
                    assert wire.from_tensor(response.pooled).shape == (2, 64)
                    outcomes.append(("grpc OK", ""))
                except grpc.RpcError as err:
                    outcomes.append((f"grpc {err.code().name}", err.details() or ""))
                    return

        def http_load(outcomes: list, stop: threading.Event) -> None:
            with httpx.Client(base_url=proc.http_url, timeout=60) as client:
                while not stop.is_set():
                    try:
                        response = client.post("/v1/features", json=body)
                    except httpx.ConnectError as err:  # the port closed: refused, not cut
                        outcomes.append(("http refused", str(err)))
                        return
                    outcomes.append((f"http {response.status_code}", response.text[:200]))
                    if response.status_code != 200:
                        return
                    assert response.json()["outputs"]["pooled"]["shape"] == [2, 64]

        outcomes = sigterm_under_load(proc, [grpc_load, http_load] * 4,
                                      lambda done: sum(c == "http 200" for c, _ in done) >= 20)
        codes = {code for code, _ in outcomes}
        assert codes <= {"grpc OK", "grpc UNAVAILABLE", "http 200", "http 503", "http refused"}
        assert {"grpc OK", "http 200"} <= codes, outcomes
        for code, details in outcomes:  # refused at the door, never cut mid-call
            if code in ("grpc UNAVAILABLE", "http 503"):
                assert re.search(r"shutting down|connect|refused", details), details
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_keep_alive_requests_are_not_held_by_nagles_algorithm(server, http):
    """With Nagle on, a response's header and body writes wait out the client's delayed ACK:
    every request on a kept-alive connection took 40 ms or more."""
    http.get("/health")
    times = []
    for _ in range(20):  # the fastest of many: a loaded host delays some, Nagle delays each
        start = time.perf_counter()
        assert http.get("/health").status_code == 200
        times.append(time.perf_counter() - start)
    assert min(times) < 0.03, times  # the delayed ACK's wait is 40 ms at least
