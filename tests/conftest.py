"""Test setup: 8 emulated CPU devices and the server's XLA:CPU flags (with the tests' fast
compile: tests/xla_env.py), set before jax is imported anywhere; S3 and GCS servers."""

import contextlib
import importlib.util
import itertools
import logging
import os
import socket

import pytest
from vit22b.server.cpu_devices import prefer_wide_vectors  # jax-free
from xla_env import xla_flags

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()
# The server's XLA:CPU code generation here too, and in every process a test starts (they
# inherit it): a job's engine workers must compute what this process computes, bit for bit.
prefer_wide_vectors()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``env`` in os.environ (so also in processes started meanwhile), restored afterwards."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _buckets(protocol: str):
    """``bucket(name, files)``: a fresh bucket holding ``files`` ({key: bytes}); its URL."""
    count = itertools.count()

    def bucket(name: str, files: dict[str, bytes] | None = None) -> str:
        import fsspec

        name = f"{name}-{next(count)}"
        fs = fsspec.filesystem(protocol)
        fs.mkdir(name)
        for key, blob in (files or {}).items():
            fs.pipe(f"{name}/{key}", blob)
        return f"{protocol}://{name}"

    return bucket


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto's server mode) on a free loopback port; the AWS
    variables point every S3 client of this process (and of processes it starts) at it.
    Yields ``bucket(name, files)`` (see _buckets)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    # bound to port 0 by the server itself: a port probed free and bound later can be taken
    # meanwhile (any loopback connection's own end)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
    try:
        with _environment(env):
            yield _buckets("s3")
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs():
    """A real GCS-compatible server (gcp-storage-emulator, in memory) on a free loopback port;
    ``STORAGE_EMULATOR_HOST`` points gcsfs at it, anonymously (``FSSPEC_GS_TOKEN``, and the
    same in fsspec's config here: it read the environment when imported). gcsfs's default
    filesystem asks GCS's gRPC control API what kind each bucket is, which no emulator serves
    (60 s of retries per bucket): ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` takes the plain
    JSON-API one, read when gcsfs is imported (so not imported before this). Yields
    ``bucket(name, files)`` (see _buckets)."""
    for module in ("gcsfs", "gcp_storage_emulator"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"gs:// tests need {module}")
    import fsspec.config

    port = _free_port()
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "FSSPEC_GS_TOKEN": "anon"}
    with _environment(env):
        from gcp_storage_emulator.server import create_server

        logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
        server = create_server("127.0.0.1", port, in_memory=True)
        server.start()
        saved = fsspec.config.conf.get("gs")
        fsspec.config.conf["gs"] = {**(saved or {}), "token": "anon"}
        try:
            yield _buckets("gs")
        finally:
            server.stop()
            if saved is None:
                fsspec.config.conf.pop("gs", None)
            else:
                fsspec.config.conf["gs"] = saved


# The slowest test files first: `make test` hands whole files to its workers in collection order
# (`--dist loadfile --no-loadscope-reorder`; xdist's own order is by test count), so the files
# that start last are short and no worker waits long on another's last file. Seconds in their
# tests from `PYTHONPATH=benchmarks python -m pytest -p suite_timeline -n 3 --dist loadfile`
# (benchmarks/NOTES.md, "The suite's files in order of their cost"); a file not named here
# runs after these, in collection order.
SLOWEST_FILES = (
    "test_forward_plan.py",  # 406 s
    "test_cli_exit_codes.py",  # 370
    "test_distributed.py",  # 219
    "test_backbones.py",  # 205
    "test_embed_ray.py",  # 201
    "test_probes_cli.py",  # 146
    "test_resolution_serving.py",  # 133
    "test_http.py",  # 121
    "test_server_ops.py",  # 115
    "test_model.py",  # 113
    "test_resolution.py",  # 91
    "test_checkpoint.py",  # 83
    "test_convert.py",  # 76
    "test_embed.py",  # 66
    "test_hardening.py",  # 55
    "test_video_probe.py",  # 47
    "test_sharding.py",  # 44
    "test_probes_shapes.py",  # 43
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
