"""Video decoding (clients/video.py): real files written by PyAV in four codecs, exact sampling,
the pixels that come out, and the reasons bad files are refused with."""

from __future__ import annotations

import io
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vit22b.clients.video import (
    Sampling,
    VideoError,
    encoder_for,
    probe,
    read_clip,
    read_clips,
    write_video,
)

av = pytest.importorskip("av")  # the video extra

ROOT = Path(__file__).resolve().parents[1]
SIZE, BITS, FPS, N = 64, 6, 10, 23
CODECS = [(".mp4", "libx264", "h264"), (".webm", "libvpx-vp9", "vp9"),
          (".webm", "libvpx", "vp8"), (".avi", "mpeg4", "mpeg4")]


def indexed_frames(n: int) -> np.ndarray:
    """Frame i shows i in binary (BITS white/black cells along the top half) over a red left /
    blue right bottom half: both survive lossy codecs and chroma subsampling."""
    frames = np.zeros((n, SIZE, SIZE, 3), np.uint8)
    for i in range(n):
        for bit in range(BITS):
            if i >> bit & 1:
                frames[i, 4:28, 8 * bit + 8 : 8 * bit + 16] = 255
        frames[i, 36:, : SIZE // 2] = (255, 0, 0)
        frames[i, 36:, SIZE // 2 :] = (0, 0, 255)
    return frames


def read_index(frame: np.ndarray) -> int:
    cells = [frame[10:22, 8 * b + 10 : 8 * b + 14].mean() > 128 for b in range(BITS)]
    return sum(int(on) << b for b, on in enumerate(cells))


def expected_uniform(n: int, k: int) -> list[int]:
    return [(2 * j + 1) * n // (2 * k) for j in range(k)]


def expected_stride(n: int, fps: int, stride: str) -> list[int]:
    s, duration = Fraction(stride), Fraction(n, fps)
    return [int(j * s * fps) for j in range(n * 100) if j * s < duration] or [0]


@pytest.fixture(scope="module", params=CODECS, ids=[c[2] for c in CODECS])
def clip_file(request, tmp_path_factory):
    suffix, encoder, codec = request.param
    path = tmp_path_factory.mktemp("video") / f"indexed{suffix}"
    assert write_video(path, indexed_frames(N), fps=FPS, codec=encoder) == encoder
    return path, codec


def test_encoders_of_this_pyav_build():
    # what the moving world, the demo and the benchmark write: h264 MP4 and VP9 WebM
    assert encoder_for("x.mp4") == "libx264"
    assert encoder_for("x.webm") == "libvpx-vp9"
    with pytest.raises(ValueError, match="no encoder"):
        encoder_for("x.gif")


def test_probe_reports_the_stream(clip_file):
    path, codec = clip_file
    info = probe(path)
    assert (info.codec, info.width, info.height, info.frame_count) == (codec, SIZE, SIZE, N)
    assert info.duration_s == pytest.approx(N / FPS) and info.fps == pytest.approx(FPS)
    assert info.container in ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi")


@pytest.mark.parametrize("k", [1, 4, 7, N, 30])
def test_uniform_sampling_is_exact(clip_file, k):
    path, _ = clip_file
    clip = read_clip(path, Sampling(frames=k))
    want = expected_uniform(N, k)  # the centres of k equal segments; k > N repeats frames
    assert clip.frames.shape == (k, SIZE, SIZE, 3) and clip.frames.dtype == np.uint8
    assert [read_index(f) for f in clip.frames] == want  # the pixels of those very frames
    assert clip.indices.tolist() == want
    np.testing.assert_allclose(clip.timestamps, np.asarray(want) / FPS, atol=1e-9)
    assert clip.info.frame_count == N


@pytest.mark.parametrize("stride", ["0.25", "0.3", "0.7", "5"])
def test_stride_sampling_is_exact(clip_file, stride):
    path, _ = clip_file
    clip = read_clip(path, Sampling(stride_s=float(stride)))
    want = expected_stride(N, FPS, stride)  # frames shown at 0, S, 2S, ... < D
    assert [read_index(f) for f in clip.frames] == want == clip.indices.tolist()
    np.testing.assert_allclose(clip.timestamps, np.asarray(want) / FPS, atol=1e-9)


def test_pixels_are_rgb_and_close_to_what_was_written(clip_file):
    path, _ = clip_file
    frames = read_clip(path, Sampling(frames=N)).frames
    written = indexed_frames(N)
    # lossy, chroma-subsampled: compare away from edges; red stays red (no BGR mix-up)
    assert np.abs(frames[:, 40:60, 4:28].astype(int) - written[:, 40:60, 4:28]).mean() < 12
    assert (frames[:, 48, 10, 0] > 200).all() and (frames[:, 48, 10, 2] < 60).all()
    assert (frames[:, 48, 54, 2] > 200).all() and (frames[:, 48, 54, 0] < 60).all()


def test_bytes_read_like_the_file(clip_file):
    path, _ = clip_file
    a = read_clip(path, Sampling(frames=5))
    b = read_clip(path.read_bytes(), Sampling(frames=5), name="in memory")
    np.testing.assert_array_equal(a.frames, b.frames)
    np.testing.assert_array_equal(a.timestamps, b.timestamps)


def test_sampling_settings_are_checked():
    for bad in ({}, {"frames": 2, "stride_s": 1.0}, {"frames": 0}, {"stride_s": -1.0},
                {"frames": True}):
        with pytest.raises(ValueError):
            Sampling(**bad)
    assert Sampling(stride_s=0.1).stride == Fraction(1, 10)  # the decimal, not the binary float


def bad_videos(folder: Path) -> dict[str, tuple[str, str]]:
    """Bad files -> (name, words their reason must contain)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_video(folder / "good.mp4", indexed_frames(20), fps=FPS)
    write_video(folder / "good.webm", indexed_frames(20), fps=FPS)
    mp4, webm = (folder / "good.mp4").read_bytes(), (folder / "good.webm").read_bytes()
    (folder / "truncated.mp4").write_bytes(mp4[: len(mp4) * 6 // 10])  # its index (moov) is lost
    (folder / "truncated.webm").write_bytes(webm[: len(webm) * 6 // 10])
    rng = np.random.default_rng(0)
    (folder / "random.mp4").write_bytes(rng.bytes(4096))
    (folder / "empty.mp4").write_bytes(b"")
    Image.fromarray(indexed_frames(1)[0]).save(folder / "still.png")
    (folder / "still.png").rename(folder / "still.mp4")
    with av.open(str(folder / "zero.avi"), "w") as container:  # a video stream, no frames
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width = stream.height = SIZE
        container.start_encoding()
    with av.open(str(folder / "audio.mp4"), "w") as container:  # an audio stream only
        stream = container.add_stream("aac", rate=16000)
        for i in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                               layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return {
        "truncated.mp4": ("truncated.mp4", "no streams at all"),
        "truncated.webm": ("truncated.webm", "truncated or damaged: its container declares 2.000"),
        "random.mp4": ("random.mp4", "not a readable video container (Invalid data"),
        "empty.mp4": ("empty.mp4", "empty file (0 bytes)"),
        "still.mp4": ("still.mp4", "a still image"),
        "zero.avi": ("zero.avi", "no decodable frame in its mpeg4 stream"),
        "audio.mp4": ("audio.mp4", "no video stream in the mov,mp4"),
        "missing.mp4": ("missing.mp4", "cannot open as a video: No such file or directory"),
    }


def test_bad_videos_are_refused_with_their_reason(tmp_path):
    bad = bad_videos(tmp_path)
    for name, (_, words) in bad.items():
        with pytest.raises(VideoError) as caught:
            read_clip(tmp_path / name, Sampling(frames=4))
        assert caught.value.source == str(tmp_path / name)  # names the file
        assert words in caught.value.reason, (name, caught.value.reason)
        assert str(tmp_path / name) in str(caught.value)
    with pytest.raises(VideoError, match=r"<video bytes>: empty \(0 bytes\)"):
        read_clip(b"", Sampling(frames=1))
    # many at once: each bad one is its error, in place
    out = read_clips([tmp_path / "good.mp4", tmp_path / "random.mp4"], Sampling(frames=2))
    assert out[0].frames.shape[0] == 2 and isinstance(out[1], VideoError)


def _encoded(folder: Path, name: str, fmt: str, count: int, size: int, first: int) -> Path:
    """``count`` h264 frames of ``size`` in ``fmt``, 8 per second, the first at pts ``first``."""
    path = folder / name
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=8, options={"bf": "0"})
        stream.width = stream.height = size
        for i in range(count):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 20 + 9 * i, np.uint8),
                                               format="rgb24")
            frame.pts = first + i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _size_change(folder: Path) -> Path:
    """8 frames of 16x16 then 8 of 32x32 (two MPEG-TS segments, as concatenated captures are)."""
    parts = [_encoded(folder, f"part{i}.ts", "mpegts", 8, size, 8 * i)
             for i, size in enumerate((16, 32))]
    path = folder / "size_change.mkv"
    joined = b"".join(p.read_bytes() for p in parts)
    with av.open(io.BytesIO(joined)) as source, av.open(str(path), "w") as out:
        video = source.streams.video[0]
        stream = out.add_stream_from_template(video)
        for packet in source.demux(video):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)
    return path


def test_odd_but_real_videos(tmp_path, monkeypatch):
    """A clip cut from a longer recording (first frame at 5 s) is read; a size change, a still
    GIF and samples too large are refused naming the file; an animated GIF is a video."""
    import vit22b.clients.video as video

    for fmt, suffix in (("matroska", ".mkv"), ("mp4", ".mp4")):  # Matroska counted from 0
        clip = read_clip(_encoded(tmp_path, "late" + suffix, fmt, 20, 16, 40), Sampling(frames=4))
        assert clip.indices.tolist() == [2, 7, 12, 17] and clip.info.duration_s == 2.5
    with pytest.raises(VideoError, match=r"size_change.mkv: its frame size changes within the "
                                         r"video \(16x16 and 32x32"):
        read_clip(_size_change(tmp_path), Sampling(frames=4))
    frames = [Image.fromarray(f) for f in indexed_frames(3)]
    frames[0].save(tmp_path / "still.gif")
    (tmp_path / "still.gif").rename(tmp_path / "still_gif.mp4")
    with pytest.raises(VideoError, match="still_gif.mp4: a still image"):
        read_clip(tmp_path / "still_gif.mp4", Sampling(frames=2))
    frames[0].save(tmp_path / "moving.gif", save_all=True, append_images=frames[1:], duration=100)
    assert read_clip(tmp_path / "moving.gif", Sampling(frames=3)).indices.tolist() == [0, 1, 2]
    with pytest.raises(VideoError, match=r"stride_s=1e-300 gives 2.5e\+300 sampling times"):
        read_clip(tmp_path / "late.mkv", Sampling(stride_s=1e-300))
    with pytest.raises(ValueError, match="frames must be at most 10000"):
        Sampling(frames=10**12)
    monkeypatch.setattr(video, "MAX_CLIP_BYTES", 3 * 16 * 16 * 3)
    with pytest.raises(VideoError, match="4 frames of 16x16 sampled .* over the"):
        read_clip(tmp_path / "late.mkv", Sampling(frames=4))

    def surprise(*args):  # what a decoder may raise on a file nobody foresaw
        raise RuntimeError("a decoder's surprise")

    monkeypatch.setattr(video, "_decode", surprise)
    with pytest.raises(VideoError, match="late.mkv: cannot be read: RuntimeError: a decoder's"):
        read_clip(tmp_path / "late.mkv", Sampling(frames=1))


def test_importing_the_video_modules_loads_neither_av_nor_jax():
    code = ("import sys\n"
            "import vit22b.clients.video, vit22b.clients.video_features, "
            "vit22b.clients.embed_video, vit22b.clients.embed_cli\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('av', 'jax', 'flax')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
