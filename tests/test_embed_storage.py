"""`vit22b embed --format` and remote storage with the threads runner (Ray: test_embed_ray.py).

Parquet and safetensors shards are read back with pyarrow / pandas / safetensors alone and must
equal the .npy shards of the same job (bfloat16 compared as bfloat16). Remote storage: fsspec's
memory://, a real S3-compatible server on loopback (moto's server mode, the ``s3`` fixture) and a
real GCS-compatible one (gcp-storage-emulator, the ``gcs`` fixture).
"""

from __future__ import annotations

import io
import json
import os

import fsspec
import ml_dtypes
import numpy as np
import pytest
from PIL import Image
from test_embed import engine, local_job, read_dir, write_bad_files, write_images  # noqa: F401
from vit22b.clients.embed import OutputSpec
from vit22b.clients.embed_inputs import InputListError, enumerate_inputs
from vit22b.clients.embed_store import JobMismatch, OutputStore
from vit22b.clients.outputs import OutputsError, open_outputs, read_manifest

SPEC = OutputSpec(pooled=True, patch_layers=(-1, 1), dtype="bfloat16")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats") / "data"
    return root, write_images(root, 7), write_bad_files(root)


@pytest.fixture(scope="module")
def npy(engine, data, tmp_path_factory):  # the engine fixture of test_embed
    out = tmp_path_factory.mktemp("npy") / "out"
    assert local_job(engine, data[0], out, SPEC, shard_size=3).complete
    return out


def bf16(array) -> np.ndarray:
    """Exact for float32 values that are bfloat16 values (the .npy files hold only those)."""
    return np.asarray(array).astype(ml_dtypes.bfloat16)


def test_parquet_reads_with_pyarrow_and_pandas_alone(engine, data, npy, tmp_path):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    assert local_job(engine, data[0], out, SPEC, shard_size=3, format="parquet").complete
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["format"] == "parquet"
    reference = open_outputs(str(npy))
    tables = [pq.read_table(out / s["files"]["table"]["file"]) for s in manifest["shards"]]

    schema = tables[0].schema
    assert schema.names == ["id", "path", "pooled", "patch_tokens.1", "patch_tokens.3"]
    meta = json.loads(schema.metadata[b"vit22b"])
    assert meta["identity"] == manifest["identity"]  # model, fingerprint, hashes, outputs...
    assert meta["arrays"]["patch_tokens.3"] == {"dtype": "bfloat16", "shape": [16, 64]}
    assert schema.field("pooled").metadata == {b"dtype": b"bfloat16"}
    pooled_type = schema.field("pooled").type
    assert (pooled_type.list_size, str(pooled_type.value_type)) == (64, "float")

    table = pa.concat_tables(tables)  # a shard whose images all failed has no rows
    assert table["id"].to_pylist() == reference.ids == data[1]
    pooled = np.stack(table["pooled"].to_numpy(zero_copy_only=False))
    assert pooled.dtype == np.float32  # float values, never integers
    np.testing.assert_array_equal(bf16(pooled), bf16(reference["pooled"]))

    frame = pd.read_parquet(out / manifest["shards"][0]["files"]["table"]["file"])
    assert list(frame["id"]) == data[1][:3]
    tokens = np.stack([np.stack(row) for row in frame["patch_tokens.3"]])  # [3, 16, 64]
    np.testing.assert_array_equal(bf16(tokens), bf16(reference["patch_tokens.3"][:3]))

    loaded = open_outputs(str(out), verify=True)  # the project's loader reads it too
    for name in reference.names:
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(reference[name]))
    assert loaded.failed == reference.failed and len(loaded.failed) == 3


