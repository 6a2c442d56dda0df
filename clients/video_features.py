"""Videos through the SDK: sampled frames embedded as images, regrouped per video.

``embed_videos(client, videos, frames=K | stride_s=S, ...)`` decodes each video here (PyAV,
``clients/video.py``), sends all the videos' frames in one ``client.embed`` call as raw uint8
pixels (so they share requests, and the server's batches, with each other and with concurrent
work) and returns, per video, the per-frame outputs (``pooled`` [frames, width], patch tokens on
request), their temporal mean and the frames' timestamps. ``FeatureClient.embed_video`` and
``embed_videos`` call it. No jax.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from vit22b.model.features import FEATURE_FIELDS, Features

from .embeddings import ImageError
from .files import as_text
from .inputs import given_id
from .video import Clip, Sampling, VideoError, VideoInfo, VideoSource, read_clips


@dataclass
class FramePlan:
    """The sampled frames of several videos laid end to end, and the way back to each video."""

    clips: list[Clip | VideoError]  # per video, in order

    @classmethod
    def read(
        cls, sources: Sequence[VideoSource], sampling: Sampling, names: Sequence[str] | None = None
    ) -> FramePlan:
        return cls(read_clips(sources, sampling, names))

    @property
    def frames(self) -> list[np.ndarray]:
        """Every readable video's frames, in video order: the images to embed."""
        return [frame for clip in self.clips if isinstance(clip, Clip) for frame in clip.frames]

    @property
    def errors(self) -> dict[int, str]:
        """Video position -> why it could not be read."""
        return {i: c.reason for i, c in enumerate(self.clips) if isinstance(c, VideoError)}

    def regroup(
        self, embedded: Sequence[int], failed: Sequence[tuple[int, str]]
    ) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        """Which result rows belong to which video.

        ``embedded``: the frame (position in ``frames``) of each result row; ``failed``: (frame,
        reason) of frames that did not come back. Returns video -> its result rows (all its
        frames, in order) and video -> reason, for every video (a video with a failed frame
        fails, naming the frame).
        """
        row_of = {int(frame): row for row, frame in enumerate(embedded)}
        reason_of = dict(failed)
        rows, errors = {}, dict(self.errors)
        start = 0
        for video, clip in enumerate(self.clips):
            if not isinstance(clip, Clip):
                continue
            frames = range(start, start + len(clip.frames))
            start = frames.stop
            lost = [f for f in frames if f not in row_of]
            if lost:
                k = lost[0] - frames.start
                why = reason_of.get(lost[0], "not returned")
                errors[video] = f"frame {k} (at {clip.timestamps[k]:.3f} s): {why}"
            else:
                rows[video] = np.asarray([row_of[f] for f in frames], np.int64)
        return rows, errors


@dataclass
class VideoEmbedding:
    """One video's outputs: ``features`` holds one row per sampled frame."""

    id: str
    features: Features  # pooled [frames, width], patch_tokens {layer: [frames, P, width]}, ...
    timestamps: np.ndarray  # float64 [frames], seconds from the first frame's start
    frame_indices: np.ndarray  # int64 [frames], positions in the presentation order
    info: VideoInfo
    model: object = None  # the responses' ModelRef (name, fingerprint, preprocessing, dtype)
    index: int | None = None  # the video's position in the caller's list

    @property
    def pooled(self) -> np.ndarray:
        """Per-frame pooled features [frames, width] (as requested: dtype, L2 normalisation)."""
        return self.features.pooled

    @property
    def temporal_mean(self) -> np.ndarray:
        """The mean over frames of the pooled features [width], in float32 (not renormalised)."""
        if self.features.pooled is None:
            raise ValueError(f"{self.id}: no pooled features were requested")
        return np.asarray(self.features.pooled, np.float32).mean(axis=0)

    @property
    def patch_tokens(self) -> dict[int, np.ndarray]:
        return self.features.patch_tokens


