"""`vit22b embed` in process: inputs, shards, manifest, resume, refusals, errors, the loader.

The job runs through the real in-process engine (tiny model) on real image files written with
PIL; the remote backend, SIGKILL-and-resume and server failover are in test_embed_remote.py.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from PIL import Image
from serving import in_process, png
from vit22b.clients.embed import (
    JobConfig,
    OutputSpec,
    accepted_now,
    allowed_now,
    readable_now,
    run_job,
)
from vit22b.clients.embed_inputs import InputListError, enumerate_inputs
from vit22b.clients.embed_store import JobMismatch, OutputStore, atomic_write
from vit22b.clients.outputs import OutputsError, open_outputs, read_manifest


def write_images(root, count: int, seed: int = 0) -> list[str]:
    """JPEG and PNG files of varied sizes in nested folders; returns their ids (relative paths)."""
    rng = np.random.default_rng(seed)
    ids = []
    for i in range(count):
        rel = f"class{i % 3}/" + ("deep/" if i % 4 == 3 else "") + f"img{i:03d}"
        rel += ".png" if i % 2 else ".jpg"
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pixels = rng.integers(0, 256, (48 + 7 * (i % 5), 64 + 5 * (i % 3), 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
        ids.append(rel)
    return sorted(ids)


def write_bad_files(root) -> dict[str, str]:
    """A truncated JPEG, a text file, an empty file; id -> a word its reason must contain."""
    good = os.path.join(root, "class0", "img000.jpg")
    with open(good, "rb") as f:
        head = f.read(200)
    bad = {"class1/truncated.jpg": head, "notes.txt": b"not an image\n",
           "class2/deep/empty.png": b""}
    for rel, data in bad.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    return {"class1/truncated.jpg": "Truncated", "notes.txt": "not an image file of a known format",
            "class2/deep/empty.png": "empty"}


# ---- inputs ------------------------------------------------------------------------------


def test_folder_glob_and_list_inputs(tmp_path, monkeypatch):
    data = tmp_path / "data"
    ids = write_images(data, 9)
    (data / ".hidden.jpg").write_bytes(b"x")
    (data / ".cache").mkdir()
    (data / ".cache" / "x.jpg").write_bytes(b"x")
    os.symlink(data, data / "class0" / "loop")  # a cycle: walked once, not forever
    items = enumerate_inputs([str(data)])
    assert [i.id for i in items] == ids  # recursive, sorted, hidden skipped, ids relative
    assert all(os.path.isabs(i.path) and os.path.exists(i.path) for i in items)
    os.remove(data / "class0" / "loop")

    globbed = enumerate_inputs([str(data / "**" / "*.png")])  # ids: the matches as written
    assert [i.id for i in globbed] == [f"{data}/{i}" for i in ids if i.endswith(".png")]

    listing = tmp_path / "lists" / "some.txt"
    listing.parent.mkdir()
    listing.write_text(f"# a comment\n../data/{ids[2]}\n\n../data/{ids[0]}\n../data/{ids[2]}\n")
    listed = enumerate_inputs([str(listing)])
    assert [i.id for i in listed] == sorted([f"../data/{ids[0]}", f"../data/{ids[2]}"])
    assert listed[0].path == str(data / ids[0])  # relative to the list file's folder
    windows = tmp_path / "lists" / "notepad.txt"  # a byte-order mark first, CRLF line ends
    windows.write_bytes(f"\ufeff../data/{ids[0]}\r\n../data/{ids[2]}\r\n".encode())
    assert [i.id for i in enumerate_inputs([str(windows)])] == [i.id for i in listed]

    # several inputs: folder ids carry the folder argument so they cannot collide; duplicates
    # of the same file collapse to one
    both = enumerate_inputs([str(data), str(data / ids[1])])
    assert [i.id for i in both] == [f"{data}/{i}" for i in ids]
    # one file spelled otherwise by another INPUT (a relative folder, an absolute one, a link
    # to it, a list of its files) was embedded once per spelling; now once
    os.symlink(data, tmp_path / "data-link")
    monkeypatch.chdir(tmp_path)
    spellings = ["data", str(data), "data-link", str(listing), f"data/{ids[3]}"]
    once = enumerate_inputs(spellings)
    assert sorted(os.path.realpath(i.path) for i in once) == sorted(str(data / i) for i in ids)
    assert [i.id for i in once] == [f"data/{i}" for i in ids]  # no link, the shortest

    assert [i.id for i in enumerate_inputs([str(data)], extensions=("PNG",))] == [
        i for i in ids if i.endswith(".png")]


def test_a_recursive_glob_walks_each_folder_once(tmp_path, monkeypatch):
    """Python's glob follows links to folders: with a link back up the tree, `**` listed one
    file once per lap (an outside tester's one-loop tree: 41 rows for one file; with more
    loops the listing ran on). Each folder is walked once now, as for a folder INPUT, and the
    matches are glob's on a tree without links (same ids)."""
    ids = write_images(tmp_path / "data", 9)
    monkeypatch.chdir(tmp_path)
    plain = {spec: [i.id for i in enumerate_inputs([spec])]
             for spec in ("data/**/*.png", "data/**", "data/*/**/*.jpg", "**/*.png")}
    assert plain["data/**/*.png"] == [f"data/{i}" for i in ids if i.endswith(".png")]
    for loop in ("data/class0/up", "data/class0/deep/up"):
        os.symlink(tmp_path / "data", loop)
    for spec, want in plain.items():
        assert [i.id for i in enumerate_inputs([spec])] == want, spec


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(InputListError, match="does not exist"):
        enumerate_inputs([str(tmp_path / "nope")])
    with pytest.raises(InputListError, match="matches nothing"):
        enumerate_inputs([str(tmp_path / "*.jpg")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputListError, match="no files found"):
        enumerate_inputs([str(tmp_path / "empty")])


def test_a_folder_that_cannot_be_listed_ends_the_listing_naming_it(tmp_path):
    """os.walk skips a folder it cannot list without a word: its images were left out of the
    job. A folder deeper than PATH_MAX cannot be listed by its path, by root either (a folder
    without read permission is the everyday case, for users other than root)."""
    (tmp_path / "top.png").write_bytes(png(np.zeros((8, 8, 3), np.uint8)))
    fd = os.open(tmp_path, os.O_RDONLY)
    for _ in range(25):  # 25 x 201 characters: past Linux's 4096
        os.mkdir("d" * 200, dir_fd=fd)
        deeper = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(os.open("deep.png", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    os.close(fd)
    with pytest.raises(InputListError, match=r"cannot list the folder '.*\(\d+ characters\) "
                       r"below an input: File name too long \(its images would be left out\)"):
        enumerate_inputs([str(tmp_path)])
    if os.geteuid() != 0:  # root lists any folder
        locked = tmp_path / "perm" / "locked"
        locked.mkdir(parents=True)
        locked.chmod(0)
        try:
            with pytest.raises(InputListError, match="Permission denied"):
                enumerate_inputs([str(locked.parent)])
        finally:
            locked.chmod(0o755)


def test_work_queue_window_and_put_back():
    import threading

    from vit22b.clients.embed import _Queue

    q = _Queue([(k, b, None) for k in range(4) for b in range(2)], [0, 1, 2, 3], window=2)
    taken = [q.take() for _ in range(4)]  # shards 0 and 1 only: the window
    assert [t[:2] for t in taken] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    later = []
    waiter = threading.Thread(target=lambda: later.append(q.take()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # shard 2 waits until shard 0 is written
    q.put_back(taken[1])  # a lost worker's batch: first in line again
    waiter.join(5)
    assert later[0][:2] == (0, 1)
    for _ in range(4):
        q.done()
    q.written(0)
    assert q.take()[:2] == (2, 0)


# ---- store -------------------------------------------------------------------------------


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = str(tmp_path / "f.bin")
    atomic_write(path, lambda f: f.write(b"old"))

    def boom(f):
        f.write(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(path, boom)
    assert open(path, "rb").read() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]  # no temp file left behind


def test_store_refuses_other_settings_and_a_second_writer(tmp_path):
    identity = {"model": "m", "dtype": "float32", "shard_size": 4}
    arrays = {"pooled": {"dtype": "float32", "shape": [2]}}
    store = OutputStore.open(str(tmp_path), identity, arrays, 1)
    with pytest.raises(JobMismatch, match="lock is held"):
        OutputStore.open(str(tmp_path), identity, arrays, 1)
    store.close()
    with pytest.raises(JobMismatch, match=r"dtype: 'float32' in the manifest, 'float16' now"):
        OutputStore.open(str(tmp_path), {**identity, "dtype": "float16"}, arrays, 1)
    OutputStore.open(str(tmp_path), identity, arrays, 1).close()  # same settings: fine


# ---- the job through the in-process engine ------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from vit22b.server.engine import Engine

    return Engine.load("vit-22b-tiny/16", mesh="data=8", max_batch_images=8)


def local_job(engine, data, out, spec: OutputSpec | None = None, **kw):
    from vit22b.clients.embed_local import LocalBackend

    spec = spec or OutputSpec()
    backend = LocalBackend(spec, engine=engine, concurrency=kw.pop("concurrency", 2),
                           max_image_pixels=kw.pop("max_image_pixels", 0))
    inputs = [str(d) for d in data] if isinstance(data, list) else [str(data)]
    config = JobConfig(inputs, str(out), spec, quiet=True,
                       **{"batch_size": 4, "shard_size": 6, **kw})
    return run_job(config, backend)


def read_dir(out) -> dict[str, bytes]:
    files = {}
    for root, _, names in os.walk(out):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, out)] = open(path, "rb").read()
    return files


def test_folder_with_bad_files(engine, tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    good = write_images(data, 14)
    bad = write_bad_files(data)
    summary = local_job(engine, data, out)
    assert (summary.embedded, summary.failed, summary.skipped) == (14, 3, 0)
    assert summary.complete

    result = open_outputs(str(out), verify=True)
    assert result.ids == good  # every good image once, in input order
    assert result["pooled"].shape == (14, 64)
    errors = [json.loads(line) for line in open(out / "errors.jsonl")]
    assert sorted(e["id"] for e in errors) == sorted(bad)
    for e in errors:
        assert bad[e["id"]] in e["reason"], e
        assert e["path"] == str(data / e["id"])

    # the features are the engine's own for those files
    reference = in_process(engine, [open(data / i, "rb").read() for i in good])["pooled"]
    np.testing.assert_allclose(np.asarray(result["pooled"]), reference, rtol=1e-5, atol=1e-5)

    manifest = read_manifest(str(out))
    assert manifest["identity"]["model"] == "vit-22b-tiny/16"
    assert manifest["identity"]["checkpoint_fingerprint"] == engine.identity.fingerprint
    assert manifest["identity"]["preprocess_hash"] == engine.identity.preprocess_hash
    assert sum(s["count"] for s in manifest["shards"]) == 14
    assert sum(s["failed"] for s in manifest["shards"]) == 3

    # numpy alone, as the README shows
    rows = []
    for shard in manifest["shards"]:
        rows.append(np.load(out / shard["files"]["pooled"]["file"], mmap_mode="r"))
    np.testing.assert_array_equal(np.concatenate(rows), np.asarray(result["pooled"]))


@pytest.mark.parametrize("fmt", ["npy", "parquet", "safetensors"])
def test_file_names_that_are_not_utf8_get_text_ids_in_every_format(engine, tmp_path, fmt):
    data, out = tmp_path / "data", tmp_path / "out"
    write_images(data, 2)
    picture = (data / "class0" / "img000.jpg").read_bytes()
    raw = os.fsencode(str(data))
    with open(raw + b"/bad\xffname.jpg", "wb") as f:  # a Latin-1 name: not UTF-8
        f.write(picture)
    with open(raw + b"/caf\xe9 junk.jpg", "wb") as f:
        f.write(b"junk")
    (tmp_path / "list.txt").write_bytes(b"data/bad\xffname.jpg\n")  # a Latin-1 list
    listed = enumerate_inputs([str(tmp_path / "list.txt")])
    assert [(i.id, os.path.exists(i.path)) for i in listed] == [("data/bad\\xffname.jpg", True)]

    summary = local_job(engine, data, out, format=fmt)
    assert (summary.embedded, summary.failed) == (3, 1)
    result = open_outputs(str(out), verify=True)
    assert result.ids == ["bad\\xffname.jpg", "class0/img000.jpg", "class1/img001.png"]
    pooled = np.asarray(result["pooled"])
    np.testing.assert_array_equal(pooled[0], pooled[1])  # the same picture under two names
    (error,) = [json.loads(line) for line in open(out / "errors.jsonl", encoding="utf-8")]
    assert error["id"] == "caf\\xe9 junk.jpg" and error["path"] == f"{data}/caf\\xe9 junk.jpg"
    for name, blob in read_dir(out).items():  # every file the job wrote holds text, not bytes
        if name.endswith(".json") or name.endswith(".jsonl"):
            blob.decode("utf-8")
            assert "\\udc" not in blob.decode("utf-8"), name


def test_what_is_not_a_regular_file_or_is_too_large_fails_unread(engine, tmp_path,
                                                                 monkeypatch):
    """A FIFO would block the job for ever, /dev/zero never end, a video among the photos
    take its size in memory: each is that input's failure, read no further."""
    import vit22b.clients.embed as embed_module

    data, out = tmp_path / "data", tmp_path / "out"
    good = write_images(data, 3)
    os.mkfifo(data / "pipe.jpg")  # no writer: opening it to read would wait for one
    os.symlink("/dev/zero", data / "zero.jpg")
    limit = max(os.path.getsize(data / rel) for rel in good)
    with open(data / "big.jpg", "wb") as f:
        f.truncate(limit + 1)  # sparse: a byte over the limit set below
    monkeypatch.setattr(embed_module, "MAX_IMAGE_BYTES", limit)
    summary = local_job(engine, data, out)
    assert (summary.embedded, summary.failed) == (3, 3) and summary.complete
    assert open_outputs(str(out), verify=True).ids == good
    reasons = {e["id"]: e["reason"] for e in map(json.loads, open(out / "errors.jsonl"))}
    assert reasons == {
        "pipe.jpg": "cannot read file: not a regular file: a FIFO",
        "zero.jpg": "cannot read file: not a regular file: a character device",
        "big.jpg": f"cannot read file: {limit + 1} bytes, over the limit of {limit} bytes per file",
    }


def test_a_list_line_with_a_nul_byte_is_that_inputs_failure(engine, tmp_path):
    """A list file's line with a NUL byte ended the whole job ("local-0 failed: ValueError:
    embedded null byte"): os.open refuses such a path with a ValueError, not an OSError."""
    good = write_images(tmp_path / "data", 2)
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join([f"data/{good[0]}", f"data/{good[1]}\x00junk", f"data/{good[1]}"]))
    summary = local_job(engine, [listing], tmp_path / "out")
    assert (summary.embedded, summary.failed) == (2, 1) and summary.complete
    (error,) = [json.loads(line) for line in open(tmp_path / "out" / "errors.jsonl")]
    assert error["id"] == f"data/{good[1]}\x00junk"
    assert error["reason"] == "cannot read file: a path with a NUL byte names no file"


def test_resume_skips_done_shards_and_matches_a_full_run(engine, tmp_path):
    data = tmp_path / "data"
    write_images(data, 20)
    write_bad_files(data)
    full = local_job(engine, data, tmp_path / "full")
    assert full.complete and full.embedded == 20

    # a run that lost shards 1 and 3 (e.g. killed before the manifest named them)
    partial = tmp_path / "partial"
    local_job(engine, data, partial)
    manifest = read_manifest(str(partial))
    manifest["shards"] = [s for s in manifest["shards"] if s["index"] not in (1, 3)]
    manifest["complete"] = False
    (partial / "manifest.json").write_text(json.dumps(manifest))
    (partial / "shards" / "00001.pooled.npy").write_bytes(b"torn")  # stale, unlisted file
    (partial / "shards" / "00003.pooled.npy.tmp-1-2").write_bytes(b"temp")  # from a kill

    resumed = local_job(engine, data, partial)
    assert resumed.complete
    assert resumed.skipped == 12  # shards 0 and 2; shards 1 and 3 hold the other 11 inputs
    assert resumed.embedded + resumed.failed == 11
    assert read_dir(partial) == read_dir(tmp_path / "full")  # bit for bit, manifest included


def test_an_output_folder_inside_the_input_folder_is_not_an_input(engine, tmp_path):
    """``vit22b embed photos -o photos/embeddings``: the job's own files are no inputs, so the
    rerun resumes (it found "the input list changed" when they were) and a job that names the
    folder through another spelling of the path does too."""
    data = tmp_path / "data"
    ids = write_images(data, 5)
    first = local_job(engine, data, data / "embeddings")
    assert first.complete and first.embedded == 5 and first.failed == 0
    again = local_job(engine, data, data / "embeddings")
    assert again.complete and again.skipped == 5 and again.embedded == again.failed == 0
    assert open_outputs(str(data / "embeddings")).ids == ids
    spelled = local_job(engine, f"{data}/", f"{data}/class0/../embeddings")
    assert spelled.skipped == 5
    # the input reached through a link, the output named in the real folder: its files were
    # read as inputs "link/emb2/..." by the rerun, which then refused the changed list
    linked = tmp_path / "linked"
    write_images(linked, 5)
    os.symlink(linked, tmp_path / "link")
    assert local_job(engine, tmp_path / "link", linked / "emb").embedded == 5
    assert local_job(engine, tmp_path / "link", linked / "emb").skipped == 5
    for output in (data, tmp_path):  # the inputs in the output folder: refused, nothing read
        with pytest.raises(InputListError, match="lies in the output folder"):
            local_job(engine, data, output)
    other = tmp_path / "other"  # with a second input (naming one image again): the same rule
    write_images(other, 5)
    listed = tmp_path / "list.txt"
    listed.write_text(f"{other}/{ids[0]}\n")
    mixed = local_job(engine, [other, listed], other / "out")
    assert mixed.embedded == 5 and local_job(engine, [other, listed], other / "out").skipped == 5


def test_resume_refuses_other_options(engine, tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    write_images(data, 5)
    local_job(engine, data, out)
    # another folder of the same names: the ids are relative to the folder, so they are the
    # same; a resume from it mixed the two folders' images under one list, and said complete
    other = tmp_path / "other"
    write_images(other, 5, seed=1)
    with pytest.raises(JobMismatch, match="read from another folder"):
        local_job(engine, other, out)
    with pytest.raises(JobMismatch, match="outputs") as err:
        local_job(engine, data, out, OutputSpec(pooled=True, patch_layers=(-1,)))
    assert "choose another --output" in str(err.value)
    with pytest.raises(JobMismatch, match="inputs"):
        write_images(data / "more", 1)
        local_job(engine, data, out)


def test_a_job_begun_before_the_inputs_recorded_their_places_resumes(engine, tmp_path, caplog):
    """A manifest of an earlier version holds the inputs' names and count, not where they are
    read from (``places_sha256``): its job was refused after an upgrade as "the input list
    changed". Taken to be these places when the names match (said), refused when they do not."""
    data, out = tmp_path / "data", tmp_path / "out"
    write_images(data, 9)
    local_job(engine, data, out, shard_size=4)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["shards"] = [s for s in manifest["shards"] if s["index"] != 2]  # as if killed
    manifest["complete"] = False
    places = manifest["identity"]["inputs"].pop("places_sha256")
    manifest_path.write_text(json.dumps(manifest))  # as the earlier version wrote it
    with caplog.at_level("WARNING", logger="vit22b.clients.embed_store"):
        summary = local_job(engine, data, out, shard_size=4)
    assert (summary.embedded, summary.skipped, summary.complete) == (1, 8, True)
    assert "does not record where its inputs were read from" in caplog.text
    assert json.loads(manifest_path.read_text())["identity"]["inputs"]["places_sha256"] == places
    manifest = json.loads(manifest_path.read_text())
    manifest["identity"]["inputs"].pop("places_sha256")
    manifest_path.write_text(json.dumps(manifest))
    write_images(data / "more", 1)  # other names: still another list
    with pytest.raises(JobMismatch, match="the input list changed"):
        local_job(engine, data, out, shard_size=4)


def test_a_rerun_retries_files_that_could_not_be_read_and_can_be_now(engine, tmp_path):
    """A file the job could not read (its folder unmounted mid-run, a link fixed later) was a
    failure for good: the complete job's rerun skipped its shard. A rerun now recomputes the
    shards in which such a file can be read; a file that cannot be decoded stays a failure."""
    data, out = tmp_path / "data", tmp_path / "out"
    ids = write_images(data, 8)
    (data / "notes.txt").write_bytes(b"not an image")
    listing = tmp_path / "all.txt"
    listing.write_text("".join(f"data/{i}\n" for i in ids) + "data/late.png\ndata/notes.txt\n")
    first = local_job(engine, listing, out, shard_size=4)
    assert first.complete and first.embedded == 8
    failed = {f["id"]: f["reason"] for f in open_outputs(str(out)).failed}
    assert failed == {"data/late.png": "cannot read file: No such file or directory",
                      "data/notes.txt": failed["data/notes.txt"]}
    assert local_job(engine, listing, out, shard_size=4).skipped == 10  # nothing to retry
    shutil.copy(data / ids[1], data / "late.png")  # readable now
    again = local_job(engine, listing, out, shard_size=4)
    assert again.complete and again.embedded == 1 and again.skipped == 8  # its shard alone
    result = open_outputs(str(out), verify=True)
    assert [f["id"] for f in result.failed] == ["data/notes.txt"]
    assert "data/late.png" in result.ids and len(result.ids) == 9
    errors = (out / "errors.jsonl").read_text().splitlines()
    assert [json.loads(row)["id"] for row in errors] == ["data/notes.txt"]


def test_a_rerun_under_a_larger_pixel_limit_takes_the_images_it_refused(engine, tmp_path):
    """An image refused as over --max-image-pixels stayed a failure for good: a user who raised
    the limit for their phone photos and reran got every shard skipped. A rerun now recomputes
    the shards of the images the new limit takes and ends as a job run at that limit from the
    start; a shard whose refused image is still over it stays done."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    sizes = {"a_big.png": 40, **{f"small{i}.png": 8 for i in range(5)}, "z_mid.png": 20}
    for name, side in sizes.items():
        Image.new("RGB", (side, side), (side, 20, 30)).save(data / name)

    def job(limit: int, to=out):  # shards: [a_big small0 small1] [small2-4] [z_mid]
        return local_job(engine, data, to, shard_size=3, max_image_pixels=limit)

    first = job(100)
    assert (first.embedded, first.failed) == (5, 2)
    reasons = {f["id"]: f["reason"] for f in open_outputs(str(out)).failed}
    assert "40x40 = 1600 pixels, over the limit of 100 " in reasons["a_big.png"]
    assert "20x20 = 400 pixels, over the limit of 100 " in reasons["z_mid.png"]
    for limit in (100, 50):  # the same limit, or a smaller one: nothing to take
        assert job(limit).skipped == 7
    again = job(1000)  # takes z_mid; a_big's 1600 pixels are still over
    assert (again.embedded, again.failed, again.skipped) == (1, 0, 6)
    assert [f["id"] for f in open_outputs(str(out), verify=True).failed] == ["a_big.png"]
    assert job(1000).skipped == 7
    last = job(2000)
    assert (last.embedded, last.skipped, last.complete) == (3, 4, True)
    fresh = job(2000, tmp_path / "fresh")
    assert fresh.embedded == 7 and read_dir(out) == read_dir(tmp_path / "fresh")


def test_which_refusals_a_larger_pixel_limit_takes():
    header = "JPEG declares a frame or tile of 5000 pixels, over the limit of 4000 (--max-image-"
    assert allowed_now({"reason": header + "pixels of the server or the local job; a ..."}, 5000)
    assert not allowed_now({"reason": header + "pixels ..."}, 4999)  # still over
    vague = "PNG declares a frame or tile of more pixels than allowed, over the limit of 10 ("
    assert allowed_now({"reason": vague + "--max-image-pixels ..."}, 11)  # size unknown: try
    assert not allowed_now({"reason": vague + "--max-image-pixels ..."}, 10)
    assert not allowed_now({"reason": header + "pixels ..."}, None)  # the bound is not known
    assert not allowed_now({"reason": "PNG file, but truncated"}, 10**9)


def test_a_rerun_takes_the_files_of_a_format_accepted_since(engine, tmp_path, monkeypatch):
    """A job run where HEIC was refused (before 2026-12-06, or without its decoder installed)
    listed a folder's phone photos as failures for good: the rerun after the upgrade skipped
    every shard. A rerun now recomputes the shards of files refused for their format whose bytes
    are of a format accepted now, and ends as a job run with HEIC from the start; a file of a
    format still refused stays listed."""
    from test_pixels import heic
    from vit22b.model import pixels as contract

    data, out = tmp_path / "data", tmp_path / "out"
    ids = write_images(data, 4)
    (data / "phone.heic").write_bytes(heic(Image.new("RGB", (40, 30), (200, 40, 10))))
    Image.new("RGB", (8, 8)).save(data / "scan.pcx", "PCX")
    with monkeypatch.context() as patch:  # the decoder missing: refused for its format
        patch.setattr(contract, "_heif_reader", lambda: False)
        first = local_job(engine, data, out, shard_size=3)
    reasons = {f["id"]: f["reason"] for f in open_outputs(str(out)).failed}
    assert "its decoder is not installed" in reasons["phone.heic"]
    assert "not an accepted format" in reasons["scan.pcx"] and first.embedded == len(ids)
    errors = out / "errors.jsonl"  # as a version that refused HEIC by name wrote it
    errors.write_text(errors.read_text().replace(
        reasons["phone.heic"].replace("\n", "\\n"),
        "HEIF/HEIC (a phone's photo format) file (by its signature), not an accepted format: "
        "send JPEG, PNG, WebP, AVIF, BMP, GIF or TIFF"))
    again = local_job(engine, data, out, shard_size=3)
    assert (again.embedded, again.failed) == (2, 1)  # phone.heic's shard: an image, it, the PCX
    assert [f["id"] for f in open_outputs(str(out), verify=True).failed] == ["scan.pcx"]
    assert local_job(engine, data, out, shard_size=3).skipped == 6  # the PCX stays refused
    assert local_job(engine, data, tmp_path / "fresh", shard_size=3).embedded == 5
    assert read_dir(out) == read_dir(tmp_path / "fresh")


def test_which_format_refusals_a_rerun_takes(tmp_path):
    """The reasons this version and the earlier ones wrote for a file's format; only those a
    format accepted now may answer lead to a read of the file's head."""
    from test_pixels import heic

    heic_file, text = tmp_path / "a.heic", tmp_path / "b.txt"
    heic_file.write_bytes(heic(Image.new("RGB", (8, 8))))
    text.write_bytes(b"plain text")
    for reason in ("HEIC image, but its decoder is not installed (pillow-heif, ...)",
                   "HEIF/HEIC (a phone's photo format) file (by its signature), not an "
                   "accepted format: send ...",
                   "AVIF (AVIF image) file (by its signature), not an accepted format: send ...",
                   "not an image file of a known format: no JPEG, PNG, WebP, BMP, GIF or TIFF "
                   "signature (2591 bytes starting b'\\x00\\x00\\x00\\x1cftyp')"):
        assert accepted_now({"reason": reason, "path": str(heic_file)}), reason
        assert not accepted_now({"reason": reason, "path": str(text)})  # still no format
        assert not accepted_now({"reason": reason, "path": str(tmp_path / "gone.heic")})
    for reason in ("cannot decode HEIC image: ...",  # its content, not its format
                   "PCX (Paintbrush) file (by its signature), not an accepted format: send ...",
                   "not an image file of a known format: no JPEG, PNG, WebP, BMP, GIF or TIFF "
                   "signature (10 bytes starting b'plain te')"):  # not worth a read
        assert not accepted_now({"reason": reason, "path": str(heic_file)}), reason


def test_whether_a_failed_file_is_readable_now_reads_a_byte_within_the_limit(tmp_path):
    """The check read the whole file within the image limit: a video over 1 GiB (a job's
    limit is none for videos, read in pieces) never counted as readable."""
    big = tmp_path / "big.mp4"
    with open(big, "wb") as f:
        f.truncate((1 << 30) + 1)  # sparse: nothing is written
    failure = {"reason": "cannot read file: No such file or directory", "path": str(big)}
    assert readable_now(failure, None)
    assert not readable_now(failure)  # an image of that size is still over the limit
    assert not readable_now({**failure, "path": str(tmp_path / "gone.mp4")}, None)
    assert not readable_now({**failure, "reason": "cannot decode: truncated"}, None)


def test_patch_tokens_bfloat16_and_loader(engine, tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    ids = write_images(data, 7)
    spec = OutputSpec(pooled=True, patch_layers=(-1, 1), dtype="bfloat16", l2_normalize=True)
    summary = local_job(engine, data, out, spec, shard_size=3)
    assert summary.complete and summary.embedded == 7
    result = open_outputs(str(out))
    assert result.names == ["pooled", "patch_tokens.1", "patch_tokens.3"]
    assert result["patch_tokens.3"].shape == (7, 16, 64)
    assert result.ids == ids and len(result.shards) == 3
    raw = np.load(out / "shards" / "00000.pooled.npy")
    # .npy has no bfloat16: stored as float32, never as integers a generic reader would misread;
    # the widening is exact, so every value is a bfloat16 value
    assert raw.dtype == np.float32
    np.testing.assert_array_equal(raw.astype(ml_dtypes.bfloat16).astype(np.float32), raw)
    assert result.manifest["arrays"]["pooled"]["dtype"] == "bfloat16"
    pooled = np.asarray(result["pooled"])
    assert pooled.dtype == np.float32
    np.testing.assert_array_equal(pooled[:3], raw)
    np.testing.assert_allclose(np.linalg.norm(pooled, axis=1), 1.0, atol=1e-2)
    tokens = result["patch_tokens.1"]
    np.testing.assert_array_equal(tokens[4], np.asarray(tokens)[4])
    np.testing.assert_array_equal(result["pooled"][[6, 0]], pooled[[6, 0]])
    np.testing.assert_array_equal(result["pooled"][-1], pooled[6])

    # a damaged shard is caught by verify
    with open(out / "shards" / "00001.patch_tokens.1.npy", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    with pytest.raises(OutputsError, match="00001.patch_tokens.1.npy does not match"):
        open_outputs(str(out), verify=True)



def test_an_output_folder_from_anyone_reads_nothing_outside_it(engine, tmp_path):
    """A manifest is the folder's own word: it named ``../x`` or ``/etc/...`` and the loader
    read that file; a malformed one raised KeyError or TypeError; ids fewer than a shard's rows
    paired rows with the wrong ids, silently."""
    data, out = tmp_path / "data", tmp_path / "out"
    write_images(data, 3)
    assert local_job(engine, data, out).complete
    manifest = json.loads((out / "manifest.json").read_text())
    (tmp_path / "secret.json").write_text('{"ids": ["x"], "paths": ["x"], "failed": []}')

    def opened(edit) -> None:
        changed = json.loads(json.dumps(manifest))
        edit(changed)
        (out / "manifest.json").write_text(json.dumps(changed))
        open_outputs(str(out))

    def name(role: str, rel):
        return lambda m: m["shards"][0]["files"][role].__setitem__("file", rel)

    for edit in (name("ids", "../secret.json"), name("ids", str(tmp_path / "secret.json")),
                 name("pooled", "shards/../manifest.json")):
        with pytest.raises(OutputsError, match="names a file outside shards/"):
            opened(edit)
    for edit, message in (
        (lambda m: m.__setitem__("shards", "x"), 'shards is "x", not a list'),
        (name("pooled", 5), "shards.0.files.pooled.file is 5, not a string"),
        (lambda m: m["shards"][0].pop("files"), "shards.0.files is missing"),
        (lambda m: m.pop("identity"), "identity is missing"),
        (lambda m: m["arrays"].__setitem__("pooled", {"dtype": "float32", "shape": ["x"]}),
         r'arrays.pooled.shape is \["x"\], not a list of whole numbers >= 0'),
    ):
        with pytest.raises(OutputsError, match=f"manifest.json: {message}"):
            opened(edit)
    (out / "manifest.json").write_text("[1, 2]")
    with pytest.raises(OutputsError, match="manifest.json: format None, expected"):
        open_outputs(str(out))
    (out / "manifest.json").write_text(json.dumps(manifest))
    ids_file = out / "shards" / "00000.ids.json"
    rows = json.loads(ids_file.read_text())
    ids_file.write_text(json.dumps({**rows, "failed": 3}))  # out.failed iterated it, later
    with pytest.raises(OutputsError, match='00000.ids.json: failed is 3, not a list'):
        open_outputs(str(out))
    ids_file.write_text(json.dumps({**rows, "ids": rows["ids"][:2], "paths": rows["paths"][:2]}))
    with pytest.raises(OutputsError, match="shard 0 names 2 images, its pooled holds 3"):
        open_outputs(str(out))


def test_a_fifo_in_an_output_folder_is_refused_not_waited_on(engine, tmp_path):
    """A FIFO in place of the manifest or a shard blocked the loader (and a resumed job) for
    ever: the folder may come from anyone; each is an OutputsError, unread."""
    data, out = tmp_path / "data", tmp_path / "out"
    write_images(data, 3)
    assert local_job(engine, data, out).complete
    shard = out / "shards" / "00000.pooled.npy"
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(OutputsError, match="shard 0 cannot be read .*not a regular file: a FIFO"):
        open_outputs(str(out))
    (out / "manifest.json").unlink()
    os.mkfifo(out / "manifest.json")
    for read in (lambda: open_outputs(str(out)), lambda: local_job(engine, data, out)):
        with pytest.raises(OutputsError, match="manifest.json cannot be read: not a regular "
                                               "file: a FIFO"):
            read()
    (out / ".lock").unlink()  # a job opens it to write before anything else: a FIFO waited too
    os.mkfifo(out / ".lock")
    with pytest.raises(OutputsError, match=r"cannot be a folder of outputs: not a regular file: "
                                           r"a FIFO \(.*\.lock\)"):
        local_job(engine, data, out)


def test_a_job_resumed_on_a_damaged_manifest_is_refused_naming_the_key(engine, tmp_path):
    """A resumed job read the manifest's shards without a check: a count that is a string, a
    shard's files that are a list or an identity that is not an object ended in a TypeError or
    AttributeError; each is now an OutputsError naming the key, and the folder is left as it
    was."""
    data, out = tmp_path / "data", tmp_path / "out"
    write_images(data, 3)
    assert local_job(engine, data, out).complete
    manifest = (out / "manifest.json").read_text()
    for edit, message in (
        (lambda m: m["shards"][0].__setitem__("count", "x"), 'shards.0.count is "x", not a whole'),
        (lambda m: m["shards"][0].__setitem__("files", [1]), r"shards.0.files is \[1\], not a"),
        (lambda m: m.__setitem__("identity", None), "identity is null, not a JSON object"),
        (lambda m: m["shards"][0]["files"]["ids"].__setitem__("file", ["x"]),
         r'shards.0.files.ids.file is \["x"\], not a string'),
        (lambda m: m["shards"][0].__setitem__("index", 99),  # was a bare IndexError
         r"shards.0.index is 99, beyond this job's 1 shards"),
    ):
        changed = json.loads(manifest)
        edit(changed)
        (out / "manifest.json").write_text(json.dumps(changed))
        with pytest.raises(OutputsError, match=f"manifest.json: {message}"):
            local_job(engine, data, out)
        assert json.loads((out / "manifest.json").read_text()) == changed

def test_the_servers_variables_are_not_a_remote_jobs_and_a_flag_wins_over_a_variable(
        tmp_path, capsys, monkeypatch):
    """`vit22b serve` and the in-process engine read the same variables (VIT22B_MODEL, ...):
    an outside tester's shell with the server's VIT22B_MODEL set had `embed --server` refused
    ("--server and --local/--model/--checkpoint exclude each other"), and with its
    VIT22B_MAX_IMAGE_PIXELS, VIT22B_COMPILE_CACHE or VIT22B_MAX_DENSE_PATCHES refused naming a
    flag nobody typed. Against servers the engine's variables are left unread now; the
    engine's typed flags beside $VIT22B_SERVER run it in process (a flag wins over a
    variable), beside a typed --server are refused (--seed, --mesh were ignored there). A
    second tester: the unread variables were still parsed (a bad $VIT22B_SEED refused naming
    --seed), --local=false ran in process, a typed --server lost to $VIT22B_LOCAL, and the
    server's $VIT22B_MAX_DENSE_PATCHES refused a local job without --dense."""
    from vit22b.clients.cli import main

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (20, 20), (10, 20, 30)).save(data / "a.png")
    server_env = {"VIT22B_MODEL": "vit-b/16", "VIT22B_MAX_IMAGE_PIXELS": "5",
                  "VIT22B_COMPILE_CACHE": str(tmp_path / "cache"),
                  "VIT22B_MAX_DENSE_PATCHES": "3", "VIT22B_SEED": "4", "VIT22B_MESH": "data=8"}
    for name, value in server_env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()

    def against_servers(*flags: str) -> None:
        """No server listens there: the job tried it (exit 1, resumable), nothing refused."""
        assert main(["embed", str(data), "-o", str(tmp_path / "remote"), *flags,
                     "--quiet"]) == 1
        err = capsys.readouterr().err
        assert "127.0.0.1:1" in err and "exclude" not in err, err

    against_servers("--server", "127.0.0.1:1")
    assert not (tmp_path / "cache").exists()
    # nor are they parsed (a bad one was "argument --seed: ..."); a typed --server wins over
    # $VIT22B_LOCAL, and --local=false asks for no engine
    monkeypatch.setenv("VIT22B_SEED", "not a number")
    monkeypatch.setenv("VIT22B_LOCAL", "1")
    against_servers("--server", "127.0.0.1:1")
    monkeypatch.delenv("VIT22B_LOCAL")
    monkeypatch.setenv("VIT22B_SERVER", "127.0.0.1:1")
    against_servers("--local=false")
    monkeypatch.delenv("VIT22B_SERVER")
    monkeypatch.setenv("VIT22B_SEED", "4")

    for typed, flag in ((["--seed", "3"], "--seed"), (["--mesh", "data=2"], "--mesh"),
                        (["--local"], "--local"), (["--model", "vit-22b-tiny/16"], "--model")):
        assert main(["embed", str(data), "-o", str(tmp_path / "x"), "--server",
                     "127.0.0.1:1", *typed]) == 2
        assert (f"--server and {flag} exclude each other (the in-process engine's"
                in capsys.readouterr().err)

    for name in server_env:
        if name != "VIT22B_MAX_DENSE_PATCHES":  # the server's dense bound: no --dense here
            monkeypatch.delenv(name)
    monkeypatch.setenv("VIT22B_SERVER", "127.0.0.1:1")
    assert main(["embed", str(data), "-o", str(tmp_path / "local"), "--local", "--mesh",
                 "data=2", "--quiet"]) == 0, capsys.readouterr().err
    assert open_outputs(str(tmp_path / "local")).ids == ["a.png"]
    monkeypatch.setenv("VIT22B_LOCAL", "1")
    assert main(["embed", str(data), "-o", str(tmp_path / "y")]) == 2
    assert "$VIT22B_SERVER and $VIT22B_LOCAL exclude each other" in capsys.readouterr().err


def test_the_local_jobs_decoded_size_guard_is_its_own_setting(tmp_path, capsys):
    """A local job's --max-image-pixels (a server states its own): images over it fail by
    name, the others are embedded; with --server the option is refused."""
    from vit22b.clients.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for name, (w, h) in {"small.png": (20, 20), "large.png": (40, 30)}.items():
        Image.new("RGB", (w, h), (10, 20, 30)).save(data / name)
    out = tmp_path / "out"
    rc = main(["embed", str(data), "--output", str(out), "--max-image-pixels", "1000",
               "--batch-size", "2", "--quiet"])
    assert rc == 0
    result = open_outputs(str(out))
    assert result.ids == ["small.png"]
    assert [f["id"] for f in result.failed] == ["large.png"]
    assert ("40x30 = 1200 pixels, over the limit of 1000 (--max-image-pixels of the server or "
            "the local job" in result.failed[0]["reason"])
    capsys.readouterr()
    assert main(["embed", str(data), "--output", str(tmp_path / "o2"), "--server",
                 "127.0.0.1:1", "--max-image-pixels", "1000"]) == 2
    assert "--server and --max-image-pixels exclude each other" in capsys.readouterr().err


def test_a_local_jobs_resolution_is_bounded_by_its_engines_patch_budget(tmp_path, capsys):
    """`vit22b embed --local --resolution 100000` was killed for memory and 4096 took minutes
    an image: the local engine has a patch budget (in_process_patch_budget), and a resolution
    or dense bound one batch cannot hold is refused before an image is read."""
    from vit22b.clients.cli import main

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (40, 30), (10, 20, 30)).save(data / "a.png")
    base = ["embed", str(data), "--local", "--quiet", "--batch-size", "2"]
    # tiny: 4x4 patches at 64 px, so 2 images x 16 x 16 patches = 512 patches, 352 px square
    for extra, what in ((["--resolution", "4096"], "--resolution 4096: 65536"),
                        (["--dense", "--resolution", "400"],
                         "--dense at --resolution 400 (up to twice its square grid): 1250"),
                        (["--dense", "--max-dense-patches", "600"],
                         "--max-dense-patches 600: 600")):
        assert main([*base, *extra, "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert (f"vit22b embed: {what} patches an image do not fit the in-process engine's "
                "batch budget of 512 patches (a square input of at most 352 pixels)") in err, err
        assert not (tmp_path / "out" / "manifest.json").exists()
    assert main([*base, "--resolution", "352", "--output", str(tmp_path / "ok")]) == 0
    assert open_outputs(str(tmp_path / "ok")).ids == ["a.png"]


def test_cli_local_with_list_file_and_extension_filter(engine, tmp_path, capsys):
    from vit22b.clients.cli import main

    data = tmp_path / "data"
    ids = write_images(data, 6)
    write_bad_files(data)
    listing = tmp_path / "few.txt"
    listing.write_text("".join(f"data/{i}\n" for i in ids[:4]) + "data/missing.jpg\n")
    out = tmp_path / "out"
    rc = main(["embed", str(listing), str(data), "--ext", "png", "--output", str(out),
               "--local", "--mesh", "data=8", "--batch-size", "8", "--quiet"])
    stdout = capsys.readouterr().out
    assert rc == 0
    result = open_outputs(str(out))
    listed = [f"data/{i}" for i in ids[:4] if i.endswith(".png")]
    pngs = [f"{data}/{i}" for i in ids[4:] if i.endswith(".png")]
    # several INPUTs: ids as written, sorted; a file both name is embedded once, under the
    # shorter name (the list's)
    assert result.ids == sorted(listed + pngs)
    # missing.jpg, truncated.jpg and notes.txt are filtered out by --ext png; empty.png is not
    assert [f["id"] for f in result.failed] == [f"{data}/class2/deep/empty.png"]
    assert f"embedded {len(listed) + len(pngs)}, skipped 0" in stdout
    assert result.manifest["identity"]["checkpoint_fingerprint"] == engine.identity.fingerprint

    local_job(engine, listing, tmp_path / "o2")  # a list file alone: ids as its lines
    failed = open_outputs(str(tmp_path / "o2")).failed
    assert [(f["id"], f["reason"]) for f in failed] == [
        ("data/missing.jpg", "cannot read file: No such file or directory")]


def test_the_in_process_facade_names_a_bad_image_by_its_place_in_the_whole_list(engine):
    """LocalInfer.embed splits a list into calls of the engine's batch; a refusal named the
    image by its place in its call (image 5 for the caller's 13), so the probes and the local
    job pointed at the wrong file."""
    from vit22b.model.errors import InvalidImage
    from vit22b.server.infer import ImageInput, LocalInfer

    picture = png(np.zeros((16, 16, 3), np.uint8))
    images = [picture] * 20
    images[13] = b"junk"
    with LocalInfer(engine) as local:
        with pytest.raises(InvalidImage) as refused:
            local.embed(images)
        assert refused.value.index == 13 and str(refused.value).startswith("image 13: ")
        named = [ImageInput(image, id=f"file-{i}.png") for i, image in enumerate(images)]
        with pytest.raises(InvalidImage, match=r"^image 13 \(id 'file-13.png'\): not an image"):
            local.embed(named)
        skipped = local.embed(images, skip_invalid=True)
        assert [e.index for e in skipped.errors] == [13] and len(skipped.indices) == 19


def test_the_folders_an_output_needs_are_made_and_unmade_as_spelled(tmp_path, monkeypatch):
    """What prepare made was listed by path text: `a/../b` left `a` behind, an output reached
    through a link and '..' was never removed, and a path that failed part way kept the
    folders made before the failure."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for output in ("a/b/c", "x/../y", "link/../out", "mine"):
        made = OutputStore.prepare(output)
        assert os.path.isdir(os.path.join(output, "shards"))
        OutputStore.unprepare(made)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before, output
    with pytest.raises(OutputsError):
        OutputStore.prepare("new/" + "x" * 300)  # the second level is refused (name too long)
    assert not (tmp_path / "new").exists()
    made = OutputStore.prepare("kept/out")
    (tmp_path / "kept" / "out" / "manifest.json").write_text("{}")  # the job wrote
    OutputStore.unprepare(made)
    assert (tmp_path / "kept" / "out" / "shards").is_dir()


def test_a_local_job_compiles_a_full_batch_before_it_starts_and_the_rest_as_they_come(tmp_path):
    """Its warm-up compiled every bucket (10 at batch 32) before the first image, whatever the
    job's size; now the full batch's alone, and a shorter batch's when it first comes."""
    from serving import MESH
    from vit22b.clients.embed_local import LocalBackend
    from vit22b.server.engine import Engine

    engine = Engine.load(mesh=MESH, max_batch_images=8)
    backend = LocalBackend(OutputSpec(), engine=engine, batch_size=8, concurrency=1)
    backend.warm_up()
    compiled = [b for b in engine.buckets if engine.is_compiled(b, backend.request)]
    assert engine.buckets[-1] == 8 and compiled == [8]
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(data / f"{i}.png")
    summary = run_job(JobConfig([str(data)], str(tmp_path / "out"), batch_size=8, quiet=True),
                      backend)
    assert summary.complete and summary.embedded == 3
    assert [b for b in engine.buckets if engine.is_compiled(b, backend.request)] == [3, 8]
    backend.close()
