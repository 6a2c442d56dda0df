"""`vit22b embed --frames K`: a job over videos, through any backend's workers.

Each worker of the job's backend is wrapped: a batch of videos is decoded here (PyAV, in the
worker's thread), all their sampled frames go to the inner worker's ``embed_images`` as raw
uint8 pixels (frames of several videos share requests), and the rows come back regrouped per
video. Stored per video (one row of each array):

    frames.pooled            [K, width]       per-frame pooled features
    frames.class_token       [K, width]       (when asked for)
    frames.patch_tokens.L    [K, P, width]    (when asked for)
    mean.pooled              [width]          the temporal mean of frames.pooled (float32
                                              mean of the stored values, then the job's dtype)
    mean.class_token         [width]          (when asked for)
    timestamps               [K] float64      seconds from the first frame's start
    frame_indices            [K] int64        positions in the presentation order

Inputs may be local paths or fsspec URLs; PyAV reads either as it decodes (a remote object
through an fsspec file, in blocks, so a long video never sits whole in memory). A
video that cannot be read or decoded, or one of whose frames the server refused, is a failure
with its reason in ``errors.jsonl``. The sampling settings are part of the job's identity, so a
rerun with other settings is refused. Only ``--frames K`` is offered: a job stores a fixed row
shape per output, and a stride in seconds gives each video its own frame count (the SDK's
``embed_videos(stride_s=S)`` serves that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .embed import BatchResult, to_stored
from .embed_inputs import InputItem
from .files import os_reason
from .storage import filesystem, is_url, local_path
from .video import Clip, Sampling, VideoError, probe, read_clip
from .video_features import FramePlan

FRAMES, MEAN = "frames.", "mean."
TIMESTAMPS, FRAME_INDICES = "timestamps", "frame_indices"
_MEANS = ("pooled", "class_token")  # the outputs with one vector per frame


def _opened(item: InputItem, read: Callable):
    """``read(source, name=...)`` of a local file by its path, of a URL through an fsspec file
    (PyAV reads either); an OSError is that video's VideoError."""
    try:
        if is_url(item.path):
            fs, inner = filesystem(item.path)
            with fs.open_read(inner) as remote:
                return read(remote, name=item.id)
        return read(local_path(item.path), name=item.id)
    except OSError as err:
        raise VideoError(item.id, os_reason(err)) from None


def shown_otherwise_before(item: InputItem) -> bool:
    """Whether a vit22b before ``video.DISPLAY`` may have shown this video's frames otherwise:
    its pixels are not square (not resampled before 2026-12-07), it has a display matrix that
    turns or mirrors it (not applied before 2026-12-02), or it cannot be read now (its shard is
    recomputed, and records why)."""
    try:
        info = _opened(item, probe)
    except Exception:  # noqa: BLE001 (whatever it is, the recomputed shard records it)
        return True
    return info.sample_aspect_ratio != "1:1" or info.rotation != 0 or info.mirrored


def video_arrays(image_arrays: dict[str, dict], sampling: Sampling) -> dict[str, dict]:
    """The job's stored arrays for videos, from its per-image arrays."""
    if sampling.frames is None:
        raise ValueError(
            "the embed job stores a fixed number of frames per video: use --frames K "
            "(a stride in seconds gives each video its own count; the SDK's "
            "embed_videos(stride_s=S) does that)"
        )
    k = sampling.frames
    arrays = {FRAMES + name: {**spec, "shape": [k, *spec["shape"]]}
              for name, spec in image_arrays.items()}
    arrays |= {MEAN + name: spec for name, spec in image_arrays.items() if name in _MEANS}
    arrays[TIMESTAMPS] = {"dtype": "float64", "shape": [k]}
    arrays[FRAME_INDICES] = {"dtype": "int64", "shape": [k]}
    return arrays


class VideoWorker:
    """A job worker over videos, around a worker that embeds images."""

    def __init__(self, inner, sampling: Sampling, dtype: str):
        self.inner, self.sampling, self.dtype = inner, sampling, dtype
        self.name = inner.name

    def embed(self, items: Sequence[InputItem]) -> BatchResult:
        plan = FramePlan([self._read(item) for item in items])
        frames = plan.frames
        result = self.inner.embed_images(frames) if frames else BatchResult([], {}, [])
        rows, errors = plan.regroup(result.rows, result.failed)
        failed, videos = sorted(errors.items()), sorted(rows)
        if not videos:
            return BatchResult([], {}, failed)
        arrays = {
            TIMESTAMPS: np.stack([plan.clips[v].timestamps for v in videos]),
            FRAME_INDICES: np.stack([plan.clips[v].indices for v in videos]),
        }
        for name, array in result.arrays.items():
            per_video = [array[rows[v]] for v in videos]
            arrays[FRAMES + name] = np.stack(per_video)
            if name in _MEANS:
                means = np.stack([np.asarray(a, np.float32).mean(axis=0) for a in per_video])
                arrays[MEAN + name] = to_stored(means, self.dtype)
        return BatchResult(videos, arrays, failed)


    def _read(self, item: InputItem) -> Clip | VideoError:
        try:
            return _opened(item, lambda source, name: read_clip(source, self.sampling, name))
        except VideoError as err:
            return err


class VideoBackend:
    """The job's backend with every worker taking videos."""

    def __init__(self, inner, sampling: Sampling, dtype: str):
        self.inner, self.sampling, self.dtype = inner, sampling, dtype
        self.model = inner.model
        self.max_image_pixels = inner.max_image_pixels  # its frames go to the inner workers

    def workers(self) -> list[VideoWorker]:
        return [VideoWorker(w, self.sampling, self.dtype) for w in self.inner.workers()]

    def close(self) -> None:
        self.inner.close()