@dataclass
class VideoEmbeddings:
    """The embedded videos in input order (failed ones left out: see ``errors``)."""

    videos: list[VideoEmbedding] = field(default_factory=list)
    errors: list[ImageError] = field(default_factory=list)  # index: the video's position

    def __len__(self) -> int:
        return len(self.videos)

    def __getitem__(self, i: int) -> VideoEmbedding:
        return self.videos[i]


def _sources(videos) -> list[VideoSource]:
    """The caller's videos as a list of sources, refusing anything that is not one (a numpy
    array of decoded frames, say: those go to ``embed``)."""
    if isinstance(videos, (str, os.PathLike, bytes, bytearray, memoryview)) \
            or hasattr(videos, "read"):
        videos = [videos]  # one video (an open file iterates over lines, not videos)
    if isinstance(videos, np.ndarray):
        raise TypeError("videos are paths, bytes or open binary files, not a numpy array "
                        "(decoded frames are images: embed() takes them)")
    out = []
    for i, video in enumerate(videos):
        if isinstance(video, memoryview):
            video = video.tobytes()
        if not (isinstance(video, (str, os.PathLike, bytes, bytearray))
                or hasattr(video, "read")):
            raise TypeError(f"video {i} is a {type(video).__name__}: a video is a path, its "
                            "bytes or an open binary file")
        out.append(video)
    return out


def _ids(videos: Sequence[VideoSource], ids: Sequence[str] | None) -> list[str]:
    if ids is not None:
        if isinstance(ids, (str, bytes)):
            raise TypeError("ids is one text: give a list of ids, one per video")
        ids = [given_id(value, i, "video") for i, value in enumerate(ids)]
        if len(ids) != len(videos):
            raise ValueError(f"{len(ids)} ids for {len(videos)} videos: give one id per video")
        return ids
    return [as_text(os.fspath(v)) if isinstance(v, (str, os.PathLike)) else str(i)
            for i, v in enumerate(videos)]


def embed_videos(
    client,
    videos: Sequence[VideoSource] | VideoSource,
    *,
    frames: int | None = None,
    stride_s: float | None = None,
    ids: Sequence[str] | None = None,
    skip_invalid: bool = False,
    **embed_kwargs,
) -> VideoEmbeddings:
    """Embed the sampled frames of each video (a path, its bytes or an open seekable binary
    file) with ``client.embed``.

    ``frames=K`` (uniform: the centres of K equal segments) or ``stride_s=S`` (every S seconds);
    ``embed_kwargs`` are ``embed``'s (``outputs``, ``layers``, ``dtype``, ``l2_normalize``,
    ...). A video that cannot be decoded, or a frame of which the server refuses, raises
    ``VideoError`` naming the video (and the frame) and the reason, or with ``skip_invalid`` is
    listed in ``errors``. Every video is decoded before anything is sent: for many videos, call
    it batch by batch (as the embed job does).
    """
    videos = _sources(videos)
    sampling = Sampling(frames, stride_s)
    names = _ids(videos, ids)
    plan = FramePlan.read(videos, sampling, names)
    if not skip_invalid:
        for clip in plan.clips:
            if isinstance(clip, VideoError):
                raise clip
    pixels = plan.frames
    # frames are refused one by one, so that a refusal names its video and frame, not its
    # position among all the videos' frames
    result = client.embed(pixels, skip_invalid=True, **embed_kwargs) if pixels else None
    embedded = result.indices if result is not None else []
    failed = [(e.index, e.reason) for e in result.errors] if result is not None else []
    rows, errors = plan.regroup(embedded, failed)
    if errors and not skip_invalid:
        video = min(errors)
        raise VideoError(names[video], errors[video])
    everything = None
    if result is not None:
        everything = Features(**{name: getattr(result, name) for name in FEATURE_FIELDS})
    out = VideoEmbeddings(
        errors=[ImageError(i, names[i], reason) for i, reason in sorted(errors.items())]
    )
    for video, video_rows in sorted(rows.items()):
        clip = plan.clips[video]
        out.videos.append(VideoEmbedding(
            id=names[video],
            features=everything.take(video_rows),
            timestamps=clip.timestamps,
            frame_indices=clip.indices,
            info=clip.info,
            model=result.model,
            index=video,
        ))
    return out