def test_safetensors_reads_with_safetensors_alone(engine, data, npy, tmp_path):
    import safetensors
    import safetensors.torch
    import torch

    out = tmp_path / "out"
    assert local_job(engine, data[0], out, SPEC, shard_size=3, format="safetensors").complete
    manifest = read_manifest(str(out))
    reference = open_outputs(str(npy))
    first = out / manifest["shards"][0]["files"]["tensors"]["file"]
    raw = dict(safetensors.deserialize(first.read_bytes()))
    assert raw["pooled"]["dtype"] == "BF16" and raw["pooled"]["shape"] == [3, 64]
    pooled = np.frombuffer(raw["pooled"]["data"], ml_dtypes.bfloat16).reshape(3, 64)
    np.testing.assert_array_equal(pooled, bf16(reference["pooled"][:3]))  # bf16 as bf16

    tensors = safetensors.torch.load_file(first)
    assert tensors["patch_tokens.3"].dtype == torch.bfloat16
    want = bf16(reference["patch_tokens.3"][:3]).view(np.int16)
    np.testing.assert_array_equal(tensors["patch_tokens.3"].view(torch.int16).numpy(), want)
    with safetensors.safe_open(first, "pt") as f:
        meta = json.loads(f.metadata()["vit22b"])
    assert meta["identity"] == manifest["identity"] and meta["shard"] == 0

    loaded = open_outputs(str(out), verify=True)
    assert loaded.ids == reference.ids
    for name in reference.names:
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(reference[name]))


