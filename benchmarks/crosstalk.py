"""Whether every caller gets its own images' features under concurrent mixed traffic.

    python benchmarks/crosstalk.py [--calls 3000] [--threads 12] [--seed 0] [--models tiny heads]
        [--group]

A hostile tester's check for the worst bug a batching server can have: rows that reach the
wrong caller, or the right caller's rows from the wrong layer, kind, dtype or normalisation.
Per model it starts ``vit22b serve`` with both doors, draws a pool of images (random sizes,
sent as PNG, JPEG, HEIC or raw pixels) and of output configs (random kinds, layers, dtype,
normalisations, resolution, dense mode), and takes a reference for every (config, image) by a
lone unary call while nothing else runs. Then ``--threads`` threads send ``--calls`` calls, each
a random config over 1-4 images of the pool (repeats allowed), by one of six paths: unary
``Embed``, ``EmbedStream`` (1-3 requests, each its own config), the SDK's session, its asyncio
session (1-3 overlapping calls, each its own config), HTTP ``/v1/features`` as JSON and as
safetensors. Every answer must carry the ids and indices asked,
the outputs asked and no other, and each row must equal its image's reference within its
dtype's tolerance (relative to the reference's largest value: float32 1e-5, float16 2e-3,
bfloat16 1.6e-2; every dtype bfloat16's under bfloat16 compute, where a batch's program moves a
row by a rounding) and be nearer to it than to any other image's reference of that config. At the
end the server's queue gauge must be 0.

``--chaos`` adds what disturbs the batches without being checkable itself: a quarter of the
calls carry a junk image at a random place and skip it (the rows must still be the valid
images', with their request positions as ``indices``), and two more paths, unary calls with a
1-30 ms deadline and unary calls their caller cancels after 0-20 ms (each either ends so or is
answered, and then checked like any other).

Models: ``tiny`` is the embedded default (MAP head; pooled, patch tokens, attention stats);
``heads`` a small random-weight checkpoint written here with a class token, four registers,
RoPE, a projection and a classifier (every output kind). ``--group`` serves each by a group of
two processes on loopback (process 0 batches, both compute: every batch's output set and pixels
cross to the worker and the rows come back). Ends with one JSON line; exit 1 on any
wrong answer, unexpected refusal or a queue left non-empty.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
from benchlib import emit, log, machine, serve_process
from PIL import Image
from soak import free_port
from vit22b.clients import AsyncFeatureClient, FeatureClient
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import features_pb2_grpc as pb_grpc
from vit22b.v1 import wire

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
PATHS = ("unary", "stream", "session", "async_session", "http_json", "http_safetensors")
CHAOS = ("deadline", "cancel")
SEVERAL = ("stream", "async_session")  # paths that send 1-3 requests at once, each its own config
POOL_IMAGES = 10
CONFIGS = 12


def heads_checkpoint(folder: Path) -> Path:
    """A small checkpoint with every output kind (class token, registers, projection, logits)."""
    from vit22b.model import get_config
    from vit22b.model.checkpoint import expected_shapes, save, unflatten

    cfg = get_config("dinov3-s/16").replace(
        name="crosstalk-heads", width=64, depth=3, heads=4, mlp_dim=128, image_size=64,
        projection_dim=32, num_classes=10, compute_dtype="float32")
    rng = np.random.default_rng(0)
    params = unflatten({path: (0.2 * rng.standard_normal(shape)).astype(dtype)
                        for path, (shape, dtype) in expected_shapes(cfg).items()})
    save(folder / "heads", cfg, params, source="benchmarks/crosstalk.py")
    return folder / "heads"


def draw_images(r: random.Random) -> list[pb.Image]:
    """Distinct images of random sizes, each as PNG, JPEG, HEIC or raw pixels (HEIC: libheif
    decodes on the server's decode threads, several at once)."""
    images = []
    for k in range(POOL_IMAGES):
        h, w = r.randrange(24, 150), r.randrange(24, 150)
        rng = np.random.default_rng(r.randrange(2**32))
        coarse = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), np.uint8)
        pixels = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC))
        form = ("png", "jpeg", "raw", "heic")[k % 4]
        if form == "raw":
            images.append(pb.Image(pixels=wire.to_tensor(pixels)))
        elif form == "heic":
            import pillow_heif  # the contract's HEIC decoder; its encoder writes them here

            buffer = io.BytesIO()
            pillow_heif.from_pillow(Image.fromarray(pixels)).save(buffer, quality=80)
            images.append(pb.Image(encoded=buffer.getvalue()))
        else:
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, form.upper())
            images.append(pb.Image(encoded=buffer.getvalue()))
    return images


