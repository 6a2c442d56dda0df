"""Shared by the server tests: one engine per test session, real servers on loopback, metrics.

The engine (tiny default model, seeded weights, mesh data=2,model=4 on the 8 emulated devices,
buckets 1/2/4/8) is built once and shared by every in-process server: each test server still has
its own batcher, service, gRPC port and metrics endpoint.
"""

from __future__ import annotations

import functools
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from vit22b.model.features import Features
from vit22b.model.outputs import POOLED, OutputRequest
from vit22b.server.app import BackgroundServer
from vit22b.server.engine import Engine
from vit22b.server.infer import LocalInfer
from vit22b.server.settings import ServeConfig
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import features_pb2_grpc as pb_grpc
from vit22b.v1 import wire
from xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[1]
MESH = "data=2,model=4"
MAX_BATCH = 8


@functools.cache
def shared_engine() -> Engine:
    engine = Engine.load(mesh=MESH, max_batch_images=MAX_BATCH)
    engine.warm_up()
    return engine


def in_process(
    engine: Engine,
    images,
    outputs: OutputRequest = POOLED,
    resolutions: tuple[int, ...] = (),
    max_dense_patches: int = 0,
    **options,
) -> Features:
    """The in-process path (the facade on a private loop): what served features must equal
    (``resolutions`` / ``max_dense_patches``: the geometries it serves, as the server's)."""
    with LocalInfer(engine, resolutions=resolutions, max_dense_patches=max_dense_patches) as local:
        return local.embed(images, outputs, **options).features


def serve_process(*flags: str, devices: int = 8) -> tuple[subprocess.Popen, str]:
    """A real `vit22b serve` process on a free port; (process, address) once it is SERVING.
    The caller stops it (SIGTERM) and reads the rest of its output; what it printed until
    SERVING is ``process.start_output``. With ``--http-port``, the announced HTTP door's URL
    is ``process.http_url``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags(devices)
    command = [sys.executable, "-m", "vit22b.clients.cli", "serve", "--port", "0",
               "--metrics-port", "-1", *flags]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    proc.start_output = ""
    for line in proc.stdout:
        proc.start_output += line
        if match := re.search(r"HTTP on (\S+)", line):
            proc.http_url = match[1]
        match = re.search(r"SERVING .* on (\S+),", line)
        if match:
            return proc, match[1]
    proc.kill()
    raise AssertionError(f"the server did not report SERVING (exit {proc.wait()})")


_CAPPED_CLI = """
import resource, sys
cap = int(sys.argv[1])
if cap:
    resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
from vit22b.clients.cli import main
sys.exit(main(sys.argv[2:]))
"""


def capped_cli(max_file_bytes: int, *argv: str) -> subprocess.CompletedProcess:
    """`vit22b ARGV` in a process of its own whose files are capped at ``max_file_bytes`` (0:
    not capped): the write past it fails with EFBIG, as a full disk's with ENOSPC."""
    return subprocess.run([sys.executable, "-c", _CAPPED_CLI, str(max_file_bytes), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def serving_then_stopped(proc: subprocess.Popen, address: str) -> str:
    """Health says SERVING at ``address``; then SIGTERM. Returns what the process wrote after
    (the piped one of its stdout and stderr)."""
    try:
        assert health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Check(
            health_pb2.HealthCheckRequest(), timeout=30).status == \
            health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    return out if out is not None else err


def sigterm_under_load(proc: subprocess.Popen, loads, enough) -> list[tuple[str, str]]:
    """Run each ``load(outcomes, stop)`` in its own thread until ``enough(outcomes)``, then
    SIGTERM the server; it must drain clean (exit 0). Returns every call's (code, details)."""
    outcomes: list[tuple[str, str]] = []
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(outcomes, stop)) for load in loads]
    for t in threads:
        t.start()
    wait_for(lambda: enough(outcomes), timeout=60)
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]
    stop.set()
    for t in threads:
        t.join(30)
    assert proc.returncode == 0, rest
    assert "stopped (clean)" in rest
    return outcomes


def wait_for(condition, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def self_signed(directory: Path) -> Path:
    """``cert.pem`` and ``key.pem`` for 127.0.0.1 / localhost in ``directory`` (skips the test
    without openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a self-signed certificate")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(directory / "key.pem"), "-out", str(directory / "cert.pem"),
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return directory


def start_server(tracing=None, **overrides) -> BackgroundServer:
    """A server on free ports with the shared engine; ``http_port=0`` adds the HTTP door."""
    config = ServeConfig(mesh=MESH, port=0, metrics_port=0, max_batch_images=MAX_BATCH)
    for key, value in overrides.items():
        setattr(config, key, value)
    return BackgroundServer(config, engine=shared_engine(), tracing=tracing).start()


def stub(address: str, credentials=None, max_mb: int = 64) -> pb_grpc.FeatureServiceStub:
    options = [
        ("grpc.max_send_message_length", max_mb << 20),
        ("grpc.max_receive_message_length", max_mb << 20),
    ]
    if credentials is None:
        channel = grpc.insecure_channel(address, options)
    else:
        channel = grpc.secure_channel(address, credentials, options)
    return pb_grpc.FeatureServiceStub(channel)


def metrics(server: BackgroundServer) -> dict[tuple[str, tuple], float]:
    """Scrape the server's /metrics over HTTP: {(sample name, sorted labels): value}."""
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def random_images(n: int, seed: int = 0, size=(72, 96)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (*size, 3), dtype=np.uint8) for _ in range(n)]


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def raw_image(pixels: np.ndarray, image_id: str = "") -> pb.Image:
    return pb.Image(id=image_id, pixels=wire.to_tensor(pixels))


def assert_same_rows(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to bf16-compute noise, row for row (each image's features depend a little on
    the batch it was packed into: bf16 matmul inputs, f32 accumulation in another order)."""
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    distances = np.linalg.norm(got[:, None] - want[None], axis=-1)
    assert (distances.argmin(axis=1) == np.arange(len(got))).all()  # nothing out of order
