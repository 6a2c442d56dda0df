"""Videos through the SDK and the embed job: a real server on loopback and the in-process facade.

Frames decoded from real files must get exactly the features of the same frames sent as images
(raw pixels or PNG): the server's preprocessing is the one path. The job stores per video the
per-frame features, their temporal mean and the timestamps; bad videos land in errors.jsonl.
"""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from serving import in_process, png, shared_engine, start_server
from test_video import FPS, ONE, bad_videos, matrix
from vit22b.clients import FeatureClient, VideoError
from vit22b.clients.cli import main as cli
from vit22b.clients.embed import JobConfig, OutputSpec, run_job
from vit22b.clients.embed_local import LocalBackend
from vit22b.clients.embed_remote import RemoteBackend
from vit22b.clients.embed_store import JobMismatch
from vit22b.clients.outputs import open_outputs
from vit22b.clients.video import DISPLAY, Sampling, read_clip, write_video
from vit22b.clients.video_features import embed_videos
from vit22b.model.outputs import OutputRequest

pytest.importorskip("av")


def coloured(n: int, seed: int, size=(48, 80)) -> np.ndarray:
    """Smooth random colour fields (codec-friendly), each frame different."""
    rng = np.random.default_rng(seed)
    h, w = size
    y, x = np.mgrid[:h, :w] / max(h, w)
    out = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        a = rng.uniform(0, 6, 3)
        out[i] = (127 + 120 * np.sin(a[None, None] * (x + y * 0.7 + i / n)[..., None])).astype(
            np.uint8)
    return out


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videos")
    paths = []
    for i, suffix in enumerate([".mp4", ".webm", ".mp4", ".mkv"]):
        path = folder / f"clip{i}{suffix}"
        write_video(path, coloured(12 + 3 * i, seed=i), fps=FPS)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.stop()