def test_float16_parquet_and_a_format_mix_is_refused(engine, data, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    spec = OutputSpec(dtype="float16")
    assert local_job(engine, data[0], out, spec, shard_size=4, format="parquet").complete
    table = pq.read_table(out / "shards" / "00000.parquet")
    assert str(table.schema.field("pooled").type.value_type) == "halffloat"
    assert np.asarray(open_outputs(str(out))["pooled"]).dtype == np.float16
    with pytest.raises(JobMismatch, match="format: 'parquet' in the manifest, 'npy' now"):
        local_job(engine, data[0], out, spec, shard_size=4)


@pytest.mark.parametrize("fmt", ["npy", "parquet", "safetensors"])
def test_a_damaged_shard_is_named_in_every_format(engine, data, fmt, tmp_path):
    """A shard truncated (a full disk), its header garbled or its rows of another shape or kind
    raised what numpy, pyarrow, struct or json raise (ValueError, ArrowInvalid, struct.error,
    UnicodeDecodeError, TokenError, EOFError), or read integers as features; each is an
    OutputsError naming the shard, with and without memory mapping."""
    out = tmp_path / "out"
    assert local_job(engine, data[0], out, SPEC, shard_size=4, format=fmt).complete
    entry = read_manifest(str(out))["shards"][0]["files"]
    file = out / entry[{"npy": "pooled", "parquet": "table", "safetensors": "tensors"}[fmt]]["file"]
    whole = file.read_bytes()
    garbled = (whole[:-72] + b"\xff" * 64 + whole[-8:] if fmt == "parquet"  # its footer
               else whole[:9] + b"\xff" * 64 + whole[73:])  # the header
    for damaged in (whole[: len(whole) // 2], whole[:7], b"", garbled):
        file.write_bytes(damaged)
        for mmap in (True, False):
            with pytest.raises(OutputsError, match=r"shard 0 cannot be read \(shards/00000\."):
                open_outputs(str(out), mmap=mmap)
    if fmt == "npy":  # well-formed files whose rows are not the manifest's
        for rows in (np.zeros((4, 64), np.int64), np.zeros((4, 63), np.float32)):
            np.save(file, rows)
            with pytest.raises(OutputsError, match="shard 0's pooled holds .* the manifest says "
                                                   r"bfloat16 \[64\]"):
                open_outputs(str(out))


def test_memory_filesystem_inputs_outputs_and_resume(engine, data, npy):
    root, good, bad = data
    fs = fsspec.filesystem("memory")
    for rel in [*good, *bad]:
        fs.pipe(f"/in/{rel}", (root / rel).read_bytes())
    fs.pipe("/in/.hidden.jpg", b"skipped")
    items = enumerate_inputs(["memory://in/"])
    assert [i.id for i in items] == sorted([*good, *bad])
    assert items[0].path == f"memory:///in/{items[0].id}"

    out = "memory://jobs/out"
    summary = local_job(engine, "memory://in", out, SPEC, shard_size=3)
    assert summary.complete and (summary.embedded, summary.failed) == (7, 3)
    result = open_outputs(out, verify=True)
    reference = open_outputs(str(npy))
    assert result.ids == reference.ids
    np.testing.assert_array_equal(np.asarray(result["patch_tokens.1"]),
                                  np.asarray(reference["patch_tokens.1"]))
    assert sorted(f["id"] for f in result.failed) == sorted(bad)
    assert all(f["path"].startswith("memory:///in/") for f in result.failed)

    # an object store keeps no temp files: every object is written whole, the manifest last
    assert not any(".tmp-" in name for name in fs.find("/jobs/out"))
    again = local_job(engine, "memory://in", out, SPEC, shard_size=3)
    assert (again.embedded, again.skipped) == (0, 10)
    fs.rm("/jobs/out/shards/00001.pooled.npy")  # a lost shard file: that shard is redone
    redone = local_job(engine, "memory://in", out, SPEC, shard_size=3)
    assert (redone.embedded + redone.failed, redone.skipped) == (3, 7)
    fs.pipe("/jobs/out/shards/00002.pooled.npy", b"damaged")
    with pytest.raises(OutputsError, match="00002.pooled.npy does not match"):
        open_outputs(out, verify=True)


def _parquet_job_in_the_store(engine, bucket: str, npy, bad) -> str:
    """A job from ``bucket/photos/`` into Parquet at ``bucket/emb``: equal to the npy reference,
    the bad files listed with their URLs, a rerun skipping everything; returns the output URL."""
    out = f"{bucket}/emb"
    summary = local_job(engine, f"{bucket}/photos/", out, SPEC, shard_size=3, format="parquet")
    assert summary.complete and (summary.embedded, summary.failed) == (7, 3)
    result = open_outputs(out, verify=True)
    reference = open_outputs(str(npy))
    assert result.ids == reference.ids
    for name in reference.names:
        np.testing.assert_array_equal(np.asarray(result[name]), np.asarray(reference[name]))
    assert sorted(f["id"] for f in result.failed) == sorted(bad)
    for failure in result.failed:  # an empty object is "empty" too (S3 refuses ranges of it)
        assert bad[failure["id"]] in failure["reason"], failure
    assert result.failed[0]["path"] == f"{bucket}/photos/{result.failed[0]['id']}"
    assert local_job(engine, f"{bucket}/photos/", out, SPEC, shard_size=3,
                     format="parquet").skipped == 10
    return out


def test_s3_inputs_and_outputs(engine, data, npy, s3, tmp_path):
    root, good, bad = data
    objects = {f"photos/{rel}": (root / rel).read_bytes() for rel in [*good, *bad]}
    objects["photos/class1/"] = b""  # the zero-byte marker a console's "new folder" makes
    bucket = s3("threads", objects)
    fs = fsspec.filesystem("s3")
    listing = tmp_path / "list.txt"  # a local list file naming objects, one of them missing
    listing.write_text(f"{bucket}/photos/{good[0]}\n{bucket}/photos/missing.jpg\n")

    out = _parquet_job_in_the_store(engine, bucket, npy, bad)
    errors = [json.loads(line) for line in fs.cat_file(f"{out}/errors.jsonl").splitlines()]
    assert sorted(e["id"] for e in errors) == sorted(bad)  # the marker is no input
    assert errors[0]["path"] == f"{bucket}/photos/{errors[0]['id']}"

    listed = local_job(engine, listing, tmp_path / "listed")
    failed = open_outputs(str(tmp_path / "listed")).failed
    assert listed.embedded == 1
    assert [(f["id"], f["reason"]) for f in failed] == [
        (f"{bucket}/photos/missing.jpg", "cannot read file: No such file or directory")]


ODD_KEYS = ["with space.jpg", "caf\u00e9/\u00f1.jpg", "a#b.jpg", "q?x=1.jpg", "50%.jpg",
            "plus+sign.jpg", "bracket[1].jpg", "star*.jpg", "colon:x.jpg", "emoji\U0001f600.png",
            "dots..jpg", "UPPER.JPG", "amp&eq=.jpg", "semi;curly{a}.jpg"]


def test_s3_keys_with_odd_characters_are_read_as_named(engine, s3, tmp_path):
    """Keys as people name their photos (spaces, accents, an emoji) and with the characters URLs
    and globs give meaning to (#, ?, %, +, [ ], *): each object is listed, read as itself and
    kept under its own name."""
    from serving import assert_same_rows
    from vit22b.server.infer import LocalInfer

    objects = {}
    for i, key in enumerate(ODD_KEYS):
        buffer = io.BytesIO()
        Image.fromarray(np.full((40, 50, 3), 15 * i, np.uint8)).save(
            buffer, "PNG" if key.endswith(".png") else "JPEG")
        objects[f"photos/{key}"] = buffer.getvalue()
    bucket = s3("oddkeys", objects)
    assert local_job(engine, f"{bucket}/photos", tmp_path / "out").embedded == len(ODD_KEYS)
    out = open_outputs(str(tmp_path / "out"))
    assert sorted(out.ids) == sorted(ODD_KEYS) and not out.failed
    assert out.paths == [f"{bucket}/photos/{key}" for key in out.ids]
    with LocalInfer(engine) as local:  # each row is its own object's features
        want = local.embed([objects[f"photos/{key}"] for key in out.ids]).features.pooled
    assert_same_rows(np.asarray(out["pooled"][:], np.float32), want)


def test_an_output_inside_a_remote_input_is_not_an_input():
    fs = fsspec.filesystem("memory")
    for path in ("below/a.jpg", "below/out/manifest.json", "below/out/shards/0.npy",
                 "below/outer.jpg"):
        fs.pipe(path, b"x")
    for output in ("memory://below/out", "memory://below/out/"):
        items = enumerate_inputs(["memory://below/"], output=output)
        assert [i.id for i in items] == ["a.jpg", "outer.jpg"]  # a name that only starts alike
    assert len(enumerate_inputs(["memory://below"])) == 4
    for output in ("memory://below", "memory://"):  # the inputs inside the output: refused
        with pytest.raises(InputListError, match="lies in the output folder"):
            enumerate_inputs(["memory://below/"], output=output)


def test_gcs_inputs_and_parquet_outputs(engine, data, npy, gcs):
    root, good, bad = data
    bucket = gcs("threads", {f"photos/{rel}": (root / rel).read_bytes() for rel in [*good, *bad]})
    _parquet_job_in_the_store(engine, bucket, npy, bad)


def test_local_file_urls(engine, data, npy, tmp_path):
    out = tmp_path / "out"
    local_job(engine, f"file://{data[0]}", f"file://{out}", SPEC, shard_size=3)
    assert read_dir(out) == read_dir(npy)  # the same bytes as plain paths
    assert not os.path.exists(tmp_path / "file:")


def test_outputs_that_cannot_hold_the_job_are_refused_before_the_model(tmp_path, monkeypatch,
                                                                      capsys):
    """``-o s3://`` wrote to a local folder named ``s3:`` and said so as a success;
    ``memory://`` outputs vanished with the process; an S3 output without credentials ended in
    botocore's traceback. Each now ends at once, in one line naming the cause."""
    from vit22b.clients.cli import main
    from vit22b.clients.storage import Location

    images = tmp_path / "images"
    write_images(images, 2)
    monkeypatch.chdir(tmp_path)
    for url in ("s3://", "s3:///", "file://"):
        with pytest.raises(ValueError, match="the URL names no bucket or folder"):
            Location(url)
    for url, words in (("s3://", "names no bucket or folder after s3://"),
                       ("memory://job", "memory:// lives in this process only")):
        assert main(["embed", str(images), "--output", url, "--quiet"]) == 2
        assert words in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images"]  # no "s3:" folder

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance to ask either
    s3 = fsspec.get_filesystem_class("s3")
    s3.clear_instance_cache()  # no filesystem made with another test's keys, and none left
    try:  # behind without keys for the tests after this one
        assert main(["embed", str(images), "--output", "s3://bucket/out", "--quiet"]) == 1
    finally:
        s3.clear_instance_cache()
    err = capsys.readouterr().err
    assert "remote storage: NoCredentialsError" in err and "AWS_ACCESS_KEY_ID" in err
    assert "Traceback" not in err


def _store(directory: str, inputs: str = "a") -> OutputStore:
    identity = {"format": "npy", "outputs": ["pooled"], "inputs": inputs}
    return OutputStore.open(directory, identity, {"pooled": {"dtype": "float32", "shape": [2]}},
                            num_shards=4)


def _write(store: OutputStore, index: int) -> None:
    store.write_shard(index, "x", [f"{index}.jpg"], [f"{index}.jpg"],
                      {"pooled": np.zeros((1, 2), np.float32)}, [])


def test_two_jobs_on_one_object_store_output_do_not_both_finish(monkeypatch):
    """An object store has no lock: two jobs started on one output both wrote every shard and
    both said complete, their files mixed. The one that finds another's writing stops."""
    import vit22b.clients.embed_store as embed_store

    monkeypatch.setattr(embed_store, "MANIFEST_SHARE", 0)  # a write per shard
    first = _store("memory://race/out")
    _write(first, 0)
    second = _store("memory://race/out")  # the same command started twice: it resumes...
    assert sorted(second.done) == [0]
    _write(second, 1)
    with pytest.raises(JobMismatch, match=r"another vit22b embed \(host .*, pid \d+\) has "
                                          r"written to memory://race/out since this job did"):
        _write(first, 1)  # ... and the first stops at its next record
    for index in (2, 3):
        _write(second, index)
    second.finish()
    manifest = read_manifest("memory://race/out")
    assert manifest["complete"] and "writer" not in manifest  # finished: it names no writer


def test_the_manifest_is_written_less_often_as_it_grows_and_whole_at_the_end(monkeypatch):
    """Rewritten after every shard, 2,000 shards wrote 4.8 GB of manifest to S3. Now at most a
    share of the time goes to it; what is recorded is written when the job ends, early too."""
    import vit22b.clients.embed_store as embed_store

    monkeypatch.setattr(embed_store, "MANIFEST_SHARE", 10**9)  # no write after the first
    store = _store("memory://often/out")
    for index in range(3):
        _write(store, index)
    written = read_manifest("memory://often/out")
    assert [s["index"] for s in written["shards"]] == [0] and written["writer"]
    store.close()  # a job ending early (an error) writes what it recorded
    assert [s["index"] for s in read_manifest("memory://often/out")["shards"]] == [0, 1, 2]
    resumed = _store("memory://often/out")
    assert sorted(resumed.done) == [0, 1, 2]
    _write(resumed, 3)
    resumed.finish()
    assert read_manifest("memory://often/out")["complete"]


def test_remote_listings_keep_keys_as_named_and_hidden_names_out_of_globs():
    """A key's '..' or '.' was tidied away (photos/d/../e.jpg became e.jpg, and collided with
    photos/e.jpg); a glob took hidden names a local glob leaves out; a list on a store took its
    local absolute lines as keys under its folder, and named one file twice in two spellings."""
    fs = fsspec.filesystem("memory")
    for key in ("d/../e.jpg", "e.jpg", "./dot.jpg", ".h.jpg", ".hd/x.jpg", "a.jpg"):
        fs.pipe(f"/keys/photos/{key}", b"x")
    items = enumerate_inputs(["memory://keys/photos"])
    assert [i.id for i in items] == ["./dot.jpg", "a.jpg", "d/../e.jpg", "e.jpg"]
    assert items[2].path == "memory:///keys/photos/d/../e.jpg"
    assert [i.id for i in enumerate_inputs(["memory://keys/photos/*.jpg"])] == [
        "memory:///keys/photos/a.jpg", "memory:///keys/photos/e.jpg"]
    assert [i.id for i in enumerate_inputs(["memory://keys/photos/.h*"])] == [
        "memory:///keys/photos/.h.jpg", "memory:///keys/photos/.hd/x.jpg"]  # named: taken
    fs.pipe("/keys/list.txt", b"photos/a.jpg\nmemory://keys/photos/a.jpg\n")
    assert [i.path for i in enumerate_inputs(["memory://keys/list.txt"])] == [
        "memory:///keys/photos/a.jpg"]
    fs.pipe("/keys/local.txt", b"/tmp/x.jpg\n")
    with pytest.raises(InputListError, match="the line '/tmp/x.jpg' names a local file"):
        enumerate_inputs(["memory://keys/local.txt"])
    with pytest.raises(InputListError, match="'memory://keys/nothing' does not exist"):
        enumerate_inputs(["memory://keys/nothing"])
    with pytest.raises(ValueError, match=r"an empty segment \('//'\)"):
        enumerate_inputs(["memory://keys//photos"])
    with pytest.raises(ValueError, match=r"memory://keys//out: an empty segment \('//'\)"):
        _store("memory://keys//out")


def test_an_unreachable_store_is_said_so_not_a_missing_input(monkeypatch, capsys):
    """gcsfs's isdir and isfile say False when the store cannot be reached: the input was
    "does not exist" (exit 2, after six tracebacks); the store's own error is said now."""
    from vit22b.clients.cli import main

    fs = fsspec.filesystem("memory")

    def unreachable(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)")

    monkeypatch.setattr(type(fs), "info", unreachable)
    assert main(["embed", "memory://far/photos", "-o", "/nonexistent/out", "-q"]) == 1
    err = capsys.readouterr().err
    assert "Connect call failed" in err and "does not exist" not in err


@pytest.fixture
def silent_endpoint(monkeypatch):
    """An S3 endpoint on loopback that accepts connections and never answers."""
    import socket
    import threading

    s3fs = pytest.importorskip("s3fs")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept())
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=accept, daemon=True).start()
    for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y"),
                        ("AWS_DEFAULT_REGION", "us-east-1"),
                        ("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{server.getsockname()[1]}")):
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # one made for another endpoint is reused else
    yield
    s3fs.S3FileSystem.clear_instance_cache()
    server.close()
    for conn, _ in held:
        conn.close()


