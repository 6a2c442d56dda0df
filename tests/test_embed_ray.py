"""`vit22b embed --runner ray` on a local Ray instance (``ray.init(num_cpus=2)``, once here).

Both kinds of actors against the threads runner on the same folder (bit for bit: one request in
flight on each side), a worker process SIGKILLed mid-job (Ray restarts it; every image ends up
in the output exactly once), a shard whose worker is killed every time it reads one input (given
up after the retries, named, the rest kept), a rerun that skips everything, corrupt files
reported, inputs and Parquet outputs on real S3- and GCS-compatible servers on loopback, and the
CLI joining the instance.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from serving import MESH, shared_engine, start_server
from test_embed import read_dir
from test_embed_remote import dataset, server  # noqa: F401 - the fixtures: 30 + 3 bad files
from vit22b.clients.embed import JobConfig, JobFailed, OutputSpec, run_job
from vit22b.clients.embed_inputs import InputItem, enumerate_inputs
from vit22b.clients.embed_local import LocalBackend
from vit22b.clients.embed_ray import EngineActors, ServerActors, embed_with_ray
from vit22b.clients.embed_remote import RemoteBackend
from vit22b.clients.embed_store import JobMismatch
from vit22b.clients.outputs import open_outputs

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]
SPEC = OutputSpec(pooled=True, patch_layers=(-1,), dtype="bfloat16")


@pytest.fixture(scope="module")
def cluster(s3, request):
    # after the S3 and GCS servers: Ray's workers inherit this process's environment at init
    try:
        request.getfixturevalue("gcs")
    except pytest.skip.Exception:  # no gcsfs here: the gs:// case skips, the others run
        pass
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
             logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def config(data, out, **kw) -> JobConfig:
    return JobConfig([str(data)], str(out), SPEC, quiet=True,
                     **{"batch_size": 4, "shard_size": 5, **kw})


def actor_pids() -> set[int]:
    """This test's Ray actors of the job (processes below this one: never another's)."""
    pids = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if "MapWorker" in " ".join(process.cmdline()):
                pids.add(process.pid)
        except psutil.Error:  # gone, or a zombie not yet reaped
            pass
    return pids



def test_the_python_api_computes_in_the_dtype_the_cli_does():
    """`vit22b embed --local`'s --compute-dtype defaults to auto; LocalBackend and EngineActors
    took the model's own dtype (None), so the README's Ray example computed bf16 where the CLI
    computes float32 on a CPU without bf16 instructions."""
    import dataclasses
    import inspect

    from vit22b.clients.embed_cli import EmbedSettings

    cli = {f.name: f.default for f in dataclasses.fields(EmbedSettings)}["compute_dtype"]
    local = inspect.signature(LocalBackend).parameters["compute_dtype"].default
    assert cli == "auto" and local == cli and EngineActors().compute_dtype == cli

def test_both_kinds_equal_the_threads_runner_and_rerun_skips(cluster, server, dataset,
                                                             tmp_path):
    data, good, bad = dataset
    backend = RemoteBackend([server.address], SPEC, batch_size=4, concurrency=1, quiet=True)
    threads = run_job(config(data, tmp_path / "threads"), backend)
    backend.close()
    summary = embed_with_ray(config(data, tmp_path / "servers"), ServerActors((server.address,)),
                             concurrency=1)
    assert summary.complete and (summary.embedded, summary.failed) == (30, 3)
    assert threads.complete and read_dir(tmp_path / "servers") == read_dir(tmp_path / "threads")

    local = LocalBackend(SPEC, engine=shared_engine(), concurrency=1)
    run_job(config(data, tmp_path / "local"), local)
    local.close()
    # the model's own dtype, as shared_engine's (the default, auto, differs on CPUs without bf16)
    summary = embed_with_ray(config(data, tmp_path / "engine"),
                             EngineActors(mesh=MESH, compute_dtype=None), concurrency=1)
    assert summary.complete and (summary.embedded, summary.failed) == (30, 3)
    assert read_dir(tmp_path / "engine") == read_dir(tmp_path / "local")  # manifest included

    result = open_outputs(str(tmp_path / "engine"), verify=True)
    assert result.ids == good
    errors = [json.loads(line) for line in open(tmp_path / "engine" / "errors.jsonl")]
    assert {e["id"]: e["reason"] for e in errors}.keys() == bad.keys()
    for e in errors:  # corrupt files are reported with the decoder's reason
        assert bad[e["id"]] in e["reason"], e

    before = read_dir(tmp_path / "servers")
    again = embed_with_ray(config(data, tmp_path / "servers"), ServerActors((server.address,)))
    assert (again.embedded, again.failed, again.skipped, again.complete) == (0, 0, 33, True)
    assert read_dir(tmp_path / "servers") == before
    with pytest.raises(JobMismatch, match="format: 'npy' in the manifest, 'parquet' now"):
        embed_with_ray(config(data, tmp_path / "servers", format="parquet"),
                       ServerActors((server.address,)))


def test_a_killed_worker_is_retried_and_every_image_is_there_once(cluster, server, dataset,
                                                                  tmp_path, monkeypatch):
    data, good, bad = dataset
    seen, killed = [], []
    # shards go out once both actors are up (Ray Data's default starts with the first one, and
    # a loaded host can finish a shard before the second is there to be seen)
    monkeypatch.setattr(ray.data.DataContext.get_current(), "wait_for_min_actors_s", 120)

    def kill_one(shard: int) -> None:
        seen.append(actor_pids())
        if not killed:  # both actors are busy with their next shard: kill one mid-shard
            assert len(seen[0]) == 2, seen
            victim, survivor = sorted(seen[0])
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
            # Ray restarts the actor on its own, in seconds on a loaded host, while the survivor
            # can drain every shard in one: the job then ended without it and Ray dropped the
            # restart (the driver waiting here does not hold the survivor back). The survivor
            # waits stopped until the restarted actor is there (bounded).
            os.kill(survivor, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 60
                while not actor_pids() - seen[0] and time.monotonic() < deadline:
                    time.sleep(0.1)
            finally:
                os.kill(survivor, signal.SIGCONT)
            seen.append(actor_pids())

    # shards of 2 images, one per batch: 17 shards of >= 25 ms each over 2 actors
    summary = embed_with_ray(config(data, tmp_path / "out", batch_size=1, shard_size=2,
                                    on_shard=kill_one),
                             ServerActors((server.address,)), concurrency=2)
    assert killed
    assert summary.complete and (summary.embedded, summary.failed) == (30, 3)
    assert any(set(pids) - seen[0] for pids in seen[1:]), "no actor was restarted"
    result = open_outputs(str(tmp_path / "out"), verify=True)
    assert result.ids == good  # every image exactly once, in input order
    assert sorted(f["id"] for f in result.failed) == sorted(bad)

    # the same as an uninterrupted run (concurrent requests may be packed into other batch
    # sizes by the server, which moves a value by an ulp: compared to bf16 rounding)
    alone = RemoteBackend([server.address], SPEC, batch_size=1, concurrency=1, quiet=True)
    run_job(config(data, tmp_path / "alone", batch_size=1, shard_size=2), alone)
    alone.close()
    reference = open_outputs(str(tmp_path / "alone"))
    for name in reference.names:
        np.testing.assert_allclose(np.asarray(result[name]), np.asarray(reference[name]),
                                   rtol=1e-2, atol=1e-2)
    assert (tmp_path / "out" / "errors.jsonl").read_bytes() == \
        (tmp_path / "alone" / "errors.jsonl").read_bytes()


class KillWhoeverReads:
    """An image URL on 127.0.0.1 among the inputs: each time an actor asks for it, that actor's
    process is SIGKILLed (found by its end of the connection) and no answer is sent, until
    ``stop()``."""

    def __init__(self):
        poison = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                reader = poison._reader(self.client_address)
                if reader is not None:
                    os.kill(reader, signal.SIGKILL)
                    poison.kills.append(reader)
                    psutil.Process(reader).wait(timeout=30)
                self.close_connection = True  # no answer: the reader is gone

            def log_message(self, *args) -> None:
                pass

        self.kills: list[int] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/poison.jpg"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def _reader(peer: tuple[str, int]) -> int | None:
        for pid in actor_pids():
            try:
                if any(c.laddr == peer for c in psutil.Process(pid).net_connections("tcp")):
                    return pid
            except psutil.Error:  # gone meanwhile
                pass
        return None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=30)


def test_a_shard_that_kills_its_worker_every_time_is_given_up_and_named(cluster, server,
                                                                         dataset, tmp_path):
    data, good, _ = dataset
    poison = KillWhoeverReads()
    items = [*enumerate_inputs([str(data)]), InputItem("zz.jpg", poison.url)]
    job = config(data, tmp_path / "out")  # shards of 5: zz.jpg, last, is in shard 6 of 0..6
    try:
        with pytest.raises(JobFailed) as failed:
            embed_with_ray(job, ServerActors((server.address,)), concurrency=2, items=items,
                           max_retries=1)
    finally:
        poison.stop()
    message = str(failed.value)
    assert "shard 6 (inputs " in message and "zz.jpg)" in message, message
    assert "given up after 2 tries" in message and "6 completed shards are kept" in message
    assert len(poison.kills) == 2  # the first try and one retry, each in its own process
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert sorted(s["index"] for s in manifest["shards"]) == list(range(6))
    ids = [i for s in manifest["shards"]
           for i in json.loads((tmp_path / "out" / s["files"]["ids"]["file"]).read_text())["ids"]]
    assert ids == [item.id for item in items[:30] if item.id in good]  # whole and once


def test_a_lost_server_ends_the_job_with_its_reason_and_a_rerun_resumes(cluster, server,
                                                                         dataset, tmp_path):
    data, good, _ = dataset
    lone = start_server(max_delay_ms=25)  # its own server, stopped once a shard is recorded
    stopped = []

    def stop_it(shard: int) -> None:
        if not stopped:
            lone.stop()
            stopped.append(shard)

    job = config(data, tmp_path / "out", batch_size=1, shard_size=2, on_shard=stop_it)
    with pytest.raises(JobFailed, match="every server is lost") as failed:  # an actor's error,
        embed_with_ray(job, ServerActors((lone.address,)), concurrency=1)  # raised here
    assert lone.address in str(failed.value)
    again = embed_with_ray(config(data, tmp_path / "out", batch_size=1, shard_size=2),
                           ServerActors((server.address,)), concurrency=2)
    assert again.complete and again.skipped >= 2 and again.skipped + again.embedded + \
        again.failed == 33
    assert open_outputs(str(tmp_path / "out"), verify=True).ids == good


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_object_store_inputs_and_parquet_outputs(cluster, server, dataset, store, request,
                                                 tmp_path):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    data, good, bad = dataset
    bucket = request.getfixturevalue(store)(
        "ray", {f"photos/{rel}": (data / rel).read_bytes() for rel in [*good, *bad]})
    fs = fsspec.filesystem(bucket.split("://")[0])
    out = f"{bucket}/emb"
    job = JobConfig([f"{bucket}/photos/"], out, SPEC, batch_size=4, shard_size=5, quiet=True,
                    format="parquet")
    summary = embed_with_ray(job, ServerActors((server.address,)), concurrency=1)
    assert summary.complete and (summary.embedded, summary.failed) == (30, 3)

    manifest = json.loads(fs.cat_file(f"{out}/manifest.json"))
    table = pa.concat_tables(pq.read_table(f"{out}/{s['files']['table']['file']}",
                                           filesystem=fs) for s in manifest["shards"])
    assert table["id"].to_pylist() == good
    assert table["path"].to_pylist() == [f"{bucket}/photos/{i}" for i in good]
    assert json.loads(table.schema.metadata[b"vit22b"])["identity"] == manifest["identity"]

    backend = RemoteBackend([server.address], SPEC, batch_size=4, concurrency=1, quiet=True)
    run_job(config(data, tmp_path / "npy"), backend)
    backend.close()
    reference = open_outputs(str(tmp_path / "npy"))
    pooled = np.stack(table["pooled"].to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(pooled, np.asarray(reference["pooled"]))
    errors = [json.loads(line) for line in fs.cat_file(f"{out}/errors.jsonl").splitlines()]
    assert sorted(e["id"] for e in errors) == sorted(bad)


def test_cli_joins_the_cluster(cluster, server, dataset, tmp_path):
    data, good, _ = dataset
    args = [sys.executable, "-m", "vit22b.clients.cli", "embed", str(data), "--server",
            server.address, "--runner", "ray", "--ray-address", cluster, "--concurrency", "2",
            "--ray-max-retries", "2",
            "--format", "safetensors", "--dtype", "bfloat16", "-o", str(tmp_path / "out"), "-q"]
    job = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr
    assert "embedded 30, skipped 0 (done by an earlier run), failed 3" in job.stdout
    result = open_outputs(str(tmp_path / "out"), verify=True)
    assert result.ids == good and result.manifest["identity"]["format"] == "safetensors"

    mixed = subprocess.run([*args, "--format", "npy"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert mixed.returncode == 2 and "refusing to mix" in mixed.stderr


def test_a_job_over_videos_equals_the_threads_runner(cluster, server, tmp_path):
    pytest.importorskip("av")
    from vit22b.clients.video import Sampling, write_video

    data = tmp_path / "videos"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        write_video(data / f"v{i}.mp4", rng.integers(0, 256, (6 + i, 32, 48, 3), np.uint8))
    (data / "bad.mp4").write_bytes(b"not a video")
    video = dict(video=Sampling(frames=2), batch_size=2, shard_size=3)
    backend = RemoteBackend([server.address], SPEC, batch_size=4, concurrency=1, quiet=True)
    threads = run_job(config(data, tmp_path / "threads", **video), backend)
    backend.close()
    summary = embed_with_ray(config(data, tmp_path / "ray", **video),
                             ServerActors((server.address,)), concurrency=1)
    assert (summary.embedded, summary.failed) == (threads.embedded, threads.failed) == (3, 1)
    assert read_dir(tmp_path / "ray") == read_dir(tmp_path / "threads")
    assert open_outputs(str(tmp_path / "ray"))["frames.pooled"].shape == (3, 2, 64)


def test_a_ray_address_where_nothing_answers_is_refused_at_once():
    """`--ray-address` at a port nobody listens on: Ray retried for about 15 minutes in
    warnings, and the job said nothing; now one line, in well under a second."""
    import socket

    from vit22b.clients.embed_ray import _reachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing answers there
    start = time.perf_counter()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ValueError, match=rf"cannot join the Ray cluster at {address}: "
                                             rf"nothing answers at 127.0.0.1:{port} \(Connection "
                                             "refused"):
            _reachable(address)
    assert time.perf_counter() - start < 5
    for address in (None, "auto", "local"):  # a new instance, or Ray's own discovery
        _reachable(address)