@dataclass(frozen=True)
class Config:
    outputs: tuple[str, ...]
    layers: tuple[int, ...]
    dtype: str
    l2_normalize: bool
    normalize_patches: bool
    resolution: int
    dense: bool

    def request(self, images: list[pb.Image], skip: bool = False) -> pb.EmbedRequest:
        return pb.EmbedRequest(
            images=images, outputs=[wire.kind_code(k) for k in self.outputs],
            patch_layers=self.layers, dtype=wire.dtype_code(self.dtype),
            l2_normalize=self.l2_normalize, normalize_patches=self.normalize_patches,
            resolution=self.resolution, dense=self.dense, skip_invalid_images=skip)

    def body(self, images: list[pb.Image], ids: list[str], skip: bool) -> dict:
        def image(x: pb.Image, i: str) -> dict:
            if x.HasField("encoded"):
                return {"id": i, "data": base64.b64encode(x.encoded).decode()}
            t = x.pixels
            return {"id": i, "pixels": {"dtype": "uint8", "shape": list(t.shape),
                                        "data": base64.b64encode(t.data).decode()}}
        return {"images": [image(x, i) for x, i in zip(images, ids, strict=True)],
                "outputs": list(self.outputs), "layers": list(self.layers),
                "dtype": self.dtype, "l2_normalize": self.l2_normalize,
                "normalize_patches": self.normalize_patches, "resolution": self.resolution,
                "dense": self.dense, "skip_invalid": skip}

    def sdk(self, skip: bool) -> dict:
        return {"outputs": self.outputs, "layers": self.layers, "dtype": self.dtype,
                "l2_normalize": self.l2_normalize, "normalize_patches": self.normalize_patches,
                "resolution": self.resolution, "dense": self.dense, "skip_invalid": skip}


def draw_configs(r: random.Random, info: pb.ModelInfo) -> list[Config]:
    kinds = [wire.kind_name(k) for k in info.outputs]
    resolutions = [0, *info.limits.resolutions]
    configs = []
    while len(configs) < CONFIGS:
        outputs = tuple(sorted(r.sample(kinds, r.randrange(1, len(kinds) + 1))))
        layers = ()
        if "patch_tokens" in outputs:
            layers = tuple(r.sample(range(-info.depth, info.depth), r.randrange(1, 4)))
            if len({x % info.depth for x in layers}) < len(layers):  # one block twice: refused
                continue
        dense = bool(info.limits.max_dense_patches) and r.random() < 0.2
        configs.append(Config(outputs, layers, r.choice(list(TOLERANCE)),
                              "pooled" in outputs and r.random() < 0.5,
                              "patch_tokens" in outputs and r.random() < 0.5,
                              0 if dense else r.choice(resolutions), dense))
    return configs


JUNK = pb.Image(encoded=b"\x89PNG\r\n\x1a\n but not a PNG")  # refused, or skipped with skip_invalid


@dataclass
class Call:
    """One request: ``picks`` of the pool under ``config``, with a junk image at ``junk_at``
    (None: none; else the request skips invalid images)."""

    config: Config
    picks: list[int]
    ids: list[str]
    pool: list[pb.Image]
    junk_at: int | None = None

    @property
    def skip(self) -> bool:
        return self.junk_at is not None

    @property
    def images(self) -> list[pb.Image]:
        images = [self.pool[p] for p in self.picks]
        return images if self.junk_at is None else [*images[:self.junk_at], JUNK,
                                                     *images[self.junk_at:]]

    @property
    def sent_ids(self) -> list[str]:
        return self.ids if self.junk_at is None else [*self.ids[:self.junk_at], "junk",
                                                      *self.ids[self.junk_at:]]

    @property
    def indices(self) -> list[int]:
        """The request positions of the rows that come back."""
        return [i for i in range(len(self.sent_ids)) if i != self.junk_at]

    def request(self) -> pb.EmbedRequest:
        return self.config.request(_with_ids(self.images, self.sent_ids), self.skip)

    def sdk(self) -> dict:
        return self.config.sdk(self.skip)