def test_video_frames_through_the_server_equal_the_frames_sent_as_images(server, videos):
    with FeatureClient(server.address) as client:
        got = client.embed_video(videos[0], frames=5, outputs=["pooled"], layers=[-1])
        clip = read_clip(videos[0], Sampling(frames=5))
        as_pixels = client.embed(list(clip.frames), outputs=["pooled"], layers=[-1])
        as_png = client.embed([png(f) for f in clip.frames], outputs=["pooled"], layers=[-1])
    assert got.pooled.shape == (5, 64) and got.patch_tokens[-1].shape == (5, 16, 64)
    for other in (as_pixels, as_png):  # the same request shape: bit-identical features
        np.testing.assert_array_equal(got.pooled, other.pooled)
        np.testing.assert_array_equal(got.patch_tokens[-1], other.patch_tokens[-1])
    np.testing.assert_allclose(got.temporal_mean, got.pooled.mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(got.timestamps, clip.timestamps)
    assert got.frame_indices.tolist() == [1, 3, 6, 8, 10] and got.info.frame_count == 12
    assert got.model.fingerprint == shared_engine().identity.fingerprint
    # ... and the in-process facade agrees with the server (same preprocessing, same model)
    local = in_process(shared_engine(), list(clip.frames))
    np.testing.assert_allclose(got.pooled, local.pooled, rtol=2e-2, atol=2e-2)


class Counting:
    """The real client, counting the images of each ``embed`` call."""

    def __init__(self, client: FeatureClient):
        self.client, self.calls = client, []

    def embed(self, images, **kwargs):
        self.calls.append(len(images))
        return self.client.embed(images, **kwargs)


def test_several_videos_share_one_call_and_bad_ones_are_reported(server, videos, tmp_path):
    bad = bad_videos(tmp_path / "bad")
    truncated = tmp_path / "bad" / "truncated.webm"
    inputs = [videos[1], truncated, videos[2].read_bytes(), videos[3]]
    with FeatureClient(server.address) as client:
        with pytest.raises(VideoError, match="truncated.webm: truncated or damaged"):
            client.embed_videos(inputs, frames=3)
        counting = Counting(client)
        result = embed_videos(counting, inputs, stride_s=0.5, skip_invalid=True)
        alone = [client.embed_video(v, stride_s=0.5) for v in (videos[1], videos[2], videos[3])]
        with open(videos[2], "rb") as f:  # an open file is one video, read like its path
            opened = client.embed_videos(f, stride_s=0.5)
    assert len(opened.videos) == 1 and opened.videos[0].id == "0"
    np.testing.assert_array_equal(opened.videos[0].pooled, alone[1].pooled)
    assert [v.id for v in result.videos] == [str(videos[1]), "2", str(videos[3])]
    assert [(e.index, e.id) for e in result.errors] == [(1, str(truncated))]
    assert bad["truncated.webm"][1] in result.errors[0].reason
    counts = [len(v.pooled) for v in result.videos]
    assert counts == [3, 4, 5]  # 1.5, 1.8 and 2.1 s at a 0.5 s stride: each its own count
    assert counting.calls == [sum(counts)]  # one embed call: the videos' frames share requests
    for together, one in zip(result.videos, alone):
        np.testing.assert_array_equal(together.timestamps, one.timestamps)
        np.testing.assert_allclose(together.pooled, one.pooled, rtol=2e-2, atol=2e-2)


def embed_job(backend, data, out, k=4, **kw):
    config = JobConfig([str(data)], str(out), kw.pop("spec", OutputSpec()), quiet=True,
                       batch_size=kw.pop("batch_size", 2), shard_size=3,
                       extensions=(".mp4", ".webm", ".mkv", ".avi"), video=Sampling(frames=k),
                       **kw)
    return run_job(config, backend)


@pytest.mark.parametrize("storage", ["npy", "parquet", "safetensors"])
def test_the_job_stores_frames_mean_and_timestamps_and_lists_bad_videos(videos, tmp_path,
                                                                        storage):
    if storage == "parquet":
        pytest.importorskip("pyarrow")
    data, out = tmp_path / "data", tmp_path / "out"
    bad = bad_videos(data / "bad")
    for path in videos:
        (data / path.name).write_bytes(path.read_bytes())
    spec = OutputSpec(patch_layers=(-1,))
    backend = LocalBackend(spec, engine=shared_engine())
    # one video per batch: its frames are computed as one call, like the reference below
    summary = embed_job(backend, data, out, spec=spec, batch_size=1, format=storage)
    result = open_outputs(str(out), verify=True)
    good = sorted([p.name for p in videos] + ["bad/good.mp4", "bad/good.webm"])
    assert result.ids == good and summary.complete
    assert result.names == ["frames.pooled", "frames.patch_tokens.3", "mean.pooled",
                            "timestamps", "frame_indices"]
    assert result["frames.pooled"].shape == (6, 4, 64)
    assert result["frames.patch_tokens.3"].shape == (6, 4, 16, 64)
    errors = {e["id"]: e["reason"] for e in map(json.loads, open(out / "errors.jsonl"))}
    listed = {f"bad/{name}": words for name, (_, words) in bad.items() if name != "missing.mp4"}
    assert set(errors) == set(listed)
    for video_id, reason in errors.items():
        assert listed[video_id] in reason, (video_id, reason)

    for row, video_id in enumerate(result.ids):  # each row: that video's frames, as images
        clip = read_clip(data / video_id, Sampling(frames=4))
        want = in_process(shared_engine(), list(clip.frames),
                          OutputRequest(pooled=True, patch_layers=(3,)))
        np.testing.assert_allclose(result["frames.pooled"][row], want.pooled, rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(result["frames.patch_tokens.3"][row], want.patch_tokens[3],
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result["mean.pooled"][row], want.pooled.mean(0), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_array_equal(result["timestamps"][row], clip.timestamps)
        np.testing.assert_array_equal(result["frame_indices"][row], clip.indices)

    identity = json.loads((out / "manifest.json").read_text())["identity"]
    assert identity["video"]["frames"] == 4 and identity["format"] == storage
    with pytest.raises(JobMismatch, match="video: .*'frames': 4.* in the manifest, .*'frames': 6"):
        embed_job(backend, data, out, k=6, spec=spec, format=storage)
    again = embed_job(backend, data, out, spec=spec, format=storage)  # the same: resumes
    assert again.embedded == 0 and again.skipped == len(good) + len(errors)


def test_a_listed_video_with_a_nul_byte_is_that_videos_failure(videos, tmp_path):
    """A list line with a NUL byte ended the video job ("local-0 failed: ValueError: embedded
    null byte" from os.stat); now it is that video's failure, named."""
    listing = tmp_path / "list.txt"
    listing.write_text(f"{videos[0]}\n{videos[0]}\x00x.mp4\n")
    backend = LocalBackend(OutputSpec(), engine=shared_engine())
    summary = embed_job(backend, listing, tmp_path / "out")
    assert (summary.embedded, summary.failed) == (1, 1) and summary.complete
    (error,) = [json.loads(line) for line in open(tmp_path / "out" / "errors.jsonl")]
    assert error["reason"] == "cannot read file: a path with a NUL byte names no file"


def test_a_video_that_could_not_be_read_is_retried_once_it_can(videos, tmp_path):
    """A video behind a dangling link was "cannot open as a video", which a rerun never
    retried (an image's "cannot read file" is): the same words now, and the rerun embeds it."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.mp4").symlink_to(videos[0])
    (data / "b.mp4").symlink_to(tmp_path / "later" / "b.mp4")
    backend = LocalBackend(OutputSpec(), engine=shared_engine())
    first = embed_job(backend, data, tmp_path / "out")
    assert (first.embedded, first.failed, first.complete) == (1, 1, True)
    assert "holds 1 videos and 1 failures" in first.line()
    (tmp_path / "later").mkdir()
    (tmp_path / "later" / "b.mp4").symlink_to(videos[1])
    again = embed_job(backend, data, tmp_path / "out")
    assert (again.embedded, again.failed, again.held) == (2, 0, 2)
    outputs = open_outputs(str(tmp_path / "out"))
    assert outputs.ids == ["a.mp4", "b.mp4"] and not outputs.failed
    alone = read_clip(videos[1], Sampling(frames=4))
    np.testing.assert_array_equal(np.asarray(outputs["timestamps"])[1], alone.timestamps)


def test_a_frame_the_server_refuses_names_its_video(videos, tmp_path):
    """A frame over the server's pixel limit was "image 6: ..." (its place among all the
    videos' frames); now it is the video's refusal, naming the frame."""
    big = tmp_path / "big.mp4"
    write_video(big, coloured(6, seed=9, size=(96, 128)), fps=FPS)
    srv = start_server(max_image_pixels=96 * 100)
    try:
        with FeatureClient(srv.address) as client:
            with pytest.raises(VideoError) as caught:
                client.embed_videos([videos[0], videos[1], big], frames=3)
            result = client.embed_videos([videos[0], big, videos[1]], frames=3,
                                         skip_invalid=True)
    finally:
        srv.stop()
    assert caught.value.source == str(big)
    assert caught.value.reason.startswith("frame 0 (at 0.100 s): raw image is 128x96 = 12288 "
                                          "pixels, over the limit of 9600")
    assert [(v.index, v.id) for v in result.videos] == [(0, str(videos[0])), (2, str(videos[1]))]
    assert [(e.index, e.id) for e in result.errors] == [(1, str(big))]


def test_what_the_sdk_takes_as_videos_and_ids(server, videos):
    """A memoryview was iterated byte by byte (2080 'videos'), a numpy array frame by frame;
    ids were str()-ed (None -> 'None', "ab" -> 'a', 'b')."""
    with FeatureClient(server.address) as client:
        view = client.embed_videos(memoryview(videos[0].read_bytes()), frames=2)
        path = client.embed_video(videos[0], frames=2)
        np.testing.assert_array_equal(view.videos[0].pooled, path.pooled)
        with pytest.raises(TypeError, match="not a numpy array"):
            client.embed_videos(read_clip(videos[0], Sampling(frames=2)).frames, frames=2)
        with pytest.raises(TypeError, match="video 1 is a int: a video is a path"):
            client.embed_videos([videos[0], 7], frames=2)
        with pytest.raises(TypeError, match="the id of video 0 is a NoneType"):
            client.embed_videos([videos[0]], frames=2, ids=[None])
        with pytest.raises(TypeError, match="ids is one text"):
            client.embed_videos([videos[0], videos[1]], frames=2, ids="ab")
        named = client.embed_videos([videos[0], videos[1]], frames=2, ids=["x", 5])
    assert [(v.index, v.id) for v in named.videos] == [(0, "x"), (1, "5")]


def test_the_job_through_a_server_in_bfloat16(server, videos, tmp_path):
    spec = OutputSpec(dtype="bfloat16")
    data = videos[0].parent
    summary = embed_job(RemoteBackend([server.address], spec, quiet=True), data, tmp_path / "o",
                        k=3, spec=spec)
    assert summary.complete and summary.embedded == len(videos)
    out = open_outputs(str(tmp_path / "o"))
    frames = np.asarray(out["frames.pooled"])  # widened from the stored bfloat16 bits
    assert frames.shape == (4, 3, 64) and frames.dtype == np.float32
    with FeatureClient(server.address) as client:
        want = client.embed_video(videos[0], frames=3, dtype="bfloat16")
    np.testing.assert_allclose(frames[0], np.asarray(want.pooled, np.float32), rtol=2e-2,
                               atol=2e-2)  # other batch sizes: bf16-compute noise
    mean = frames.mean(axis=1)  # the stored mean: float32 mean of the values, then bfloat16
    np.testing.assert_allclose(np.asarray(out["mean.pooled"]), mean, rtol=1e-2, atol=1e-2)


def test_cli_video_options(server, videos, tmp_path, capsys):
    data, out = str(videos[0].parent), str(tmp_path / "cli")
    assert cli(["embed", data, "--server", server.address, "-o", out, "--frames", "2", "-q"]) == 0
    assert "embedded 4" in capsys.readouterr().out
    assert cli(["embed", data, "--server", server.address, "-o", out, "--frames", "3", "-q"]) == 2
    assert "refusing to mix" in capsys.readouterr().err
    assert cli(["embed", data, "-o", str(tmp_path / "s"), "--stride-seconds", "0.5"]) == 2
    assert "use --frames K" in capsys.readouterr().err
    frames = np.asarray(open_outputs(out)["frames.pooled"])
    assert frames.shape == (4, 2, 64)


def test_video_inputs_from_an_fsspec_url_equal_the_local_files(videos, tmp_path):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for path in videos:
        fs.pipe(f"/video-inputs/{path.name}", path.read_bytes())
    fs.pipe("/video-inputs/broken.mp4", b"\x00" * 64)
    backend = LocalBackend(OutputSpec(), engine=shared_engine())
    config = dict(batch_size=1, shard_size=8, video=Sampling(frames=3), quiet=True)
    remote = run_job(JobConfig(["memory://video-inputs/"], str(tmp_path / "m"), OutputSpec(),
                               **config), backend)
    local = run_job(JobConfig([str(videos[0].parent)], str(tmp_path / "l"), OutputSpec(),
                              **config), backend)
    assert (remote.embedded, remote.failed) == (4, 1) and local.embedded == 4
    a, b = open_outputs(str(tmp_path / "m")), open_outputs(str(tmp_path / "l"))
    np.testing.assert_array_equal(np.asarray(a["frames.pooled"]), np.asarray(b["frames.pooled"]))
    np.testing.assert_array_equal(np.asarray(a["timestamps"]), np.asarray(b["timestamps"]))
    assert "not a readable video container" in a.failed[0]["reason"]
    fs.rm("/video-inputs", recursive=True)


def test_video_inputs_from_s3_are_read_in_place_and_equal_the_local_files(videos, s3, tmp_path):
    """Videos in a real S3-compatible server on loopback: PyAV reads each object through an
    fsspec file (ranged GETs as it seeks; an MP4's index may sit at its end), not whole."""
    pytest.importorskip("s3fs")
    objects = {f"clips/{path.name}": path.read_bytes() for path in videos}
    objects["clips/empty.mp4"] = b""
    bucket = s3("videos", objects)
    backend = LocalBackend(OutputSpec(), engine=shared_engine())
    config = dict(batch_size=2, shard_size=8, video=Sampling(frames=3), quiet=True)
    remote = run_job(JobConfig([f"{bucket}/clips/"], str(tmp_path / "s3"), OutputSpec(),
                               **config), backend)
    local = run_job(JobConfig([str(videos[0].parent)], str(tmp_path / "l"), OutputSpec(),
                              **config), backend)
    assert (remote.embedded, remote.failed) == (4, 1) and local.embedded == 4
    a, b = open_outputs(str(tmp_path / "s3")), open_outputs(str(tmp_path / "l"))
    np.testing.assert_array_equal(np.asarray(a["frames.pooled"]), np.asarray(b["frames.pooled"]))
    assert a.failed[0]["reason"] == "empty (0 bytes)"


def test_a_portrait_clip_is_embedded_upright(tmp_path):
    """A phone's portrait clip (stored landscape; its display matrix turns it 90 degrees
    clockwise): the job embeds the upright frames, not the stored sideways ones."""
    data, stored = tmp_path / "data", coloured(6, seed=7)  # 48 x 80
    data.mkdir()
    write_video(data / "portrait.mp4", stored, fps=FPS, display_matrix=matrix(0, ONE, -ONE, 0))
    write_video(data / "stored.mp4", stored, fps=FPS)  # the same pixels, no matrix
    backend = LocalBackend(OutputSpec(), engine=shared_engine())
    assert embed_job(backend, data, tmp_path / "out", k=3, batch_size=1).embedded == 2
    out = open_outputs(str(tmp_path / "out"))
    pooled = dict(zip(out.ids, np.asarray(out["frames.pooled"])))
    sideways = read_clip(data / "stored.mp4", Sampling(frames=3)).frames
    # clockwise: shown row i is stored column i from the bottom up (test_video checks corners)
    upright = np.ascontiguousarray(sideways[:, ::-1].transpose(0, 2, 1, 3))
    assert upright.shape == (3, 80, 48, 3)
    want = in_process(shared_engine(), list(upright))
    np.testing.assert_allclose(pooled["portrait.mp4"], want.pooled, rtol=1e-5, atol=1e-5)
    assert np.abs(pooled["portrait.mp4"] - pooled["stored.mp4"]).max() > 1e-2  # it matters


def test_a_video_job_of_an_earlier_display_rule_recomputes_the_shards_it_showed_otherwise(
        videos, tmp_path, caplog):
    """A video job's identity names how frames are shown (``video.DISPLAY``). A manifest of an
    earlier vit22b lacks it: its frames of non-square pixels were embedded stretched (and,
    before 2026-12-02, a portrait clip's sideways), so a resumed job recomputes the shards
    holding such videos (and only those), not mixing two rules in one output; its other
    shards are kept."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    for path in videos[:3]:  # shard 0 (shards of 3): square pixels, upright
        (data / path.name).write_bytes(path.read_bytes())
    write_video(data / "wide.mp4", coloured(6, seed=9), fps=FPS,
                sample_aspect_ratio=Fraction(3, 2))  # shard 1: pixels 3:2 wide
    write_video(data / "yportrait.mp4", coloured(6, seed=10), fps=FPS,  # shard 2: turned
                display_matrix=matrix(0, ONE, -ONE, 0))  # (not applied before 2026-12-02)
    for seed, name in enumerate(["x1", "x2", "z1", "z2", "~last"]):  # square and upright
        write_video(data / f"{name}.mp4", coloured(6, seed=20 + seed), fps=FPS)
    backend = LocalBackend(OutputSpec(), engine=shared_engine())
    assert embed_job(backend, data, out, k=3).embedded == 10  # shard 3: "~last.mp4" alone
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["identity"]["video"]["display"] == DISPLAY
    first = open_outputs(str(out))
    first_rows = {name: np.asarray(first[name]).copy() for name in first.names}

    manifest["identity"]["video"].pop("display")  # as an earlier vit22b wrote it
    manifest_path.write_text(json.dumps(manifest))
    with caplog.at_level("WARNING", logger="vit22b.clients.embed_store"):
        again = embed_job(backend, data, out, k=3)
    assert (again.embedded, again.skipped, again.held) == (6, 4, 10)  # shards 1 and 2
    assert "written before frames were shown square and upright" in caplog.text
    assert json.loads(manifest_path.read_text())["identity"]["video"]["display"] == DISPLAY
    after = open_outputs(str(out), verify=True)
    assert after.ids == first.ids
    for name in first.names:  # this version's rows, recomputed or kept
        np.testing.assert_array_equal(np.asarray(after[name]), first_rows[name])
    assert embed_job(backend, data, out, k=3).embedded == 0  # rewritten: nothing to recheck

    manifest = json.loads(manifest_path.read_text())
    manifest["identity"]["video"].pop("display")
    manifest["identity"]["video"]["frames"] = 5  # an earlier job of other settings: refused
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(JobMismatch, match="(?s)video: .*rerun with the manifest's settings"):
        embed_job(backend, data, out, k=3)

    manifest["identity"]["video"] |= {"frames": 3, "display": "another rule"}  # a newer one's?
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(JobMismatch, match="its frames were shown by another rule "
                       r"\('another rule'\) than this vit22b's: no setting chooses the rule, "
                       "so choose another --output"):
        embed_job(backend, data, out, k=3)