def test_a_store_that_never_answers_is_a_read_failure_within_the_deadline(silent_endpoint,
                                                                          monkeypatch):
    """An endpoint that accepted and never answered stalled a job for over 10 minutes in the
    storage libraries' retries: a read now has a deadline, and missing it is that file's
    failure ('cannot read file', which a rerun retries)."""
    import time

    import vit22b.clients.storage as storage
    from vit22b.clients.embed import embed_files
    from vit22b.clients.embed_inputs import InputItem

    monkeypatch.setattr(storage, "STORE_TIMEOUT_S", 2)
    start = time.perf_counter()
    result = embed_files(None, [InputItem("k.jpg", "s3://bucket/k.jpg")])
    assert time.perf_counter() - start < 10
    assert result.failed == [(0, "cannot read file: no answer within 2 s from the store")]


@pytest.mark.parametrize("where", ["input", "output"])
def test_a_store_that_never_answers_ends_the_job_within_the_deadline(silent_endpoint,
                                                                      monkeypatch, capsys,
                                                                      tmp_path, where):
    """The listing of an input and the making of an output on such an endpoint ran on for over
    five minutes with nothing said: every call to the store has the deadline now, and missing
    it is the store's failure (exit 1, naming the URL), not a bad output."""
    import time

    import vit22b.clients.storage as storage
    from vit22b.clients.cli import main

    monkeypatch.setattr(storage, "STORE_TIMEOUT_S", 2)
    write_images(tmp_path / "photos", 2)
    data, out = (("s3://bucket/photos", str(tmp_path / "out")) if where == "input"
                 else (str(tmp_path / "photos"), "s3://bucket/out"))
    start = time.perf_counter()
    code = main(["embed", data, "-o", out, "--server", "127.0.0.1:1", "-q"])
    assert time.perf_counter() - start < 15
    err = capsys.readouterr().err
    assert code == 1, err
    assert "no answer within 2 s from the store" in err and "s3://bucket/" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_small_files_go_to_a_store_in_one_call_within_the_deadline(silent_endpoint, monkeypatch):
    """The manifest and errors.jsonl are written by one call on the store's loop, which the
    deadline bounds (a streamed write waits on the library's own timeouts)."""
    import time

    import vit22b.clients.storage as storage

    monkeypatch.setattr(storage, "STORE_TIMEOUT_S", 2)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="no answer within 2 s") as caught:
        storage.Location("s3://bucket/out").write_bytes("manifest.json", b"{}")
    assert time.perf_counter() - start < 10
    assert caught.value.filename == "s3://bucket/out/manifest.json"