def rows_of_response(response: pb.EmbedResponse) -> dict[str, np.ndarray]:
    out = {name: wire.from_tensor(getattr(response, name))
           for name in wire.TENSOR_FIELDS if response.HasField(name)}
    out.update({f"patch_tokens.{k}": wire.from_tensor(v)
                for k, v in response.patch_tokens.items()})
    return out


def rows_of_json(outputs: dict) -> dict[str, np.ndarray]:
    def array(t: dict) -> np.ndarray:
        dtype = ml_dtypes.bfloat16 if t["dtype"] == "bfloat16" else np.dtype(t["dtype"])
        return np.frombuffer(base64.b64decode(t["data"]), dtype).reshape(t["shape"])
    out = {}
    for name, value in outputs.items():
        if name == "patch_tokens":
            out.update({f"patch_tokens.{k}": array(t) for k, t in value.items()})
        else:
            out[name] = array(value)
    return out


def rows_of_embeddings(got) -> dict[str, np.ndarray]:
    out = dict(got.arrays())
    out.update({f"patch_tokens.{k}": v for k, v in got.patch_tokens.items()})
    return out


class Caller:
    """One thread's connections and the five paths; each call returns (ids, indices, rows)."""

    def __init__(self, address: str, http_port: int):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.FeatureServiceStub(self.channel)
        self.client = FeatureClient(address)
        self.session = self.client.session()
        self.loop = asyncio.new_event_loop()
        self.aclient = AsyncFeatureClient(address)
        self.asession = self.aclient.session()
        self.url = f"http://127.0.0.1:{http_port}/v1/features"

    def close(self) -> None:
        self.session.close()
        self.client.close()
        self.loop.run_until_complete(self.asession.close())
        self.loop.run_until_complete(self.aclient.close())
        self.loop.close()
        self.channel.close()

    def unary(self, call: Call, timeout: float = 120):
        response = self.stub.Embed(call.request(), timeout=timeout)
        return list(response.ids), list(response.indices), rows_of_response(response)

    def cancelled_unary(self, call: Call, after_s: float):
        """A unary call its caller cancels after ``after_s``: its answer if it came first."""
        future = self.stub.Embed.future(call.request(), timeout=120)
        time.sleep(after_s)
        if future.cancel():
            return None
        response = future.result()
        return list(response.ids), list(response.indices), rows_of_response(response)

    def session_call(self, call: Call):
        got = self.session.embed(_plain(call.images), ids=call.sent_ids, **call.sdk())
        return got.ids, list(got.indices), rows_of_embeddings(got)

    def async_session_calls(self, calls: list[Call]) -> list:
        """Overlapping calls on one asyncio session, as tasks of one loop sharing it."""
        async def one(call: Call):
            got = await self.asession.embed(_plain(call.images), ids=call.sent_ids, **call.sdk())
            return got.ids, list(got.indices), rows_of_embeddings(got)

        async def together():
            return await asyncio.gather(*(one(c) for c in calls))
        return self.loop.run_until_complete(together())

    def http(self, call: Call, safetensors_body: bool):
        headers = {"Content-Type": "application/json"}
        if safetensors_body:
            headers["Accept"] = "application/vnd.safetensors"
        request = urllib.request.Request(
            self.url, json.dumps(call.config.body(call.images, call.sent_ids, call.skip)).encode(),
            headers)
        with urllib.request.urlopen(request, timeout=120) as answer:
            body = answer.read()
        if not safetensors_body:
            doc = json.loads(body)
            return doc["ids"], doc["indices"], rows_of_json(doc["outputs"])
        return read_safetensors(body)


SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def read_safetensors(body: bytes):
    """(ids, indices, rows) of a safetensors answer, read by its format's spec (safetensors'
    own numpy loader has no BF16)."""
    size = int.from_bytes(body[:8], "little")
    header, data = json.loads(body[8:8 + size]), memoryview(body)[8 + size:]
    meta = header.pop("__metadata__")
    rows = {name: np.frombuffer(data[t["data_offsets"][0]:t["data_offsets"][1]],
                                SAFETENSORS_DTYPES[t["dtype"]]).reshape(t["shape"])
            for name, t in header.items()}
    return json.loads(meta["ids"]), json.loads(meta["indices"]), rows


def _plain(images: list[pb.Image]) -> list:
    """The SDK's own inputs: encoded bytes, or a uint8 array."""
    return [x.encoded if x.HasField("encoded") else wire.from_tensor(x.pixels) for x in images]


