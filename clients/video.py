"""Video files on the client: probe, sample frames exactly, decode to uint8 RGB; write test clips.

jax-free; PyAV (``pip install 'vit22b[video]'``) is imported on first use, so the base client
install does not need it. Frames leave this module as uint8 ``[H, W, 3]`` arrays and travel to
the server as raw pixels like any other image: each goes through the server's own published
preprocessing (resize, crop, normalise), so a video frame and the same frame sent as an image
get the same features.

Which frames (exact, in rational arithmetic on the container's timestamps):

- the video's frames, in presentation order, start at ``t_0 = 0 < t_1 < ... < t_{N-1}`` seconds
  (each frame's pts minus the first's, times the stream's time base); the video lasts
  ``D = t_{N-1} + d``, ``d`` the last frame's own duration (else the median frame interval,
  else one frame at the stream's average rate);
- the frame *shown at* time ``t`` is the last frame with ``t_i <= t``;
- ``frames=K``: the frames shown at the centres of K equal segments of ``[0, D)``, times
  ``(k + 1/2) * D / K`` for ``k = 0 .. K-1`` (for K > N some frames repeat: K rows always);
- ``stride_s=S``: the frames shown at ``0, S, 2S, ...``, every such time below ``D`` (at least
  one frame).

At a constant rate ``f`` (``t_i = i / f``, ``D = N / f``) that is frame ``floor((2k+1) N / 2K)``
for ``frames=K`` and frame ``floor(j S f)`` for ``stride_s=S``. Timestamps returned are the
chosen frames' own start times.

Decoding is sequential (no seeking: a seek lands on a keyframe, and exact sampling would decode
from there anyway). A demux pass reads the timeline from the packets; the decode pass converts
only the chosen frames to RGB and checks that the decoded frames have that same timeline (when
they do not, e.g. a codec with hidden frames, the choice is redone on the decoded timeline).

Frames are upright: a display matrix (the MP4/MOV ``tkhd`` matrix, Matroska's projection; a
phone's portrait clip is stored landscape with one saying "turn 90 degrees clockwise") is applied
as players and ffmpeg's autorotate apply it, exactly: a turn by a multiple of 90 degrees
(``np.rot90``), after a left-right mirror when the matrix has one (negative determinant).
FFmpeg's decoder puts the stream's matrix on every frame; the first decoded frame's is the
video's (read in the demux pass, so ``probe`` knows it), and every frame must carry the same.
``VideoInfo.width``/``height`` are the upright frames'; ``rotation`` and ``mirrored`` say what
was applied. The matrix's scale and translation are ignored.

Pixels are square: a stream whose stored pixels are not (a sample aspect ratio, SAR, other than
1:1: DV and DVD's 720x480 at 8:9 or 32:27, HDV's 1440x1080 at 4:3, an anamorphic lens's 2:1)
has each chosen frame resampled to ``round(width * SAR)`` x ``height`` (bicubic, in the RGB
conversion), as players show it and ffmpeg's ``scale=iw*sar:ih`` makes it, before it is turned
upright. The SAR is the container's (MP4's ``pasp``, Matroska's display size), else the codec's
(h264's VUI), as FFmpeg guesses it; ``VideoInfo.sample_aspect_ratio`` says which was applied.
A codec's SAR that changes within the video (a broadcast recording's 4:3 and 16:9 segments) is
refused: no one ratio suits all its frames. ``VideoInfo``'s size is the returned frames' (a
stream's header may give another; ``probe`` gives its first frame's).

Refused, with ``VideoError`` naming the file and the reason: a file that cannot be read
(``cannot read file: ...``, as the embed job words it, which a rerun retries), non-video data,
a still image (a one-frame GIF too), no video stream (an attached picture, an audio file's cover
art, is none), no decoder for the codec, no decodable
frame, timestamps that are missing or not increasing, a decode error, a frame the decoder flags as
corrupt (damaged data it concealed with guessed pixels, as h264 and MPEG-4 decoders do; VP8/VP9
decoders flag nothing), a stream that ends more than
``max(2 frame intervals, 5%)`` before the duration its container declares (a truncated file;
where that is the longest stream's, as Matroska's with audio, every stream ending so early), a
frame size that changes among the frames sampled, a display matrix that changes among the frames,
turns them by an angle that is not a multiple of 90 degrees (beyond ``ANGLE_TOLERANCE``), skews
them or is singular, a sample aspect ratio beyond ``MAX_SAMPLE_ASPECT`` either way or changing
among the frames, and a sample over ``MAX_SAMPLES`` times or ``MAX_CLIP_BYTES`` of decoded frames
(counted at the square pixels' size before decoding, and again as they are decoded: a stream's
frames may be larger than its header says).
"""

