"""Video decoding (clients/video.py): real files written by PyAV in four codecs, exact sampling,
the pixels that come out, and the reasons bad files are refused with."""

from __future__ import annotations

import io
import math
import os
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vit22b.clients.video import (
    Orientation,
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
    assert (info.rotation, info.mirrored) == (0, False)  # no display matrix
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


def mux_silence(container, stream, count: int) -> None:
    """``count`` frames of 1024 silent mono samples at 16 kHz into an AAC ``stream``."""
    for i in range(count):
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate, frame.pts = 16000, i * 1024
        for packet in stream.encode(frame):
            container.mux(packet)


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
        mux_silence(container, stream, 8)
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
        "missing.mp4": ("missing.mp4", "cannot read file: No such file or directory"),
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
    os.mkfifo(tmp_path / "pipe.mp4")  # PyAV opened it and waited for a writer for ever
    for read in (probe, lambda path: read_clip(path, Sampling(frames=1))):
        with pytest.raises(VideoError, match="pipe.mp4: cannot read file: not a regular file: "
                                             "a FIFO"):
            read(tmp_path / "pipe.mp4")
    # FFmpeg's open stopped at a NUL byte: "good.mp4\0x.mp4" was read as good.mp4
    with pytest.raises(VideoError, match="a path with a NUL byte names no file"):
        probe(f"{tmp_path / 'good.mp4'}\0x.mp4")
    # many at once: each bad one is its error, in place
    out = read_clips([tmp_path / "good.mp4", tmp_path / "random.mp4"], Sampling(frames=2))
    assert out[0].frames.shape[0] == 2 and isinstance(out[1], VideoError)


class ReadLog(io.BytesIO):
    """A file object that keeps the size of every read PyAV makes from it."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.reads: list[int] = []

    def read(self, size: int = -1) -> bytes:
        out = super().read(size)
        self.reads.append(len(out))
        return out


def test_an_open_file_is_read_in_pieces_like_the_path(tmp_path):
    """A seekable file object (what the job passes for a remote object: an fsspec file) gives
    the path's frames, read in pieces, never whole; an empty one is refused as empty."""
    path = tmp_path / "noise.mp4"
    frames = np.random.default_rng(5).integers(0, 256, (48, SIZE, SIZE, 3), np.uint8)
    write_video(path, frames, fps=FPS)  # noise: about 150 KB, several of PyAV's buffers
    data = path.read_bytes()
    source = ReadLog(data)
    got, expected = read_clip(source, Sampling(frames=5)), read_clip(path, Sampling(frames=5))
    np.testing.assert_array_equal(got.frames, expected.frames)
    np.testing.assert_array_equal(got.timestamps, expected.timestamps)
    assert len(data) > 3 * max(source.reads)  # in pieces, both passes from the start
    assert sum(source.reads) >= 2 * len(data)
    assert probe(ReadLog(data)) == probe(path)
    with pytest.raises(VideoError, match=r"<video file>: empty \(0 bytes\)"):
        read_clip(ReadLog(b""), Sampling(frames=1))


def _damaged(data: bytes, packet: int) -> bytes:
    """The file with the middle quarter of one video packet's payload zeroed: bytes lost in
    transit or on disk, which h264 and MPEG-4 decoders conceal with guessed pixels."""
    with av.open(io.BytesIO(data)) as container:
        packets = [(p.pos, p.size) for p in container.demux(container.streams.video[0]) if p.size]
    pos, size = packets[packet]
    start, length = pos + size // 2, max(4, size // 4)
    return data[:start] + bytes(length) + data[start + length :]


@pytest.mark.parametrize("suffix, codec", [(".mp4", "h264"), (".avi", "mpeg4")])
def test_frames_the_decoder_concealed_errors_in_are_refused(tmp_path, suffix, codec):
    path = tmp_path / f"good{suffix}"
    write_video(path, indexed_frames(20), fps=FPS)
    read_clip(path, Sampling(frames=4))  # whole, it reads
    damaged = tmp_path / f"damaged{suffix}"
    damaged.write_bytes(_damaged(path.read_bytes(), packet=1))
    with av.open(str(damaged)) as container:  # the decoder itself flags the frame...
        assert any(f.is_corrupt for f in container.decode(container.streams.video[0]))
    with pytest.raises(VideoError) as caught:  # ...and the guessed pixels never leave
        read_clip(damaged, Sampling(frames=4))
    assert caught.value.source == str(damaged)
    assert f"is damaged (the {codec} decoder concealed errors in it)" in caught.value.reason


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
    with pytest.raises(VideoError, match=r"stride_s=1e-300 gives about 10\^300 sampling times"):
        read_clip(tmp_path / "late.mkv", Sampling(stride_s=1e-300))
    with pytest.raises(VideoError, match=r"stride_s=5e-324 gives about 10\^323 sampling times"):
        read_clip(tmp_path / "late.mkv", Sampling(stride_s=5e-324))  # float(count) overflowed
    with pytest.raises(ValueError, match=r"finite number of seconds, got 1000.*\(401 char"):
        Sampling(stride_s=10**400)  # math.isfinite raised OverflowError
    with pytest.raises(ValueError, match="frames must be at most 10000"):
        Sampling(frames=10**12)
    # refused when the sampling is made, before any video is read (inf failed per video, with
    # Fraction's words; True, 2.5 and '3' passed and failed later)
    for bad in (float("inf"), float("nan"), True, "1", 0, -2.0):
        with pytest.raises(ValueError, match="stride_s must be a positive, finite number"):
            Sampling(stride_s=bad)
    for bad in (2.5, True, "3", 0):
        with pytest.raises(ValueError, match="frames must be a positive integer"):
            Sampling(frames=bad)
    assert Sampling(frames=np.int64(3)).frames == 3 and Sampling(stride_s=np.float32(0.5))
    monkeypatch.setattr(video, "MAX_CLIP_BYTES", 3 * 16 * 16 * 3)
    with pytest.raises(VideoError, match="4 frames of 16x16 sampled .* over the"):
        read_clip(tmp_path / "late.mkv", Sampling(frames=4))
    # the clip holds a copy per sample: 4 of a 2-frame video are 4 frames (counted 2, and
    # frames=10000 of a 2-frame 4K clip asked numpy for 249 GB)
    with pytest.raises(VideoError, match="two.mkv: 4 frames of 16x16 sampled .* over the"):
        read_clip(_encoded(tmp_path, "two.mkv", "matroska", 2, 16, 0), Sampling(frames=4))

    def surprise(*args):  # what a decoder may raise on a file nobody foresaw
        raise RuntimeError("a decoder's surprise")

    monkeypatch.setattr(video, "_decode", surprise)
    with pytest.raises(VideoError, match="late.mkv: cannot be read: RuntimeError: a decoder's"):
        read_clip(tmp_path / "late.mkv", Sampling(frames=1))


def _titled(folder: Path, suffix: str, title: str) -> Path:
    """6 indexed frames whose container and stream carry ``title`` (ASCII) as a tag."""
    path = folder / f"titled{suffix}"
    with av.open(str(path), "w") as container:
        container.metadata["title"] = title
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width = stream.height = SIZE
        stream.metadata["title"] = title
        for pixels in indexed_frames(6):
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.mark.parametrize("suffix", [".mkv", ".avi", ".mp4"])
def test_tags_that_are_not_utf8_do_not_refuse_the_video(tmp_path, suffix):
    """Old muxers and cameras write their tags in Latin-1 (a title "Café" as b"Caf\xe9"): the
    frames are read as from the same file with clean tags (the tags themselves are not used)."""
    clean = _titled(tmp_path, suffix, "Cafe_ at night")
    want = read_clip(clean, Sampling(frames=3))
    latin = tmp_path / f"latin1{suffix}"
    data = clean.read_bytes()
    assert data.count(b"Cafe_") >= 1
    latin.write_bytes(data.replace(b"Cafe_", b"Caf\xe9_"))  # the same length: nothing moves
    got = read_clip(latin, Sampling(frames=3))
    assert got.indices.tolist() == want.indices.tolist() == [1, 3, 5]
    np.testing.assert_array_equal(got.frames, want.frames)
    assert probe(latin) == probe(clean) and probe(latin).frame_count == 6


def test_importing_the_video_modules_loads_neither_av_nor_jax():
    code = ("import sys\n"
            "import vit22b.clients.video, vit22b.clients.video_features, "
            "vit22b.clients.embed_video, vit22b.clients.embed_cli\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('av', 'jax', 'flax')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# Display matrices as ISO/IEC 14496-12 lays them out, (a, b, u, c, d, v, x, y, w): the stored
# frame's point (p, q), q downwards, is shown at (a p + c q + x, b p + d q + y); 16.16 fixed
# point (u, v, w: 2.30). The stored frames are H rows by W columns, white in their top-left
# BLOCK x BLOCK corner; where that corner is shown follows from the mapping, by hand.
ONE, H, W, BLOCK = 1 << 16, 32, 64, 16


def matrix(a: int, b: int, c: int, d: int, x: int = 0, y: int = 0, w: int = 1 << 30) -> list:
    return [a, b, 0, c, d, 0, x, y, w]


PORTRAIT = matrix(0, ONE, -ONE, 0, x=H * ONE)  # what an iPhone writes for a portrait clip
ORIENTED = {  # matrix, (rotation, mirrored), the shown (rows, columns), the white corner
    # (p, q) -> (p, q)
    "upright": (matrix(ONE, 0, 0, ONE), (0, False), (H, W), "top-left"),
    # (p, q) -> (H - q, p): the corner (0, 0) is shown at (H, 0), the right end of the top
    # row of an H-wide frame: turned 90 degrees clockwise
    "portrait": (PORTRAIT, (90, False), (W, H), "top-right"),
    # (p, q) -> (W - p, H - q): upside down
    "upside down": (matrix(-ONE, 0, 0, -ONE, W * ONE, H * ONE), (180, False), (H, W),
                    "bottom-right"),
    # (p, q) -> (q, W - p): (0, 0) at (0, W), the bottom of a W-high frame: counterclockwise
    "portrait the other way": (matrix(0, -ONE, ONE, 0, y=W * ONE), (270, False), (W, H),
                               "bottom-left"),
    # (p, q) -> (W - p, q): mirrored left-right (a front camera's)
    "mirrored": (matrix(-ONE, 0, 0, ONE, x=W * ONE), (0, True), (H, W), "top-right"),
    # (p, q) -> (q, p): transposed, which is mirrored, then turned 270 degrees clockwise
    "transposed": (matrix(0, ONE, ONE, 0), (270, True), (W, H), "top-left"),
    # 90 degrees from a float angle, 16.16-rounded: 0.035 degrees off, within the tolerance
    "portrait, rounded": (matrix(40, ONE, -ONE, 40, x=H * ONE), (90, False), (W, H),
                          "top-right"),
}


def cornered(n: int) -> np.ndarray:
    frames = np.zeros((n, H, W, 3), np.uint8)
    frames[:, :BLOCK, :BLOCK] = 255
    return frames


def white_corners(frame: np.ndarray) -> list[str]:
    half = BLOCK // 2  # inside the block, away from its (lossy) edges
    corners = {"top-left": frame[:half, :half], "top-right": frame[:half, -half:],
               "bottom-left": frame[-half:, :half], "bottom-right": frame[-half:, -half:]}
    return [name for name, patch in corners.items() if patch.mean() > 128]


def mp4_track_matrices(path: Path) -> list[list[int]]:
    """The matrix of each ``moov/trak/tkhd`` box (ISO/IEC 14496-12, 8.3.2), read from the box
    tree: what a phone's MP4 holds, independent of how PyAV or FFmpeg pass it on."""
    data = path.read_bytes()

    def children(start: int, end: int, kind: str) -> list[tuple[int, int]]:
        found = []
        while start + 8 <= end:
            size, name = struct.unpack_from(">I4s", data, start)
            header = 8
            if size == 1:  # a 64-bit size follows
                size, header = struct.unpack_from(">Q", data, start + 8)[0], 16
            elif size == 0:  # to the end of the enclosing box
                size = end - start
            if name == kind.encode():
                found.append((start + header, start + size))
            start += size
        return found

    out = []
    for moov in children(0, len(data), "moov"):
        for trak in children(*moov, "trak"):
            for start, _ in children(*trak, "tkhd"):
                # version and flags (4 bytes); times, track id, reserved and duration (20, or
                # 32 in version 1); reserved (8); layer, group, volume, reserved (8)
                at = start + 4 + (32 if data[start] == 1 else 20) + 16
                out.append(list(struct.unpack_from(">9i", data, at)))
    return out


@pytest.mark.parametrize("case", ORIENTED)
def test_frames_are_turned_upright_by_the_display_matrix(tmp_path, case):
    display, (rotation, mirrored), shape, corner = ORIENTED[case]
    exact = Orientation(rotation, mirrored).apply(cornered(1)[0])  # lossless
    assert exact.shape[:2] == shape and white_corners(exact) == [corner]
    assert exact.flags.c_contiguous  # a copy, not a strided view
    path = tmp_path / "turned.mp4"
    write_video(path, cornered(6), fps=FPS, display_matrix=display)
    assert mp4_track_matrices(path) == [display]  # in the file as a phone writes it
    info = probe(path)
    assert (info.height, info.width, info.rotation, info.mirrored) == (*shape, rotation, mirrored)
    clip = read_clip(path, Sampling(frames=3))
    assert clip.frames.shape == (3, *shape, 3)
    assert [white_corners(f) for f in clip.frames] == [[corner]] * 3
    assert clip.info == info and clip.indices.tolist() == [1, 3, 5]


@pytest.mark.parametrize("suffix", [".mp4", ".mov", ".mkv", ".webm"])
def test_a_portrait_clip_is_its_stored_frames_turned_clockwise_in_each_container(tmp_path,
                                                                               suffix):
    stored = indexed_frames(8)[:, :, : SIZE - 16]  # 64 x 48: not square, so a turn shows
    write_video(tmp_path / f"portrait{suffix}", stored, fps=FPS, display_matrix=PORTRAIT)
    write_video(tmp_path / f"stored{suffix}", stored, fps=FPS)  # the same pixels, no matrix
    turned = read_clip(tmp_path / f"portrait{suffix}", Sampling(frames=4))
    plain = read_clip(tmp_path / f"stored{suffix}", Sampling(frames=4))
    assert plain.frames.shape == (4, 64, 48, 3) and turned.frames.shape == (4, 48, 64, 3)
    # turned clockwise: shown row i is stored column i, read from the bottom row up. The two
    # files are two lossy encodes of the same frames, which x264 and swscale do not always make
    # bit-identical on a loaded host (2 levels apart once in a full suite): within 4 levels,
    # where the other turn is far off.
    clockwise = plain.frames[:, ::-1].transpose(0, 2, 1, 3).astype(int)
    assert np.abs(turned.frames - clockwise).max() <= 4
    assert np.abs(turned.frames - clockwise[:, ::-1, ::-1]).max() > 100  # counter-clockwise
    assert (turned.info.width, turned.info.height, turned.info.rotation) == (64, 48, 90)
    assert turned.indices.tolist() == plain.indices.tolist() == expected_uniform(8, 4)


def test_avi_keeps_no_display_matrix(tmp_path):
    # write_video's documented limit: AVI has nowhere to put one, so its frames stay as stored
    write_video(tmp_path / "portrait.avi", cornered(2), fps=FPS, display_matrix=PORTRAIT)
    info = probe(tmp_path / "portrait.avi")
    assert (info.width, info.height, info.rotation, info.mirrored) == (W, H, 0, False)


def test_display_matrices_that_are_no_exact_turn_are_refused(tmp_path, monkeypatch):
    import vit22b.clients.video as video

    cos, sin = round(ONE * math.cos(math.radians(30))), round(ONE * math.sin(math.radians(30)))
    bad = {
        "tilted.mp4": (matrix(cos, sin, -sin, cos),
                       "turns the frames 30.00 degrees clockwise, not a multiple of 90"),
        "tilted_a_little.mp4": (matrix(ONE, ONE // 200, -ONE // 200, ONE),
                                "turns the frames 0.29 degrees clockwise"),
        "skewed.mp4": (matrix(ONE, 0, ONE // 2, ONE), "skews the frames"),
        "flat.mp4": (matrix(ONE, 0, ONE, 0), "is singular"),
        "perspective.mp4": ([ONE, 0, 5, 0, ONE, 0, 0, 0, 1 << 30], "a perspective transform"),
    }
    for name, (display, words) in bad.items():
        path = tmp_path / name
        write_video(path, cornered(4), fps=FPS, display_matrix=display)
        for read in (probe, lambda p: read_clip(p, Sampling(frames=2))):
            with pytest.raises(VideoError) as caught:
                read(path)
            assert caught.value.source == str(path) and words in caught.value.reason, name

    # a matrix that changes among the frames (as a spliced file could carry): refused
    write_video(tmp_path / "changing.mp4", cornered(6), fps=FPS)
    portrait = struct.pack("=9i", *PORTRAIT)  # native int32, as FFmpeg hands it over
    monkeypatch.setattr(video, "_display_matrix", lambda f: portrait if f.time > 0.25 else None)
    with pytest.raises(VideoError, match=r"changing.mp4: its display matrix \(rotation\) "
                                         r"changes within the video, at frame 3"):
        read_clip(tmp_path / "changing.mp4", Sampling(frames=2))


def scene(width: int, height: int = 48) -> np.ndarray:
    """A shown picture with square pixels: a 16 x 16 white square (its left edge at a third of
    the width) over a smooth horizontal ramp."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[..., 1] = np.linspace(0, 160, width).astype(np.uint8)
    pixels[16:32, width // 3 : width // 3 + 16] = 255
    return pixels


def stored_as(pixels: np.ndarray, width: int) -> np.ndarray:
    """What a camera with non-square pixels stores: the picture squeezed to ``width``."""
    return np.asarray(Image.fromarray(pixels).resize((width, pixels.shape[0]), Image.BICUBIC))


def square_width(frame: np.ndarray) -> int:
    return int((frame[24, :, 0] > 128).sum())  # red: white in the square only


@pytest.mark.parametrize("suffix, aspect, shown", [
    (".mp4", Fraction(3, 2), 96),  # an anamorphic 1.5x lens; HDV's 1440 -> 1920 is 4:3
    (".mkv", Fraction(8, 9), 64),  # DV's 720x480 shown 4:3: pixels taller than wide
    (".mov", Fraction(4, 3), 88),
    (".avi", Fraction(32, 27), 76),  # DV's 16:9
])
def test_frames_of_non_square_pixels_are_resampled_to_square_ones(tmp_path, suffix, aspect,
                                                                  shown):
    stored_width = round(shown / aspect)  # 64, 72, 66, 64
    stored_width += stored_width % 2
    picture = scene(shown)
    path = tmp_path / f"anamorphic{suffix}"
    write_video(path, np.stack([stored_as(picture, stored_width)] * 4), fps=FPS,
                sample_aspect_ratio=aspect)
    expected = math.floor(stored_width * aspect + Fraction(1, 2))  # round(W * SAR), half up
    info = probe(path)
    assert (info.width, info.height) == (expected, 48)
    assert info.sample_aspect_ratio == f"{aspect.numerator}:{aspect.denominator}"
    clip = read_clip(path, Sampling(frames=2))
    assert clip.frames.shape == (2, 48, expected, 3) and clip.info == info
    # the square is square again (stored, it was 16 / SAR wide), and the picture is the shown
    # one within what two resamples and a lossy codec leave
    assert [abs(square_width(f) - 16) <= 1 for f in clip.frames] == [True, True]
    if expected == shown:
        assert np.abs(clip.frames.astype(int) - picture).mean() < 6


def test_square_pixels_then_the_turn(tmp_path):
    # a portrait clip shot with non-square pixels: widened first (its stored rows), then turned
    stored = stored_as(scene(96), 64)
    write_video(tmp_path / "both.mp4", np.stack([stored] * 2), fps=FPS,
                display_matrix=PORTRAIT, sample_aspect_ratio=Fraction(3, 2))
    clip = read_clip(tmp_path / "both.mp4", Sampling(frames=1))
    assert (clip.info.width, clip.info.height, clip.info.rotation) == (48, 96, 90)
    assert clip.frames.shape == (1, 96, 48, 3)
    assert int((clip.frames[0, :, 24, 0] > 128).sum()) == pytest.approx(16, abs=1)  # a column


def test_the_containers_sample_aspect_ratio_wins_and_bad_ones_are_refused(tmp_path,
                                                                           monkeypatch):
    import vit22b.clients.video as video

    write_video(tmp_path / "pasp.mp4", np.stack([stored_as(scene(96), 64)] * 2), fps=FPS,
                sample_aspect_ratio=Fraction(3, 2))  # in x264's VUI and the MP4's pasp box
    data = bytearray((tmp_path / "pasp.mp4").read_bytes())
    at = data.index(b"pasp") + 4  # hSpacing, vSpacing (ISO/IEC 14496-12, 12.1.4)
    assert struct.unpack_from(">II", data, at) == (3, 2)

    def edited(name: str, h: int, v: int) -> Path:
        struct.pack_into(">II", data, at, h, v)
        (tmp_path / name).write_bytes(data)
        return tmp_path / name

    # FFmpeg's rule: the container's when it has one, else the codec's (0 means unknown)
    assert probe(edited("two.mp4", 2, 1)).width == 128
    assert probe(edited("unknown.mp4", 0, 5)).sample_aspect_ratio == "3:2"
    # far past any format's (a damaged header): refused by name, not a frame 17 times as wide
    for name, (h, v), words in [
        ("wide.mp4", (17, 1), "17:1 (a stored pixel's width:height) is beyond 1:16 to 16:1"),
        ("huge.mp4", (196605, 2), "196605:2"),
        ("narrow.mp4", (1, 1000), "1:1000"),
    ]:
        path = edited(name, h, v)
        for read in (probe, lambda p: read_clip(p, Sampling(frames=1))):
            with pytest.raises(VideoError) as caught:
                read(path)
            assert caught.value.source == str(path) and words in caught.value.reason, name
    # the decoded frames' bound counts them at their square size: 96x48, not 64x48
    monkeypatch.setattr(video, "MAX_CLIP_BYTES", 4 * 64 * 48 * 3)
    with pytest.raises(VideoError, match="4 frames of 96x48 sampled"):
        read_clip(tmp_path / "pasp.mp4", Sampling(frames=4))


def spliced(path: Path, parts: list[tuple[int, int, Fraction | None, int]]) -> Path:
    """An MPEG-TS of h264 segments (width, height, SAR or None, frames), each with its own
    in-band SPS: a broadcast recording's 4:3 and 16:9 programmes, or a stream whose size
    changes. The stream's header is its first segment's."""
    with av.open(str(path), "w", format="mpegts") as container:
        stream = container.add_stream("h264", rate=FPS)
        stream.width, stream.height = parts[0][:2]
        start = 0
        for width, height, aspect, count in parts:
            codec = av.CodecContext.create("libx264", "w")
            codec.width, codec.height, codec.pix_fmt = width, height, "yuv420p"
            codec.time_base, codec.framerate = Fraction(1, FPS), FPS
            codec.options, codec.max_b_frames = {"crf": "18"}, 0
            if aspect is not None:
                codec.sample_aspect_ratio = aspect
            packets = []
            for i in range(count):
                frame = av.VideoFrame.from_ndarray(scene(width, height), format="rgb24")
                frame = frame.reformat(format="yuv420p")
                frame.pts, frame.time_base = i, Fraction(1, FPS)
                packets += codec.encode(frame)
            packets += codec.encode(None)
            for packet in packets:  # on the container's 90 kHz clock, after the last segment
                packet.stream = stream  # no B-frames: decoded in presentation order
                packet.pts = packet.dts = (packet.pts + start) * 90_000 // FPS
                packet.time_base = Fraction(1, 90_000)
                container.mux(packet)
            start += count
    return path


def test_a_sample_aspect_ratio_that_changes_within_the_video_is_refused(tmp_path):
    # 4:3 then 16:9 programmes in one recording: no one ratio is right for every frame
    for name, parts in {"to_wide.ts": [(64, 48, None, 4), (64, 48, Fraction(2), 8)],
                        "to_square.ts": [(64, 48, Fraction(2), 4), (64, 48, None, 8)]}.items():
        path = spliced(tmp_path / name, parts)
        with pytest.raises(VideoError, match=r"its sample aspect ratio changes within the video"
                                             r" \((1:1, then 2:1|2:1, then 1:1) by frame \d+\)"):
            read_clip(path, Sampling(frames=1))
    # one ratio throughout, stated in every SPS: read, and resampled; and 1:1 unset in one SPS
    # and stated in the next is one ratio
    steady = spliced(tmp_path / "steady.ts", [(64, 48, Fraction(2), 4), (64, 48, Fraction(2), 8)])
    assert read_clip(steady, Sampling(frames=2)).frames.shape == (2, 48, 128, 3)
    square = spliced(tmp_path / "square.ts", [(64, 48, None, 4), (64, 48, Fraction(1), 8)])
    assert read_clip(square, Sampling(frames=2)).frames.shape == (2, 48, 64, 3)


def test_frames_larger_than_the_streams_header_are_counted_as_they_are(tmp_path, monkeypatch):
    import vit22b.clients.video as video

    # the header says 32x24 (the first SPS); the frames sampled (8 and 24) are 64x48
    path = spliced(tmp_path / "grows.ts", [(32, 24, None, 8), (64, 48, None, 24)])
    assert (probe(path).width, probe(path).height) == (32, 24)
    clip = read_clip(path, Sampling(frames=2))
    assert clip.frames.shape == (2, 48, 64, 3) and clip.indices.tolist() == [8, 24]
    assert (clip.info.width, clip.info.height) == (64, 48)  # the frames', not the header's
    # a bound the header's size fits and the frames do not: refused as they are decoded
    monkeypatch.setattr(video, "MAX_CLIP_BYTES", 2 * 64 * 48 * 3 - 1)
    with pytest.raises(VideoError, match=r"grows.ts: 2 frames of up to 64x48 \(stored\) "
                                         r"sampled are .* over the"):
        read_clip(path, Sampling(frames=2))


def _with_audio(path: Path, video_frames: int, audio_seconds: float) -> Path:
    """An h264 (MKV) or VP9 (WebM) video of ``video_frames`` indexed frames at FPS with an
    Opus / AAC track of ``audio_seconds`` interleaved, as cameras and screen recorders write."""
    webm = path.suffix == ".webm"
    with av.open(str(path), "w") as container:
        video = container.add_stream("libvpx-vp9" if webm else "libx264", rate=FPS)
        video.width = video.height = SIZE
        video.pix_fmt = "yuv420p"
        audio = container.add_stream("libopus" if webm else "aac", rate=48000)
        audio.layout = "mono"
        step, samples = 960, 0
        frames = indexed_frames(video_frames)
        for i in range(max(video_frames, math.ceil(audio_seconds * FPS))):
            if i < video_frames:
                for packet in video.encode(av.VideoFrame.from_ndarray(frames[i], format="rgb24")):
                    container.mux(packet)
            while samples < min((i + 1) / FPS, audio_seconds) * 48000:
                frame = av.AudioFrame.from_ndarray(np.zeros((1, step), np.float32),
                                                   format="fltp", layout="mono")
                frame.sample_rate, frame.pts = 48000, samples
                samples += step
                for packet in audio.encode(frame):
                    container.mux(packet)
        for stream in (video, audio):
            for packet in stream.encode():
                container.mux(packet)
    return path


@pytest.mark.parametrize("suffix", [".webm", ".mkv"])
def test_a_truncated_file_with_audio_is_refused(tmp_path, suffix):
    """Matroska keeps one duration for the file, which with an audio track is no stream's own:
    a truncated recording (every camera's has audio) was read as a shorter video. Every stream
    ending early is refused; a video that ends before its audio is no damage."""
    whole = _with_audio(tmp_path / f"av{suffix}", 40, 4.0)
    assert read_clip(whole, Sampling(frames=4)).indices.tolist() == [5, 15, 25, 35]
    data = whole.read_bytes()
    for fraction in (0.5, 0.7):
        cut = tmp_path / f"cut{suffix}"
        cut.write_bytes(data[: int(len(data) * fraction)])
        with pytest.raises(VideoError, match=r"cut\..*: truncated or damaged: its container "
                                             r"declares 4\.0\d+ s, but its streams end at"):
            read_clip(cut, Sampling(frames=4))
    short = _with_audio(tmp_path / f"short{suffix}", 20, 4.0)  # 2 s of video, 4 s of audio
    clip = read_clip(short, Sampling(frames=4))
    assert clip.indices.tolist() == [2, 7, 12, 17] and clip.info.duration_s == 2.0
    assert [read_index(f) for f in clip.frames] == [2, 7, 12, 17]


def test_frames_an_edit_list_cuts_are_not_counted(tmp_path):
    """An MP4 whose edit list starts 4 frames in (as a cut with `-c copy` writes): `probe`
    counted the cut frames' packets (24 frames, 2.4 s), while the frames shown are 20."""
    path = tmp_path / "cut.mp4"
    frames = indexed_frames(24)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={"bf": "0"})
        stream.width = stream.height = SIZE
        for i, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = i - 4  # the muxer writes the negative start as an edit list
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    info = probe(path)
    assert (info.frame_count, info.duration_s) == (20, 2.0)
    clip = read_clip(path, Sampling(frames=4))
    assert clip.info == info and clip.indices.tolist() == [2, 7, 12, 17]
    assert [read_index(f) for f in clip.frames] == [6, 11, 16, 21]  # 4 frames in


def test_h264_with_b_frames_in_avi_is_read_in_display_order(tmp_path):
    """AVI stores decode times only: x264's B-frames leave the decoder in display order with
    decode-order stamps, which went backwards and refused a file every player shows."""
    path = tmp_path / "bframes.avi"
    assert write_video(path, indexed_frames(N), fps=FPS, codec="libx264") == "libx264"
    with av.open(str(path)) as container:
        stamps = [f.pts for f in container.decode(video=0)]
    assert stamps != sorted(stamps)  # what the file is
    for k in (4, 7, N):
        clip = read_clip(path, Sampling(frames=k))
        assert clip.indices.tolist() == expected_uniform(N, k)
        assert [read_index(f) for f in clip.frames] == expected_uniform(N, k)
    np.testing.assert_allclose(read_clip(path, Sampling(frames=N)).timestamps,
                               np.arange(N) / FPS)
    assert probe(path).frame_count == N


def _cover_art(path: Path, video_frames: int) -> Path:
    """AAC audio with a PNG cover (an attached picture, as music files carry), and before the
    cover, when ``video_frames``, a video stream."""
    from io import BytesIO

    png = BytesIO()
    Image.fromarray(indexed_frames(1)[0]).save(png, "PNG")
    with av.open(str(path), "w") as container:
        video = None
        if video_frames:
            video = container.add_stream("libx264", rate=FPS)
            video.width = video.height = SIZE
        audio = container.add_stream("aac", rate=16000)
        audio.layout = "mono"
        cover = container.add_stream("png")
        cover.width = cover.height = SIZE
        cover.pix_fmt = "rgb24"
        cover.disposition = av.stream.Disposition.attached_pic
        packet = av.Packet(png.getvalue())
        packet.stream, packet.pts, packet.dts = cover, 0, 0
        container.mux(packet)
        for pixels in indexed_frames(video_frames):
            for packet in video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        mux_silence(container, audio, 20)
        for stream in (video, audio) if video else (audio,):
            for packet in stream.encode():
                container.mux(packet)
    return path


def test_cover_art_is_no_video(tmp_path):
    """An audio file's cover is a one-picture 'video' stream to FFmpeg: it was read, and
    refused as 'frames without timestamps'; now it is named for what it is."""
    song = _cover_art(tmp_path / "song.mp4", 0)
    with pytest.raises(VideoError, match=r"song.mp4: no video stream in the mov,mp4.* "
                                         r"\(streams: audio, attached picture \(cover art\)\)"):
        read_clip(song, Sampling(frames=2))
    clip = read_clip(_cover_art(tmp_path / "clip.mp4", 12), Sampling(frames=4))
    assert [read_index(f) for f in clip.frames] == expected_uniform(12, 4)


def test_pyav_19_is_opened_without_the_option_it_dropped():
    """PyAV 19 (the one Python 3.12+ installs) dropped open()'s metadata_errors: every video
    failed with a TypeError. Its tags are decoded leniently there."""
    from types import SimpleNamespace

    from vit22b.clients.video import TAG_ERRORS, _open_options

    assert _open_options(SimpleNamespace(__version__="18.1.0")) == {"metadata_errors": TAG_ERRORS}
    assert _open_options(SimpleNamespace(__version__="19.0.2")) == {}