def test_a_remote_file_read_in_ranges_gives_the_objects_bytes(s3, monkeypatch):
    """A video's reads and an output's arrays on a store go through ``open_read``: blocks
    fetched by range, each call within the deadline; seeks anywhere give the object's bytes."""
    pytest.importorskip("s3fs")
    import vit22b.clients.storage as storage

    monkeypatch.setattr(storage, "READ_BLOCK", 1000)  # several blocks, and reads across them
    real_run = storage.Deadlined.run
    blob = np.random.default_rng(3).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    bucket = s3("ranges", {"blob.bin": blob, "empty.bin": b""})
    fs, inner = storage.filesystem(f"{bucket}/blob.bin")
    with fs.open_read(inner) as f:
        assert f.read(10) == blob[:10]
        assert f.seek(-25, os.SEEK_END) == 9_975 and f.read() == blob[-25:]
        for start, size in ((2_990, 20), (0, 10_000), (9_999, 5), (500, 2_600), (10_000, 1)):
            f.seek(start)
            assert f.read(size) == blob[start:start + size], (start, size)
            assert f.tell() == min(start + size, len(blob))
    requests = []

    def counted(self, coroutine, *args, **kwargs):  # the bytes each ranged request asks for
        if "end" in kwargs:
            requests.append(kwargs["end"] - kwargs["start"])
        return real_run(self, coroutine, *args, **kwargs)

    monkeypatch.setattr(storage.Deadlined, "run", counted)
    with fs.open_read(inner) as f:  # one large read: many requests of a block at most
        assert f.read(9_500) == blob[:9_500]
    assert max(requests) <= 1000 and sum(requests) >= 9_500, requests
    fs, inner = storage.filesystem(f"{bucket}/empty.bin")
    with fs.open_read(inner) as f:
        assert f.read() == b""


