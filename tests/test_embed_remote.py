"""`vit22b embed --server`: SIGKILL-and-resume, failover between servers, the CLI's refusals.

Real servers on loopback: in-process ones sharing the session's engine (tests/serving.py), and a
`vit22b serve` subprocess where a server has to die by SIGKILL. The job itself runs as a
subprocess (`python -m vit22b.clients.cli embed ...`) wherever it gets killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from serving import MESH, start_server
from test_embed import read_dir, write_bad_files, write_images
from vit22b.clients.client import Retry
from vit22b.clients.embed import JobConfig, OutputSpec, run_job
from vit22b.clients.embed_remote import RemoteBackend
from vit22b.clients.outputs import open_outputs
from xla_env import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def embed_cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vit22b.clients.cli", "embed", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


def done_shards(out: Path) -> int:
    try:
        return len(json.loads((out / "manifest.json").read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


@contextlib.contextmanager
def held_past(engine, out: Path, target: int):
    """The server's forwards wait (until the block ends) once ``target`` shards of ``out`` are
    done: a job cannot run past its kill. A loaded host once gave the job a whole slice of
    CPU while this process waited for its turn to stop it, and the job finished."""
    release, original = threading.Event(), engine.forward

    def forward(images, outputs):
        if done_shards(out) >= target:
            release.wait(120)
        return original(images, outputs)

    engine.forward = forward
    try:
        yield
    finally:
        release.set()
        del engine.forward


def kill_mid_job(job: subprocess.Popen, out: Path, target: int, shards: int, rng) -> None:
    """SIGKILL ``job`` once ``target`` of its ``shards`` are done, somewhere inside the next.

    The job runs in short random slices between SIGSTOPs, and the manifest is read while it is
    stopped: the kill lands on the state just read, however late this process gets the CPU (a
    sleep-then-kill let a loaded host finish the job first); under ``held_past`` the job
    cannot finish inside a slice either."""
    deadline = time.monotonic() + 120
    done = 0
    while done < target:
        assert job.poll() is None, f"the job ended before the kill at {target}"
        assert time.monotonic() < deadline, f"{done} of {target} shards done in 120 s"
        job.send_signal(signal.SIGCONT)
        time.sleep(rng.uniform(0.001, 0.01))
        job.send_signal(signal.SIGSTOP)
        done = done_shards(out)
    assert done < shards, "the job finished inside one slice"
    job.send_signal(signal.SIGKILL)
    job.communicate(timeout=30)
    assert job.returncode == -signal.SIGKILL
    assert not json.loads((out / "manifest.json").read_text())["complete"]


@pytest.fixture(scope="module")
def server():
    # a short batching delay, always waited out, makes every request take a little while: kills
    # land mid-job
    srv = start_server(max_delay_ms=25, batch_wait="delay")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    data = tmp_path_factory.mktemp("embed") / "data"
    good = write_images(data, 30, seed=1)
    bad = write_bad_files(data)
    return data, good, bad


def test_sigkill_three_times_then_resume_is_bit_identical(server, dataset, tmp_path):
    data, good, bad = dataset
    args = [str(data), "--server", server.address, "--batch-size", "2", "--shard-size", "4",
            "--concurrency", "1", "--outputs", "pooled", "--layers", "-1", "--dtype", "bfloat16"]
    full = embed_cli(*args, "--output", str(tmp_path / "full"), "--quiet")
    stdout, stderr = full.communicate(timeout=120)
    assert full.returncode == 0, stderr
    assert "embedded 30, skipped 0 (done by an earlier run), failed 3" in stdout
    shards = -(-33 // 4)

    out = tmp_path / "killed"
    rng = np.random.default_rng(7)
    targets = sorted(rng.choice(np.arange(1, shards - 1), size=3, replace=False))
    for target in targets:
        job = embed_cli(*args, "--output", str(out), "--quiet")
        with held_past(server.engine, out, target):
            kill_mid_job(job, out, target, shards, rng)

    resumed = embed_cli(*args, "--output", str(out), "--quiet")
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    skipped = int(re.search(r"skipped (\d+)", stdout)[1])
    assert skipped >= 4 * targets[-1]  # work before the kills was kept, not redone
    assert read_dir(out) == read_dir(tmp_path / "full")  # bit for bit, manifest included
    result = open_outputs(str(out), verify=True)
    assert result.ids == good and len(set(result.ids)) == len(good)
    assert sorted(f["id"] for f in result.failed) == sorted(bad)
    assert not any(".tmp-" in name for name in os.listdir(out / "shards"))


@pytest.fixture
def victim():
    """A `vit22b serve` process on the same mesh, seed and compute dtype (the preset's, on any
    host) as the in-process servers."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(8))
    proc = subprocess.Popen(
        [sys.executable, "-m", "vit22b.clients.cli", "serve", "--port", "0", "--metrics-port",
         "-1", "--mesh", MESH, "--max-batch-images", "8", "--max-delay-ms", "25",
         "--batch-wait", "delay", "--compute-dtype", "none", "--log-level", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        for line in proc.stdout:
            match = re.search(r"SERVING .* on (\S+),", line)
            if match:
                break
        assert match, "the server did not report SERVING"
        yield proc, match[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_two_servers_one_killed_mid_job(server, victim, dataset, tmp_path):
    data, good, bad = dataset
    proc, address = victim
    spec = OutputSpec(pooled=True)
    backend = RemoteBackend([address, server.address], spec, batch_size=2, concurrency=2,
                            retry=Retry(attempts=2, initial_s=0.05), quiet=True)
    written, killed = [], []

    def kill_after_two(shard: int) -> None:  # both servers have had work by then
        written.append(shard)
        if len(written) == 2:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed.append(shard)

    config = JobConfig([str(data)], str(tmp_path / "out"), spec, batch_size=2, shard_size=4,
                       quiet=True, on_shard=kill_after_two)
    summary = run_job(config, backend)
    backend.close()
    assert killed and summary.complete
    assert any(name.startswith(address) for name in summary.lost_workers)
    assert (summary.embedded, summary.failed) == (30, 3)
    result = open_outputs(str(out := tmp_path / "out"), verify=True)
    assert result.ids == good  # nothing lost, nothing twice
    assert sorted(f["id"] for f in result.failed) == sorted(bad)

    # the same features as one server alone computes (same mesh, same weights); concurrent
    # requests may be packed into other batch sizes than alone, which moves a few values by an ulp
    alone = RemoteBackend([server.address], spec, quiet=True)
    run_job(JobConfig([str(data)], str(tmp_path / "alone"), spec, batch_size=2, shard_size=4,
                      quiet=True), alone)
    alone.close()
    np.testing.assert_allclose(np.asarray(result["pooled"]),
                               np.asarray(open_outputs(str(tmp_path / "alone"))["pooled"]),
                               rtol=1e-5, atol=1e-6)
    assert (out / "errors.jsonl").read_bytes() == (tmp_path / "alone" / "errors.jsonl").read_bytes()


def test_a_rerun_on_servers_with_a_larger_pixel_limit_takes_the_images_refused(tmp_path):
    """A remote job's bound is its servers' (the smallest, as GetModelInfo states them): an
    image one server refused as too large is taken by a rerun on a server whose limit allows
    it, and not by one on a set that still includes the smaller limit."""
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    for name, side in {"mid.png": 20, "small0.png": 8, "small1.png": 8}.items():
        Image.new("RGB", (side, side), (side, 20, 30)).save(data / name)
    small, large = start_server(max_image_pixels=100), start_server(max_image_pixels=1000)
    spec = OutputSpec(pooled=True)

    def job(*servers):
        backend = RemoteBackend([s.address for s in servers], spec, quiet=True)
        assert backend.max_image_pixels == min(s.server.config.max_image_pixels for s in servers)
        try:
            return run_job(JobConfig([str(data)], str(tmp_path / "out"), spec, batch_size=2,
                                     shard_size=2, quiet=True), backend)
        finally:
            backend.close()

    try:
        first = job(small)
        assert (first.embedded, first.failed) == (2, 1)
        assert job(small, large).skipped == 3  # the set's bound is still 100
        again = job(large)
        assert (again.embedded, again.failed, again.skipped) == (2, 0, 1)  # mid's shard
        result = open_outputs(str(tmp_path / "out"), verify=True)
        assert result.ids == ["mid.png", "small0.png", "small1.png"] and not result.failed
    finally:
        small.stop()
        large.stop()


def test_cli_refusals_and_progress(server, dataset, tmp_path):
    data, good, _ = dataset
    out = str(tmp_path / "out")
    # remote mode stays free of jax
    code = ("import sys; from vit22b.clients.cli import main; rc = main(sys.argv[1:]); "
            "assert 'jax' not in sys.modules, 'remote mode imported jax'; sys.exit(rc)")
    job = subprocess.run([sys.executable, "-c", code, "embed", str(data), "--server",
                          server.address, "--output", out, "--shard-size", "16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    assert re.search(r"img/s", job.stderr) and "embed: 100%" in job.stderr  # the progress bar

    again = embed_cli(str(data), "--server", server.address, "--output", out,
                      "--shard-size", "16")
    stdout, stderr = again.communicate(timeout=60)
    assert again.returncode == 0 and stderr == ""  # nothing to do: no bar
    assert "embedded 0, skipped 33" in stdout and f"holds {len(good)} images" in stdout

    other = embed_cli(str(data), "--server", server.address, "--output", out,
                      "--shard-size", "16", "--dtype", "float16", "--quiet")
    stdout, stderr = other.communicate(timeout=60)
    assert other.returncode == 2
    assert "refusing to mix" in stderr and "dtype: 'float32' in the manifest, 'float16' now" \
        in stderr

    nobody = embed_cli(str(data), "--server", "127.0.0.1:1", "--output", str(tmp_path / "x"))
    stdout, stderr = nobody.communicate(timeout=120)
    assert nobody.returncode == 1 and "no server could be reached: 127.0.0.1:1" in stderr

    bad_layer = embed_cli(str(data), "--server", server.address, "--output",
                          str(tmp_path / "y"), "--layers", "9")
    stdout, stderr = bad_layer.communicate(timeout=60)
    assert bad_layer.returncode == 2 and "layer index 9 is out of range" in stderr