from __future__ import annotations

import io
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO

import numpy as np
from vit22b.model.errors import is_number

from .files import open_local, os_reason

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi")
# A path, the file's bytes, or an open, seekable binary file (an fsspec file of a remote
# object: read in blocks as PyAV asks, never whole; each pass starts at its beginning).
VideoSource = str | os.PathLike | bytes | bytearray | BinaryIO
# Encoders tried in order for each suffix (the first this PyAV build has).
ENCODERS = {
    ".mp4": ("libx264", "mpeg4"),
    ".mov": ("libx264", "mpeg4"),
    ".mkv": ("libx264", "mpeg4"),
    ".webm": ("libvpx-vp9", "libvpx"),
    ".avi": ("mpeg4",),
}
_TRUNCATION_FRAMES, _TRUNCATION_FRACTION = 2, Fraction(1, 20)
# Bounds of one video's sample: sampling times (their list is built before any decoding), and
# the decoded RGB frames a clip holds at the video's own size (4K: about 160 frames).
MAX_SAMPLES = 10_000
MAX_CLIP_BYTES = 4 << 30
# Degrees a display matrix's turn may be off a multiple of 90 and still count as one: 16.16
# fixed point rounds a written angle by under 0.001 degrees; 0.1 moves a 1000-pixel edge's end
# by under 2 pixels.
ANGLE_TOLERANCE = 0.1
# The widest sample aspect ratio taken, either way: formats use 8:9 to 2:1 (an anamorphic lens);
# far past that a header is damaged, and the resampled frame would be that much wider.
MAX_SAMPLE_ASPECT = 16
# How frames are shown, for a job's identity: outputs written before non-square pixels were
# resampled to square lack it, and a resumed job recomputes what that rule changed.
DISPLAY = "square pixels (a stored width times its sample aspect ratio), turned upright"


class VideoError(ValueError):
    """A video that cannot be used; names the file (or input) and the reason."""

    def __init__(self, source: str, reason: str):
        self.source, self.reason = source, reason
        super().__init__(f"{source}: {reason}")


def is_video(path: str | os.PathLike) -> bool:
    """By extension (``VIDEO_SUFFIXES``)."""
    return os.fspath(path).lower().endswith(VIDEO_SUFFIXES)


def load_av():
    """PyAV, or ModuleNotFoundError naming the extra that brings it."""
    try:
        import av
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "video decoding needs PyAV: pip install 'vit22b[video]'", name="av"
        ) from None
    return av