def test_a_remote_file_opened_on_a_store_that_never_answers_fails_within_the_deadline(
        silent_endpoint, monkeypatch):
    """A video on such an endpoint waited on the storage library's retries (fs.open asks the
    object's size first): the video's failure within the deadline now."""
    import time

    import vit22b.clients.storage as storage

    monkeypatch.setattr(storage, "STORE_TIMEOUT_S", 2)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="no answer within 2 s"):
        storage.Location("s3://bucket/videos").open("clip.mp4")
    assert time.perf_counter() - start < 10


def test_a_deadlined_filesystem_pickles_and_copies(s3):
    """Ray ships what a task holds by pickling it: the wrapper recursed through its own
    attribute lookup when unpickled or copied."""
    import copy
    import pickle

    from vit22b.clients.storage import filesystem

    pytest.importorskip("s3fs")
    bucket = s3("pickled", {"a.bin": b"abc"})
    fs, inner = filesystem(f"{bucket}/a.bin")
    for twin in (pickle.loads(pickle.dumps(fs)), copy.copy(fs)):
        assert twin.asynchronous and twin.cat_file(inner) == b"abc"
    memory, path = filesystem("memory://pickled/b.bin")
    memory.pipe_file(path, b"def")
    assert pickle.loads(pickle.dumps(memory)).cat_file(path) == b"def"


