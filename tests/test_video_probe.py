"""The moving-shapes world and the video probe: where motion decides, the attention head over
frames beats the middle frame (and the temporal mean, which cannot see the order)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from serving import shared_engine, start_server
from vit22b.clients.cli import main as cli
from vit22b.clients.embed import JobConfig, OutputSpec, run_job
from vit22b.clients.embed_local import LocalBackend
from vit22b.clients.video import Sampling, probe
from vit22b.probes.data import DataError
from vit22b.probes.video_data import DIRECTIONS, moving_world, write_moving_world

pytest.importorskip("av")
K = 9  # odd: the middle sampled frame is the clip's middle frame


def test_moving_world_is_seeded_balanced_and_no_single_frame_decides():
    world = moving_world(64, seed=3)
    again = moving_world(64, seed=3)
    np.testing.assert_array_equal(world.videos, again.videos)
    assert world.videos.shape == (64, 17, 64, 64, 3) and world.class_names == DIRECTIONS
    assert np.bincount(world.labels).tolist() == [32, 32]
    approaching = world.labels == 0
    steps = np.diff(np.log(world.depth), axis=1)
    assert (steps[approaching] < 0).all() and (steps[~approaching] > 0).all()
    np.testing.assert_allclose(np.abs(steps).sum(1), 0.8, rtol=1e-5)  # the same travel
    middle = world.depth[:, 8]  # drawn from one range for both classes
    assert middle.min() >= 2.0 and middle.max() <= 3.0
    # the object grows as it approaches: more pixels differ from the clip's static ground
    changed = np.abs(world.videos[:, -1].astype(int) - world.videos[:, 0]).sum(-1) > 30
    assert changed.any(axis=(1, 2)).all()


def test_the_video_probe_beats_the_middle_frame_where_motion_decides(tmp_path, capsys):
    world = moving_world(200, seed=0)
    paths = write_moving_world(world, tmp_path / "world")
    assert probe(paths[0]).codec == "h264" and probe(paths[0]).frame_count == 17
    spec_out = tmp_path / "emb"  # per-frame pooled features stored by the job
    backend = LocalBackend(OutputSpec(), engine=shared_engine())
    summary = run_job(JobConfig([str(tmp_path / "world")], str(spec_out), quiet=True,
                                batch_size=4, video=Sampling(frames=K)), backend)
    assert summary.complete and summary.embedded == 200 and summary.failed == 0

    # an image probe on per-frame features read no array it knew: "the features hold no images"
    assert cli(["probe", "linear", "--features", str(spec_out), "--out", str(tmp_path / "r")]) == 2
    assert "per-frame features of videos (`vit22b embed --frames K`): probe them with `vit22b " \
        "probe video --features`" in capsys.readouterr().err
    # --frames with stored features was silently the folder's own K
    assert cli(["probe", "video", "--features", str(spec_out), "--frames", "5", "--out",
                str(tmp_path / "r")]) == 2  # fmt: skip
    assert f"--frames chooses the frames sampled; {spec_out} holds its own" in \
        capsys.readouterr().err
    assert cli(["probe", "video", "--features", str(spec_out), "--out", str(tmp_path / "r")]) == 0
    line = capsys.readouterr().out
    report = json.loads((tmp_path / "r" / "video.json").read_text())
    assert report["frames_per_video"] == K and report["num_videos"] == 200
    assert report["features"]["video"]["frames"] == K
    chance = report["baselines"]["chance_top1"]
    middle = report["middle_frame"]["top1"]
    mean = report["temporal_mean"]["top1"]
    attention = report["attention"]["top1"]
    assert chance == 0.5
    # one frame, or the mean over frames, cannot tell approaching from receding ...
    assert middle < 0.7 and mean < 0.7, report
    # ... the attention head, which knows each frame's place in time, can
    assert attention >= 0.85 and attention >= middle + 0.25, report
    assert "video (9 frames): attention head top-1" in line
    # frames 0, 2, .., 16 of 17 at 8 fps: the centres of 9 equal segments
    np.testing.assert_allclose(report["mean_timestamps_s"], np.arange(0, 17, 2) / 8)


def test_probe_video_cli_from_generated_videos_through_a_server(tmp_path, capsys):
    server = start_server()
    try:
        code = cli(["probe", "video", "--moving-world", "16", "--frames", "3", "--steps", "5",
                    "--server", server.address, "--out", str(tmp_path)])
    finally:
        server.stop()
    assert code == 0
    report = json.loads((tmp_path / "video.json").read_text())
    assert report["frames_per_video"] == 3 and report["num_videos"] == 16
    assert report["features"]["source"] == server.address
    assert report["features"]["checkpoint_fingerprint"] == shared_engine().identity.fingerprint
    assert len(list((tmp_path / "moving-world").glob("*/*.mp4"))) == 16
    for bad in (["--shapes-world", "16"], ["--data", str(tmp_path / "nothing")]):
        assert cli(["probe", "video", *bad, "--out", str(tmp_path)]) == 2
    assert cli(["probe", "linear", "--moving-world", "16", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "the video probe reads videos" in err and "--moving-world is for the video" in err


_F = np.random.default_rng(0).standard_normal((20, 3, 8)).astype(np.float32)
_L = np.arange(20) % 2
BAD_VIDEO_FEATURES = {  # (frames, labels, the words of the refusal)
    "labels 0.5 and 1.5": (_F, _L + 0.5, "labels must be integer class indices, got dtype "
                                         "float64"),  # were truncated to 0 and 1
    "complex frames": (_F.astype(np.complex64), _L, "features frames must be real numbers"),
    "a label of 10^12": (_F, _L * 10**12, r"class index 1000000000000 \(image 1\) is too large"),
    "labels of two columns": (_F, np.stack([_L, _L], 1), "one class index per image"),
    "no frames": (_F[:, :0], _L, r"\[videos, frames, width\], each at least 1, got shape "
                                 r"\[20, 0, 8\]"),
    "NaN": (np.where(_F > 2, np.nan, _F), _L, "features frames hold NaN or infinite values"),
    "one class": (_F, _L * 0, "the video probe needs images of 2 classes or more"),
    # scored on the other class alone, against a chance that counted it
    "a class of two videos": (_F, (np.arange(20) < 2).astype(int), "class 'b' has 2 videos: "
                              "too few for both the training and the test split"),
}


@pytest.mark.parametrize("case", BAD_VIDEO_FEATURES)
def test_frame_features_a_probe_cannot_use_are_refused_by_name(case):
    """Before: float labels truncated silently, complex features lost their imaginary parts,
    a label of 10^12 ran JAX out of memory, two-column labels and zero frames raised
    IndexError, no videos a TypeError, NaN frames trained the attention head first."""
    from vit22b.probes.data import DataError
    from vit22b.probes.runner import run_probe
    from vit22b.probes.video import VideoFeatures

    frames, labels, words = BAD_VIDEO_FEATURES[case]
    with pytest.raises(DataError, match=words):
        run_probe("video", VideoFeatures(frames, labels, ("a", "b")), steps=2)


def test_a_video_folder_lists_every_class_folder_in_path_order(tmp_path):
    """Class folders are listed with iterdir, which raises on one it cannot list (glob left it
    out); the order stays that of the sorted paths (pathlib sorts by parts: 'a' before 'a-b')."""
    from vit22b.probes.video_data import load_video_folder

    for rel in ("a/x.mp4", "a/y.webm", "a-b/z.mkv", "b/notes.txt", "b/w.MOV", "loose.mp4"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    found = load_video_folder(tmp_path)
    assert [str(p.relative_to(tmp_path)) for p in found.paths] == [
        "a/x.mp4", "a/y.webm", "a-b/z.mkv", "b/w.MOV"]
    if os.geteuid() != 0:  # root lists any folder
        (tmp_path / "b").chmod(0)
        try:
            with pytest.raises(DataError, match="cannot be listed"):
                load_video_folder(tmp_path)
        finally:
            (tmp_path / "b").chmod(0o755)


def _clips(root, sizes: dict[str, tuple[int, int]]) -> None:
    from vit22b.clients.video import write_video

    for i, (rel, (h, w)) in enumerate(sizes.items()):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        write_video(root / rel, rng.integers(0, 255, (6, h, w, 3), dtype=np.uint8))


def test_the_video_probe_takes_folders_as_the_image_probe_does(tmp_path, capsys):
    """Hidden folders and files left out (a `.thumbnails` folder was a class); a video below
    its class folder refused (left out without a word); clips of other sizes run in-process
    (numpy's concatenate refused them); flags the video probe does not read refused (they
    were ignored: --resolution 32 reported 64)."""
    from vit22b.probes.video_data import load_video_folder

    clips = {f"{c}/{i}.mp4": (32, 32) for c in "ab" for i in range(4)}
    _clips(tmp_path / "d", {**clips, ".thumbnails/t.mp4": (32, 32), "a/wide.mp4": (24, 80)})
    (tmp_path / "d" / "a" / "._0.mp4").write_bytes(b"\0\5\x16\7")  # macOS metadata
    found = load_video_folder(tmp_path / "d")
    assert found.class_names == ("a", "b") and len(found) == 9
    out = tmp_path / "r"
    assert cli(["probe", "video", "--data", str(tmp_path / "d"), "--frames", "3", "--steps",
                "2", "--out", str(out)]) == 0, capsys.readouterr().err  # fmt: skip
    assert json.loads((out / "video.json").read_text())["num_videos"] == 9
    assert cli(["probe", "video", "--data", str(tmp_path / "d"), "--resolution", "32",
                "--feature", "class_token", "--out", str(out)]) == 2  # fmt: skip
    assert "--resolution, --feature: not read by the video probe" in capsys.readouterr().err
    assert cli(["probe", "video", "--data", str(tmp_path / "d"), "--save-features",
                str(tmp_path / "f.npz"), "--out", str(out)]) == 2  # fmt: skip
    assert ("--save-features is for image probes; a video embed output folder (`vit22b embed "
            "--frames K`) keeps video features" in capsys.readouterr().err)
    _clips(tmp_path / "d", {"b/more/x.mp4": (32, 32)})
    with pytest.raises(DataError, match="a video below the class folder 'b', in more"):
        load_video_folder(tmp_path / "d")


def test_the_video_probe_on_an_embed_output_says_what_it_lacks(tmp_path, capsys, caplog):
    """An unfinished job's output refused (a probe ran on part of it), the videos the job
    could not read said and counted (they were dropped without a word), two class folders of
    one name refused (cam1 under a and under b were one class)."""
    clips = {f"{c}/{i}.mp4": (32, 32) for c in "ab" for i in range(4)}
    _clips(tmp_path / "d", clips)
    (tmp_path / "d" / "a" / "broken.mp4").write_bytes(b"not a video")
    out = tmp_path / "e"
    assert cli(["embed", str(tmp_path / "d"), "--output", str(out), "--frames", "3",
                "--quiet"]) == 0  # fmt: skip
    capsys.readouterr()
    assert cli(["probe", "video", "--features", str(out), "--steps", "2", "--out",
                str(tmp_path / "r")]) == 0  # fmt: skip
    assert "the embed job could not read 1 of its videos, left out of the probe " \
        "(a/broken.mp4;" in caplog.text  # a warning (on stderr from the CLI)
    report = json.loads((tmp_path / "r" / "video.json").read_text())
    assert report["num_videos"] == 8 and report["features"]["left_out"] == 1
    assert cli(["probe", "video", "--features", str(out), "--model", "vit-b/16", "--out",
                str(tmp_path / "r")]) == 2  # fmt: skip
    assert "--model: not read with --features" in capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    assert cli(["probe", "video", "--features", str(out), "--out", str(tmp_path / "r")]) == 2
    assert "its embed job has not finished" in capsys.readouterr().err

    _clips(tmp_path / "n", {f"{c}/{cam}/{i}.mp4": (32, 32) for c in "ab"
                            for cam in ("cam1", "cam2") for i in range(2)})
    assert cli(["embed", str(tmp_path / "n"), "--output", str(tmp_path / "en"), "--frames", "3",
                "--quiet"]) == 0  # fmt: skip
    assert cli(["probe", "video", "--features", str(tmp_path / "en"), "--out",
                str(tmp_path / "r")]) == 2  # fmt: skip
    assert "two folders named 'cam1' would be one class" in capsys.readouterr().err