@dataclass(frozen=True)
class Sampling:
    """Which frames of a video: ``frames=K`` uniformly, or one every ``stride_s`` seconds."""

    frames: int | None = None
    stride_s: float | None = None

    def __post_init__(self) -> None:
        if (self.frames is None) == (self.stride_s is None):
            raise ValueError("give exactly one of frames=K and stride_s=S")
        frames, stride = self.frames, self.stride_s
        if frames is not None and not (is_number(frames, numbers.Integral) and frames >= 1):
            raise ValueError(f"frames must be a positive integer, got {_shown(frames)}")
        if frames is not None and frames > MAX_SAMPLES:
            raise ValueError(f"frames must be at most {MAX_SAMPLES}, got {_shown(frames)}")
        if stride is not None and not (is_number(stride) and _finite(stride) and stride > 0):
            raise ValueError(f"stride_s must be a positive, finite number of seconds, got "
                             f"{_shown(stride)}")

    @property
    def stride(self) -> Fraction:
        """The stride as an exact rational (its decimal meaning: 0.1 is 1/10)."""
        return Fraction(str(self.stride_s))

    def times(self, duration: Fraction) -> list[Fraction]:
        """The sampling times in ``[0, duration)`` (see the module's docstring)."""
        if self.frames is not None:
            return [(2 * k + 1) * duration / (2 * self.frames) for k in range(self.frames)]
        count = max(1, -(-duration // self.stride))  # ceil: every j*S < D
        if count > MAX_SAMPLES:
            many = count if count < 10**9 else f"about 10^{len(str(count)) - 1}"
            raise ValueError(f"stride_s={self.stride_s} gives {many} sampling times over "
                             f"{float(duration):.3f} s, over the {MAX_SAMPLES} allowed")
        return [j * self.stride for j in range(int(count))]

    def describe(self) -> dict:
        """The settings and the rule, e.g. for a job's identity."""
        if self.frames is not None:
            return {"frames": self.frames, "rule": "centres of K equal segments of [0, D)"}
        return {"stride_s": self.stride_s, "rule": "every S seconds from 0 while below D"}


def _shown(value) -> str:
    """A caller's value in a message, cut short (10**400 has 401 digits)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond any float (10**400)
        return False


@dataclass(frozen=True)
class Orientation:
    """What turns a stored frame upright: mirror left-right if ``mirrored``, then turn it
    ``rotation`` degrees clockwise (0, 90, 180 or 270; 90 for a phone's portrait clip)."""

    rotation: int = 0
    mirrored: bool = False

    def apply(self, pixels: np.ndarray) -> np.ndarray:
        """The upright copy of a stored frame [H, W, C] (C-contiguous)."""
        if self.mirrored:
            pixels = pixels[:, ::-1]
        return np.ascontiguousarray(np.rot90(pixels, -self.rotation // 90))  # k < 0: clockwise

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The upright (width, height) of a stored width x height frame."""
        return (height, width) if self.rotation % 180 else (width, height)


UPRIGHT = Orientation()


@dataclass(frozen=True)
class VideoInfo:
    container: str  # the demuxer's name, e.g. "mov,mp4,m4a,3gp,3g2,mj2" or "matroska,webm"
    codec: str  # e.g. "h264", "vp9"
    width: int  # of the upright frames (the stored ones' height, for a rotation of 90 or 270)
    height: int
    frame_count: int  # frames in the timeline (probe: packets; read_clip: decoded frames)
    duration_s: float  # D: the end of the last frame, from the first frame's start
    fps: float  # frame_count / duration_s
    rotation: int = 0  # degrees turned clockwise to make the stored frames upright (Orientation)
    mirrored: bool = False  # mirrored left-right before that turn
    sample_aspect_ratio: str = "1:1"  # a stored pixel's width:height, resampled to square

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Clip:
    """The sampled frames of one video."""

    frames: np.ndarray  # uint8 [K, H, W, 3]
    timestamps: np.ndarray  # float64 [K], seconds from the first frame's start
    indices: np.ndarray  # int64 [K], positions in the presentation order
    info: VideoInfo


@dataclass(frozen=True)
class _Timeline:
    pts: tuple[int, ...]  # presentation timestamps, increasing, in stream time-base units
    end: int  # pts at which the last frame ends

    def seconds(self, time_base: Fraction) -> list[Fraction]:
        return [(p - self.pts[0]) * time_base for p in self.pts]

    def choose(self, sampling: Sampling, time_base: Fraction, name: str) -> list[int]:
        """The index of the frame shown at each sampling time."""
        starts = self.seconds(time_base)
        duration = (self.end - self.pts[0]) * time_base
        try:
            times = sampling.times(duration)
        except ValueError as err:  # too many for this video's length
            raise VideoError(name, str(err)) from None
        chosen, i = [], 0
        for t in times:  # increasing: one forward sweep
            while i + 1 < len(starts) and starts[i + 1] <= t:
                i += 1
            chosen.append(i)
        return chosen


def _name(source: VideoSource, name: str | None) -> str:
    if name:
        return name
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return "<video bytes>" if isinstance(source, (bytes, bytearray)) else "<video file>"


# Tags are read as UTF-8 with undecodable bytes replaced: old muxers and cameras write Latin-1
# titles (b"Caf\xe9"), and PyAV's strict decoding refused the whole video for them. No tag is
# used here. PyAV 19 dropped the option (and decodes tags leniently itself).
TAG_ERRORS = "replace"


def _open_options(av) -> dict:
    return {"metadata_errors": TAG_ERRORS} if int(av.__version__.split(".")[0]) < 19 else {}


def _open(av, source: VideoSource, name: str):
    if isinstance(source, (str, os.PathLike)):  # FFmpeg's reasons would not say it is the file's
        source = os.fspath(source)
        try:
            with open_local(source) as f:  # a regular file (a FIFO would block av.open)
                size = os.fstat(f.fileno()).st_size
        except OSError as err:
            raise VideoError(name, os_reason(err)) from None
        if size == 0:
            raise VideoError(name, "empty file (0 bytes)")
    options = _open_options(av)
    try:
        if isinstance(source, (bytes, bytearray)):
            if not source:
                raise VideoError(name, "empty (0 bytes)")
            return av.open(io.BytesIO(bytes(source)), "r", **options)
        if hasattr(source, "read"):  # an open file: each pass reads it from its start
            if source.seek(0, io.SEEK_END) == 0:
                raise VideoError(name, "empty (0 bytes)")
            source.seek(0)
            return av.open(source, "r", **options)
        return av.open(source, "r", **options)
    except (OSError, av.error.FFmpegError) as err:  # FFmpeg's EIO / EOF: data it cannot parse
        raise VideoError(name, f"not a readable video container ({_ffmpeg(err)}; damaged or "
                         "truncated?)") from None


def _ffmpeg(err) -> str:
    return getattr(err, "strerror", None) or str(err)


def _video_stream(av, container, name: str):
    """The first video stream that is no attached picture (an audio file's cover art),
    refusing still images and codecs without a decoder here."""
    fmt = container.format.name
    if fmt.endswith("_pipe") or fmt == "image2":
        raise _still(container, name)
    if not container.streams:
        raise VideoError(name, f"no streams at all in the {fmt} container (a truncated MP4 or "
                         "MOV, whose index is written last, reads like this)")
    pictures = av.stream.Disposition.attached_pic
    streams = [s for s in container.streams.video if not s.disposition & pictures]
    if not streams:
        kinds = ", ".join("attached picture (cover art)" if s.disposition & pictures else s.type
                          for s in container.streams)
        raise VideoError(name, f"no video stream in the {fmt} container (streams: {kinds})")
    stream = streams[0]
    if stream.codec_context is None:
        raise VideoError(name, f"no decoder here for the video codec of the {fmt} container, or "
                         "a codec it does not describe (a damaged or truncated file?)")
    return stream


def _still(container, name: str) -> VideoError:
    fmt = container.format.name
    if fmt == "webp_pipe":  # FFmpeg's WebP decoder reads one frame: an animated WebP too
        return VideoError(name, "a WebP image, not a video (an animated WebP is not read as "
                          "one: FFmpeg decodes a WebP's first frame only)")
    return VideoError(name, f"a still image ({container.format.long_name}), not a video")


def _display_matrix(frame) -> bytes | None:
    """The frame's display matrix (nine native int32, FFmpeg's layout), None without one."""
    data = frame.side_data.get("DISPLAYMATRIX")
    return None if data is None else bytes(data)


def _orientation(matrix: bytes | None, name: str) -> Orientation:
    """The exact turn (and mirror) a display matrix asks for; refuses any other transform.

    The matrix (a, b, u, c, d, v, x, y, w), ISO/IEC 14496-12's, shows the stored frame's point
    (p, q), q downwards, at (a p + c q + x, b p + d q + y) / (u p + v q + w). Mirroring first
    (p -> -p) then turning clockwise by t gives the columns (a, b) = s (cos t, sin t), s = -1
    when mirrored, and (c, d) = (-sin t, cos t): e.g. a phone's portrait (0, 1, -1, 0) is t = 90,
    what FFmpeg's ``av_display_rotation_get`` calls -90 (counterclockwise) and ffmpeg's
    autorotate undoes with ``transpose=clock``.
    """
    if matrix is None:
        return UPRIGHT
    if len(matrix) != 36:
        raise VideoError(name, f"a display matrix of {len(matrix)} bytes, not 9 int32")
    a, b, u, c, d, v, _, _, w = np.frombuffer(matrix, np.int32).tolist()
    det = a * d - b * c
    if u or v:
        raise VideoError(name, f"its display matrix is a perspective transform (u={u}, v={v})")
    if not w or not det:
        raise VideoError(name, f"its display matrix (a, b, c, d, w = {a}, {b}, {c}, {d}, {w}) "
                         "is singular")
    mirrored = det < 0
    sign = -1 if mirrored else 1
    turn = math.degrees(math.atan2(sign * b, sign * a)) % 360
    second = math.degrees(math.atan2(-c, d)) % 360  # the same turn when nothing skews

    def off(x: float, y: float) -> float:  # the circular distance of two angles
        return abs((x - y + 180) % 360 - 180)

    if off(turn, second) > ANGLE_TOLERANCE:
        raise VideoError(name, f"its display matrix skews the frames (its columns turn them "
                         f"{turn:.2f} and {second:.2f} degrees clockwise)")
    quarter = round(turn / 90) % 4
    if off(turn, 90 * quarter) > ANGLE_TOLERANCE:
        raise VideoError(name, f"its display matrix turns the frames {turn:.2f} degrees "
                         "clockwise, not a multiple of 90: no exact upright frame")
    return Orientation(90 * quarter, mirrored)


def _known(ratio) -> Fraction | None:
    """A ratio PyAV gives, None where it is unknown (unset, 0:1, or negative)."""
    return Fraction(ratio) if ratio is not None and ratio > 0 else None


def _sample_aspect(stream) -> Fraction:
    """A stored pixel's width over its height, as FFmpeg's ``av_guess_sample_aspect_ratio``
    picks it: the container's, else the codec's; 1 when neither says."""
    return (_known(stream.sample_aspect_ratio) or _known(stream.codec_context.sample_aspect_ratio)
            or Fraction(1))


def _ratio(aspect: Fraction) -> str:
    return f"{aspect.numerator}:{aspect.denominator}"


def _square_width(width: int, aspect: Fraction, name: str) -> int:
    """The width of a stored frame resampled to square pixels (rounded half up)."""
    if not Fraction(1, MAX_SAMPLE_ASPECT) <= aspect <= MAX_SAMPLE_ASPECT:
        raise VideoError(name, f"its sample aspect ratio {_ratio(aspect)} (a stored pixel's "
                         f"width:height) is beyond 1:{MAX_SAMPLE_ASPECT} to "
                         f"{MAX_SAMPLE_ASPECT}:1, far past any camera's or format's (a "
                         "damaged header?)")
    shown = math.floor(width * aspect + Fraction(1, 2))
    if shown < 1 <= width:
        raise VideoError(name, f"its sample aspect ratio {_ratio(aspect)} leaves its {width} "
                         "pixels wide frames no pixel wide")
    return shown


def _rgb(frame, aspect: Fraction, name: str) -> np.ndarray:
    """A decoded frame as uint8 RGB [H, W, 3], resampled to square pixels when they are not
    (bicubic, as ffmpeg's ``scale`` filter by default)."""
    if aspect == 1:
        return frame.to_ndarray(format="rgb24")
    width = _square_width(frame.width, aspect, name)
    return frame.reformat(width=width, height=frame.height, format="rgb24",
                          interpolation="BICUBIC").to_ndarray()


def _end(pts: list[int], durations: list[int], stream) -> int:
    """Where the last frame ends: its own duration, else the median interval, else 1/rate."""
    if durations[-1] and durations[-1] > 0:
        return pts[-1] + durations[-1]
    if len(pts) > 1:
        return pts[-1] + int(np.median(np.diff(pts)))
    rate = stream.average_rate or stream.guessed_rate
    step = 1 / (Fraction(rate) * stream.time_base) if rate else 0
    return pts[-1] + max(int(step), 0)


def _timeline(entries: list[tuple[int | None, int | None]], stream, name: str) -> _Timeline:
    """(pts, duration) of each frame -> the timeline; refuses missing or repeated timestamps."""
    if any(p is None for p, _ in entries):
        raise VideoError(name, "frames without timestamps (pts); cannot place them in time")
    ordered = sorted(entries, key=lambda e: e[0])
    pts = [int(p) for p, _ in ordered]
    repeated = next((i for i in range(1, len(pts)) if pts[i] == pts[i - 1]), None)
    if repeated is not None:
        raise VideoError(name, f"two frames share the timestamp {pts[repeated]} (pts)")
    return _Timeline(tuple(pts), _end(pts, [d or 0 for _, d in ordered], stream))


def _demux(av, source, name: str) -> tuple[_Timeline | None, dict]:
    """The timeline from a demux pass (None when packets lack timestamps) and the stream's
    description, with the orientation of its first frame (the only one decoded)."""
    with _open(av, source, name) as container:
        stream = _video_stream(av, container, name)
        meta = _stream_meta(container, stream)
        entries, first, end = [], None, None
        try:
            for packet in container.demux():
                if packet.pts is not None and packet.size:
                    ends = (packet.pts + max(packet.duration or 0, 0)) * packet.time_base
                    end = ends if end is None else max(end, ends)
                if packet.stream_index != stream.index:  # others tell where the file ends only
                    continue
                if packet.size and not packet.is_discard:  # an edit list cut it: never shown
                    entries.append((packet.pts, packet.duration))
                if first is None:  # the last, empty packet flushes the decoder
                    first = next(iter(_decoded(av, packet, name)), None)
                    if first is not None:
                        meta["orientation"] = _orientation(_display_matrix(first), name)
        except av.error.FFmpegError as err:
            raise VideoError(name, f"damaged container ({_ffmpeg(err)})") from None
        if meta["container"] == "gif" and len(entries) == 1:  # animated GIFs are videos
            raise _still(container, name)
        meta["streams_end"] = end
        try:
            return _timeline(entries, stream, name) if entries else None, meta
        except VideoError:  # packets without or with shared timestamps: the frames decide
            return None, meta


def _decoded(av, packet, name: str) -> list:
    """The frames one packet completes (a decoding error is not the container's)."""
    try:
        return packet.decode()
    except av.error.FFmpegError as err:
        raise VideoError(name, f"decoding failed after 0 frames ({_ffmpeg(err)})") from None


class _DecodeOrderStamps(Exception):
    """AVI frames whose stamps go backwards: see ``_decode``'s ``order``."""


def _decode(av, source, name: str, wanted: set[int], order: tuple[int, ...] | None = None):
    """Decode every frame; upright RGB copies of the frames whose pts is in ``wanted``, and the
    orientation applied (the first frame's display matrix, which every frame must carry).

    ``order``: the packets' sorted stamps, for an AVI file, which stores decode times only: with
    B-frames the decoder gives the frames in display order but with their packets' decode-order
    stamps (``_DecodeOrderStamps`` when not given), so the i-th frame shown takes the i-th
    stamp, as players show them."""
    with _open(av, source, name) as container:
        stream = _video_stream(av, container, name)
        stream.thread_type = "AUTO"  # frame and slice threads: the same pixels, sooner
        aspect = _sample_aspect(stream)
        entries, kept, held, codec_aspect = [], {}, 0, None
        last_pts, first, orientation = None, None, UPRIGHT
        avi = container.format.name == "avi"
        try:
            for frame in container.decode(stream):
                pts = frame.pts
                if order is not None:
                    if len(entries) == len(order):
                        raise VideoError(name, f"its decoder gives more frames than its "
                                         f"{len(order)} packets")
                    pts = order[len(entries)]
                if last_pts is not None and pts is not None and pts < last_pts:
                    if avi and order is None:
                        raise _DecodeOrderStamps
                    raise VideoError(name, f"frame timestamps go backwards at pts {pts}")
                last_pts = pts
                if frame.is_corrupt:  # the decoder concealed errors: its pixels are guesses
                    raise VideoError(name, f"frame {len(entries)} is damaged (the "
                                     f"{stream.codec_context.name} decoder concealed errors "
                                     "in it)")
                matrix = _display_matrix(frame)
                if not entries:
                    first, orientation = matrix, _orientation(matrix, name)
                elif matrix != first:
                    raise VideoError(name, f"its display matrix (rotation) changes within the "
                                     f"video, at frame {len(entries)}; the frames of one video "
                                     "must share one")
                now = _known(stream.codec_context.sample_aspect_ratio) or Fraction(1)  # unset: 1:1
                if not entries:
                    codec_aspect = now
                elif now != codec_aspect:  # no one ratio is right for all of its frames
                    raise VideoError(name, f"its sample aspect ratio changes within the video "
                                     f"({_ratio(codec_aspect)}, then {_ratio(now)} by frame "
                                     f"{len(entries)}); the frames of one video must share one")
                entries.append((pts, getattr(frame, "duration", None)))
                if pts in wanted:
                    kept[pts] = orientation.apply(_rgb(frame, aspect, name))
                    held += kept[pts].nbytes  # the stream's size may grow past its header's
                    if held > MAX_CLIP_BYTES:
                        raise _too_large(f"{len(kept)} frames of up to {frame.width}x"
                                         f"{frame.height} (stored) sampled", held, name)
        except av.error.FFmpegError as err:
            raise VideoError(
                name, f"decoding failed after {len(entries)} frames ({_ffmpeg(err)})"
            ) from None
        if not entries:
            raise VideoError(name, f"no decodable frame in its {stream.codec_context.name} stream")
        return _timeline(entries, stream, name), kept, orientation


def _decode_in_order(av, source, name: str, wanted: set[int], timeline: _Timeline | None):
    """``_decode``, again with the packets' stamps in order when an AVI's go backwards."""
    try:
        return _decode(av, source, name, wanted)
    except _DecodeOrderStamps:
        if timeline is None:
            raise VideoError(name, "frame timestamps go backwards, and its packets have none "
                             "to order them by") from None
        return _decode(av, source, name, wanted, timeline.pts)


def _stream_meta(container, stream) -> dict:
    declared, longest = None, False
    if stream.duration:
        declared = stream.duration * stream.time_base
    elif container.duration:
        # AV_TIME_BASE units; Matroska's counts from 0, not from its first frame (start_time).
        # With other streams (audio), it is the longest stream's: measured against theirs.
        declared = Fraction(max(0, container.duration - (container.start_time or 0)), 1_000_000)
        longest = len(container.streams) > 1
    return {
        "container": container.format.name,
        "codec": stream.codec_context.name,
        "width": stream.codec_context.width,  # stored
        "height": stream.codec_context.height,
        "aspect": _sample_aspect(stream),
        "time_base": Fraction(stream.time_base),
        "declared": declared,
        "declared_is_longest": longest,
        "start": Fraction(container.start_time or 0, 1_000_000),
        "streams_end": None,  # seconds, the end of the last packet of any stream (demux pass)
        "orientation": UPRIGHT,  # the first decoded frame's, when one decodes
    }


def _shown_size(meta: dict, orientation: Orientation, name: str) -> tuple[int, int]:
    """The (width, height) of the frames this module gives: square pixels, upright."""
    width = _square_width(meta["width"], meta["aspect"], name)
    return orientation.size(width, meta["height"])


def _info(timeline: _Timeline, meta: dict, orientation: Orientation, name: str) -> VideoInfo:
    duration = (timeline.end - timeline.pts[0]) * meta["time_base"]
    count = len(timeline.pts)
    width, height = _shown_size(meta, orientation, name)
    return VideoInfo(meta["container"], meta["codec"], width, height, count, float(duration),
                     float(count / duration) if duration else 0.0, orientation.rotation,
                     orientation.mirrored, _ratio(meta["aspect"]))


def _check_complete(timeline: _Timeline, meta: dict, name: str) -> None:
    """Refuse a stream that stops well before the duration its container declares."""
    declared = meta["declared"]
    if declared is None:
        return
    tb = meta["time_base"]
    decoded = (timeline.end - timeline.pts[0]) * tb
    ends = f"its frames end at {float(decoded):.3f} s ({len(timeline.pts)} frames)"
    if meta["declared_is_longest"] and meta["streams_end"] is not None:
        # a video shorter than its audio is no damage; every stream ending early is
        decoded = max(decoded, meta["streams_end"] - meta["start"])
        ends = f"its streams end at {float(decoded):.3f} s (the video's {len(timeline.pts)} " \
               "frames earlier still)"
    intervals = np.diff(timeline.pts)
    interval = Fraction(int(np.median(intervals))) * tb if len(intervals) else 0
    if declared - decoded > max(_TRUNCATION_FRAMES * interval, _TRUNCATION_FRACTION * declared):
        raise VideoError(
            name, f"truncated or damaged: its container declares {float(declared):.3f} s, "
            f"but {ends}"
        )


def _fits(count: int, meta: dict, name: str) -> None:
    """Refuse a sample whose decoded frames would hold more than MAX_CLIP_BYTES."""
    width, height = _shown_size(meta, meta["orientation"], name)
    size = count * width * height * 3
    if size > MAX_CLIP_BYTES:
        raise _too_large(f"{count} frames of {width}x{height} sampled", size, name)


def _too_large(what: str, size: int, name: str) -> VideoError:
    return VideoError(name, f"{what} are {size / 2**30:.1f} GiB of RGB, over the "
                      f"{MAX_CLIP_BYTES >> 30} GiB a clip may hold: sample fewer frames")


def probe(source: VideoSource, name: str | None = None) -> VideoInfo:
    """Container, codec, upright size and orientation, frame count and duration from a demux
    pass (which decodes the first frame, for its display matrix; every frame is decoded only
    when the packets carry no timestamps)."""
    av, name = load_av(), _name(source, name)
    timeline, meta = _demux(av, source, name)
    orientation = meta["orientation"]
    if timeline is None:
        timeline, _, orientation = _decode_in_order(av, source, name, set(), None)
    return _info(timeline, meta, orientation, name)


def read_clip(source: VideoSource, sampling: Sampling, name: str | None = None) -> Clip:
    """The frames ``sampling`` chooses, decoded to uint8 RGB, with their timestamps.

    ``source``: a path, the file's bytes, or an open seekable binary file (read from its start,
    in pieces); ``name`` names it in errors (default: the path).
    Any other failure (but memory, or PyAV missing) is this video's ``VideoError`` too: a
    decoder's surprise on one odd file must not stop a job over many.
    """
    shown = _name(source, name)
    try:
        return _read_clip(source, sampling, shown)
    except (VideoError, MemoryError, ImportError):  # ImportError: no PyAV here, say so
        raise
    except Exception as err:  # noqa: BLE001 - see the docstring
        raise VideoError(shown, f"cannot be read: {type(err).__name__}: {err}") from err


def _read_clip(source: VideoSource, sampling: Sampling, name: str) -> Clip:
    av = load_av()
    timeline, meta = _demux(av, source, name)
    time_base = meta["time_base"]
    for _ in range(2):
        wanted = set()
        if timeline is not None:
            chosen = timeline.choose(sampling, time_base, name)
            _fits(len(chosen), meta, name)  # the clip holds a copy per sample, repeats too
            wanted = {timeline.pts[i] for i in chosen}
        decoded, kept, orientation = _decode_in_order(av, source, name, wanted, timeline)
        if decoded == timeline:
            break
        timeline = decoded  # the packets' timeline was not the frames': choose again
    else:
        raise VideoError(name, "decoding gives a different timeline on each pass")
    _check_complete(timeline, meta, name)
    chosen = timeline.choose(sampling, time_base, name)
    starts = timeline.seconds(time_base)
    frames = [kept[timeline.pts[i]] for i in chosen]
    sizes = {frame.shape for frame in frames}
    if len(sizes) > 1:
        shown = " and ".join(f"{w}x{h}" for h, w, _ in sorted(sizes))
        raise VideoError(name, f"its frame size changes within the video ({shown} among the "
                         "frames sampled); the frames of one video must share a size")
    (height, width, _), = sizes  # the frames', where the stream's header said another size
    if len(frames) * frames[0].nbytes > MAX_CLIP_BYTES:  # repeated samples are copies too
        raise _too_large(f"{len(frames)} frames of {width}x{height} sampled",
                         len(frames) * frames[0].nbytes, name)
    return Clip(
        frames=np.stack(frames),
        timestamps=np.asarray([float(starts[i]) for i in chosen], np.float64),
        indices=np.asarray(chosen, np.int64),
        info=replace(_info(timeline, meta, orientation, name), width=width, height=height),
    )


def read_clips(
    sources: Sequence[VideoSource], sampling: Sampling, names: Sequence[str] | None = None
) -> list[Clip | VideoError]:
    """``read_clip`` of each source; a video that cannot be read gives its ``VideoError``."""
    out: list[Clip | VideoError] = []
    for i, source in enumerate(sources):
        try:
            out.append(read_clip(source, sampling, names[i] if names else None))
        except VideoError as err:
            out.append(err)
    return out


def encoder_for(path: str | os.PathLike, codec: str | None = None) -> str:
    """The encoder ``write_video`` uses for a file name: ``codec``, or the first of
    ``ENCODERS[suffix]`` this PyAV build has."""
    av = load_av()
    suffix = Path(path).suffix.lower()
    candidates = (codec,) if codec else ENCODERS.get(suffix, ())
    for candidate in candidates:
        try:
            av.codec.Codec(candidate, "w")
            return candidate
        except Exception:  # noqa: BLE001 - av raises UnknownCodecError (not exported everywhere)
            continue
    raise ValueError(f"no encoder for {path} here (tried {', '.join(candidates) or 'none'})")


def write_video(
    path: str | os.PathLike,
    frames: np.ndarray,
    fps: int = 8,
    codec: str | None = None,
    display_matrix: Sequence[int] | None = None,
    sample_aspect_ratio: Fraction | None = None,
) -> str:
    """Encode uint8 frames [T, H, W, 3] (H, W even) to ``path`` at ``fps``; returns the codec.

    High quality (x264 CRF 18; 2 Mbit/s otherwise), yuv420p: for tests, demos and benchmarks.
    Converted and encoded on one thread each, which makes two encodes of the same frames alike
    more often under CPU load, not always (tests compare encodes within a few levels).
    ``display_matrix``: nine integers (a, b, u, c, d, v, x, y, w; 16.16 fixed point, u, v, w
    2.30) for the stream, as a phone writes its portrait clips; MP4, MOV and Matroska/WebM
    keep it, AVI drops it. ``sample_aspect_ratio``: a stored pixel's width over its height, as
    a DV camera writes 8:9; x264 (its VUI) and MPEG-4 part 2 (its header) keep it where FFmpeg
    takes it for the frame size (not 16:1 at 2x2), MPEG-2 rounds it to its table, and VP8 and
    VP9 have no field for it (a WebM drops it): tests read back ``probe``'s.
    """
    av = load_av()
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or not len(frames):
        raise ValueError(f"frames must be uint8 [T, H, W, 3], T >= 1; got {frames.dtype} "
                         f"{list(frames.shape)}")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise ValueError(f"yuv420p needs an even height and width, got {frames.shape[1:3]}")
    codec = encoder_for(path, codec)
    options = {"crf": "18"} if codec == "libx264" else {}
    with av.open(os.fspath(path), "w") as container:
        stream = container.add_stream(codec, rate=fps, options=options)
        stream.codec_context.thread_count = 1
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        if display_matrix is not None:
            stream.set_display_matrix(display_matrix)
        if sample_aspect_ratio is not None:
            stream.codec_context.sample_aspect_ratio = Fraction(sample_aspect_ratio)
        if codec != "libx264":
            stream.bit_rate = 2_000_000
        for pixels in frames:
            # converted here, on one thread: swscale's threaded RGB -> YUV conversion gave
            # other bits now and then under CPU load, and tests compare two encodes
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame.reformat(format="yuv420p", threads=1)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return codec