def test_a_write_the_store_refuses_names_the_object(tmp_path, capsys):
    """An outside tester's read-only bucket: s3fs's PermissionError names no object, and the
    job said "vit22b embed: Access Denied" alone. Each write and removal of an output names its
    object now. The store here refuses every write as a read-only bucket does (its own
    protocol: the failure is the store's, the naming is what is tested)."""
    from fsspec.implementations.memory import MemoryFileSystem
    from vit22b.clients.cli import main
    from vit22b.clients.storage import Location

    class ReadOnly(MemoryFileSystem):
        protocol = "readonly"
        store: dict = {}  # its own: MemoryFileSystem's is shared
        pseudo_dirs = [""]

        def _open(self, path, mode="rb", **kwargs):
            if "r" not in mode:
                raise PermissionError("Access Denied")
            return super()._open(path, mode, **kwargs)

        def pipe_file(self, path, value, **kwargs):
            raise PermissionError("Access Denied")

        def rm_file(self, path):
            raise PermissionError("Access Denied")

    fsspec.register_implementation("readonly", ReadOnly, clobber=True)
    where = Location("readonly://bucket/emb")
    for rel, action in (("manifest.json", lambda: where.write_bytes("manifest.json", b"{}")),
                        ("shards/0.npy", lambda: where.write("shards/0.npy", print)),
                        ("x", lambda: where.remove("x"))):
        with pytest.raises(PermissionError) as refused:
            action()
        assert refused.value.filename == f"readonly://bucket/emb/{rel}"
        assert refused.value.strerror == "Permission denied"
    folder = tmp_path / "in"
    write_images(folder, 2)
    capsys.readouterr()
    assert main(["embed", str(folder), "-o", "readonly://bucket/emb", "--mesh", "data=2",
                 "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vit22b embed: readonly://bucket/emb/"), err
    assert ": Permission denied; completed shards are kept" in err
