"""Test setup: 8 emulated CPU devices, set before jax is imported anywhere; an S3 server."""

import logging
import os
import socket

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto's server mode) on a free loopback port; the AWS
    variables point every S3 client of this process (and of processes it starts) at it.
    Yields ``bucket(name, files)``: a fresh bucket holding ``files`` ({key: bytes}); its URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    buckets = []

    def bucket(name: str, files: dict[str, bytes] | None = None) -> str:
        import fsspec

        name = f"{name}-{len(buckets)}"
        fs = fsspec.filesystem("s3")
        fs.mkdir(name)
        buckets.append(name)
        for key, blob in (files or {}).items():
            fs.pipe(f"{name}/{key}", blob)
        return f"s3://{name}"

    try:
        yield bucket
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