def _with_ids(images, ids) -> list[pb.Image]:
    out = []
    for image, image_id in zip(images, ids, strict=True):
        copy = pb.Image()
        copy.CopyFrom(image)
        copy.id = image_id
        out.append(copy)
    return out


def compare(rows: dict, picks: list[int], config: Config, refs: dict, floor: float,
            worst: dict) -> list[str]:
    """What is wrong with one answer's rows (empty: right); ``worst`` keeps the largest error
    of a right row per output dtype and kind."""
    problems = []
    want_keys = set(refs[(config, picks[0])])
    if set(rows) != want_keys:
        return [f"outputs {sorted(rows)} where {sorted(want_keys)} were asked"]
    tol = max(TOLERANCE[config.dtype], floor)
    for name, array in rows.items():
        if len(array) != len(picks):
            problems.append(f"{name}: {len(array)} rows for {len(picks)} images")
            continue
        others = {p: refs[(config, p)][name][0] for p in range(POOL_IMAGES)}
        for row, pick in zip(array, picks, strict=True):
            got = np.asarray(row, np.float64)
            want = np.asarray(others[pick], np.float64)
            if got.shape != want.shape:
                problems.append(f"{name}: shape {got.shape} where {want.shape}")
                continue
            err = _relative(got, want)
            if err > tol:
                nearest = min(others, key=lambda p: _relative(got, np.asarray(others[p],
                                                                             np.float64)))
                problems.append(f"{name}: image {pick} off by {err:.2e} (tolerance {tol:g}; "
                                f"nearest reference: image {nearest})")
                continue
            for p, other in others.items():
                if p != pick and np.shape(other) == got.shape and \
                        _relative(got, np.asarray(other, np.float64)) < err:
                    problems.append(f"{name}: image {pick}'s row is nearer image {p}'s")
                    break
            else:
                key = f"{config.dtype} {name.split('.')[0]}"
                worst[key] = max(worst.get(key, 0.0), err)
    return problems


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def run_model(name: str, flags: list[str], args, r: random.Random) -> dict:
    http_port, metrics_port = free_port(), free_port()
    member = None
    if args.group:  # process 1 of a group of two; process 0 (below) takes the calls
        flags = [*flags, "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
        member = subprocess.Popen(
            [sys.executable, "-m", "vit22b.clients.cli", "serve", "--port", "0",
             "--metrics-port", "-1", "--log-level", "WARNING", *flags, "--process-id", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        flags = [*flags, "--process-id", "0"]
    proc, address = serve_process([*flags, "--http-port", str(http_port),
                                   "--metrics-port", str(metrics_port)])
    try:
        stub = pb_grpc.FeatureServiceStub(grpc.insecure_channel(address))
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        images, configs = draw_images(r), draw_configs(r, info)
        refs: dict = {}
        for config in configs:  # one lone call per (config, image): no neighbours
            for p, image in enumerate(images):
                refs[(config, p)] = rows_of_response(stub.Embed(config.request([image]),
                                                                timeout=600))
        # bfloat16 compute: a row moves by a rounding from one batch's program to another's
        # (README: up to 6.1e-3 of the largest value in this script's mix), whatever the
        # output dtype
        floor = TOLERANCE["bfloat16"] if info.model.compute_dtype == "bfloat16" else 0.0
        log(f"{name}: {len(refs)} references ({info.model.compute_dtype} compute); storm of "
            f"{args.calls} calls")
        counts, failures, lock, worst = Counter(), [], threading.Lock(), {}
        numbers = iter(range(args.calls))

        def worker(seed: int) -> None:
            rr, caller, mine = random.Random(seed), Caller(address, http_port), {}
            try:
                while True:
                    with lock:
                        if next(numbers, None) is None:
                            return
                    path = rr.choice(PATHS + (CHAOS if args.chaos else ()))
                    problems, outcome = one_call(caller, path, rr, images, configs, refs,
                                                 floor, mine, args.chaos)
                    with lock:
                        counts[f"{path}:{outcome}"] += 1
                        failures.extend(f"{path}: {p}" for p in problems)
            finally:
                caller.close()
                with lock:
                    for key, err in mine.items():
                        worst[key] = max(worst.get(key, 0.0), err)

        start = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(args.seed * 1000 + t,))
                   for t in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        queued = [line for line in page.splitlines() if line.startswith("vit22b_queue_images ")]
        queue_left = float(queued[0].split()[1]) if queued else None
        return {"model": info.model.name, "configs": [c.__dict__ for c in configs],
                "calls": dict(counts), "seconds": round(seconds, 1),
                "wrong": len(failures), "failures": failures[:20], "queue_left": queue_left,
                "worst_right_row": {k: float(f"{v:.3g}") for k, v in sorted(worst.items())},
                "alive": proc.poll() is None}
    finally:
        for process in (proc, member):
            if process is not None:
                process.terminate()
                process.wait(60)


def one_call(caller: Caller, path: str, r: random.Random, pool, configs, refs, floor: float,
             worst: dict, chaos: bool) -> tuple[list[str], str]:
    """One call by ``path``: (its problems, a refusal of a valid call being one; its outcome)."""
    calls = []
    for _ in range(r.randrange(1, 4) if path in SEVERAL else 1):
        config = r.choice(configs)
        picks = [r.randrange(POOL_IMAGES) for _ in range(1 if config.dense else r.randrange(1, 5))]
        ids = [f"{r.getrandbits(40):x}-{p}" for p in picks]
        junk = chaos and not config.dense and r.random() < 0.25  # dense: one image a request
        junk_at = r.randrange(len(picks) + 1) if junk else None
        calls.append(Call(config, picks, ids, pool, junk_at))
    try:
        if path == "stream":
            answers = caller.stub.EmbedStream(iter([c.request() for c in calls]), timeout=120)
            results = [(list(a.ids), list(a.indices), rows_of_response(a)) for a in answers]
        elif path == "async_session":
            results = caller.async_session_calls(calls)
        elif path == "unary":
            results = [caller.unary(calls[0])]
        elif path == "deadline":  # 1-30 ms: expired, or answered and checked
            results = [caller.unary(calls[0], timeout=r.uniform(0.001, 0.03))]
        elif path == "cancel":  # cancelled by its caller after 0-20 ms, or answered and checked
            results = [caller.cancelled_unary(calls[0], r.uniform(0, 0.02))]
            if results[0] is None:
                return [], "cancelled"
        elif path == "session":
            results = [caller.session_call(calls[0])]
        else:
            results = [caller.http(calls[0], path == "http_safetensors")]
    except grpc.RpcError as err:
        if path == "deadline" and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return [], "expired"
        return [f"refused: {err.code().name}: {err.details()[:300]}"], "refused"
    except Exception as err:  # noqa: BLE001 - a refusal of a valid call is a finding
        return [f"refused: {type(err).__name__}: {str(err)[:300]}"], "refused"
    if len(results) != len(calls):
        return [f"{len(results)} answers to {len(calls)} requests"], "answered"
    problems = []
    for call, (got_ids, indices, rows) in zip(calls, results, strict=True):
        if list(got_ids) != call.ids or list(indices) != call.indices:
            problems.append(f"ids {got_ids} / indices {indices} for ids {call.sent_ids}")
            continue
        problems.extend(f"{call.config}: {p}" for p in compare(rows, call.picks, call.config,
                                                               refs, floor, worst))
    return problems, "answered, junk skipped" if any(c.skip for c in calls) else "answered"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute-dtype", default="auto",
                        help="the servers' --compute-dtype (auto: float32 on a CPU without bf16 "
                        "instructions; under bfloat16 every tolerance is bfloat16's)")
    parser.add_argument("--chaos", action="store_true",
                        help="also calls with a junk image skipped, 1-30 ms deadlines and "
                        "unary calls their caller cancels after 0-20 ms")
    parser.add_argument("--group", action="store_true",
                        help="serve each model by a group of two processes (jax.distributed)")
    parser.add_argument("--models", nargs="+", default=["tiny", "heads"],
                        choices=["tiny", "heads"])
    args = parser.parse_args(argv)
    r = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            flags = ["--max-compiled", "200", "--compute-dtype", args.compute_dtype, *(
                ["--resolutions", "48,64,96", "--max-dense-patches", "64"] if model == "tiny"
                else ["--checkpoint", str(heads_checkpoint(Path(tmp))),
                      "--resolutions", "32,64,80", "--max-dense-patches", "48"])]
            results.append(run_model(model, flags, args, r))
            log(json.dumps({k: v for k, v in results[-1].items() if k != "configs"}))
    emit({"benchmark": "crosstalk", "seed": args.seed, "threads": args.threads,
          "group": args.group, "chaos": args.chaos,
          "results": results, "machine": machine()})
    bad = any(x["wrong"] or x["queue_left"] != 0 or not x["alive"] for x in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
