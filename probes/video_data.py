"""Video data for the probes: the shapes world animated, written as real video files, and loaders.

A *moving-shapes* video is one shapes-world object (silhouette, texture and palette drawn at
random: nuisances) over a static hazy ground, moving in depth at constant speed: its class is
the direction of that motion, approaching or receding. The object grows and its haze thins as it
nears (the shapes world's size-from-depth and fog), or the reverse. Its log-depth moves by the
same amount either way, symmetric about the middle frame, whose depth is drawn from one range
for both classes: neither a single frame (the middle one is at progress 0 for odd frame counts)
nor the mean over frames (the same set of sizes either way) tells the classes apart; only the
order of the frames does. Pooled features of any backbone, random weights included, see the
object's size, so the default model can show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data import (
    _FOG_DEPTH,
    _HAZE,
    _PALETTES,
    SHAPES,
    TEXTURES,
    DataError,
    _pattern,
    _silhouette,
    check_world_bytes,
)
from .features import identity_meta

DIRECTIONS = ("approaching", "receding")
_LOG_DEPTH_TRAVEL = 0.8  # log-depth change over a clip: sizes change by e^0.8 = 2.2x


@dataclass
class MovingWorld:
    """Videos [N, T, S, S, 3] uint8, their direction labels, and the nuisance classes."""

    videos: np.ndarray
    labels: np.ndarray  # [N] index into DIRECTIONS
    shape: np.ndarray  # [N] index into SHAPES
    texture: np.ndarray  # [N] index into TEXTURES
    depth: np.ndarray  # [N, T] the object's depth in each frame
    fps: int
    class_names: tuple[str, ...] = DIRECTIONS

    def __len__(self) -> int:
        return len(self.videos)


def moving_world(
    n: int, seed: int = 0, frames: int = 17, size: int = 64, fps: int = 8
) -> MovingWorld:
    """``n`` seeded moving-shapes videos of ``frames`` frames (the same seed, the same videos);
    classes balanced."""
    if n < len(DIRECTIONS) or frames < 2 or size < 32 or size % 2:
        raise ValueError(f"moving_world needs n >= 2, frames >= 2 and an even size >= 32; got "
                         f"n={n}, frames={frames}, size={size}")
    check_world_bytes(f"a moving world of {n} videos of {frames} frames of {size}x{size}",
                      n * frames * size * size * 3)
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % len(DIRECTIONS))
    shapes = rng.integers(0, len(SHAPES), n)
    textures = rng.integers(0, len(TEXTURES), n)
    y, x = np.mgrid[:size, :size].astype(np.float32)
    # Along the path, per frame: 0 at the middle frame (odd ``frames``), alike for each class.
    progress = np.linspace(-0.5, 0.5, frames, dtype=np.float32)
    videos = np.empty((n, frames, size, size, 3), np.uint8)
    depth = np.empty((n, frames), np.float32)
    for i in range(n):
        ground = _ground(size, rng)
        palette = _PALETTES[textures[i]]
        sign = -1.0 if labels[i] == 0 else 1.0  # approaching: the depth decreases
        depth[i] = depths = rng.uniform(2.0, 3.0) * np.exp(sign * _LOG_DEPTH_TRAVEL * progress)
        cx, cy = rng.uniform(0.4 * size, 0.6 * size, 2)
        for t, z in enumerate(depths):
            radius = size * 0.75 / z  # the shapes world's size from depth
            fog = np.exp(-z / _FOG_DEPTH)
            u, v = (x - cx) / radius, (y - cy) / radius
            obj = _silhouette(SHAPES[shapes[i]], u, v)
            w = _pattern(TEXTURES[textures[i]], u * 8, v * 8, rng)[..., None]  # on the object
            fill = (palette[0] * (1 - w) + palette[1] * w) * fog + _HAZE * (1 - fog)
            rgb = np.where(obj[..., None], fill, ground)
            videos[i, t] = np.clip(rgb * 255 + 0.5, 0, 255).astype(np.uint8)
    return MovingWorld(videos, labels, shapes, textures, depth, fps)


def _ground(size: int, rng: np.random.Generator) -> np.ndarray:
    """A static ground: dark muted tones with faint noise, hazier toward the top."""
    rows = (np.arange(size, dtype=np.float32) + 0.5) / size
    depth = 1.0 / (0.08 + rng.uniform(0.25, 0.8) * rows)
    base = 0.25 + 0.05 * rng.standard_normal((size, size, 1)).astype(np.float32)
    fog = np.exp(-depth / _FOG_DEPTH)[:, None, None]
    return base * np.array([0.9, 1.0, 0.8], np.float32) * fog + _HAZE * 0.6 * (1 - fog)


def write_moving_world(world: MovingWorld, folder: str | Path, suffix: str = ".mp4") -> list[Path]:
    """One file per video, ``<folder>/<direction>/<index>.<suffix>`` (class subfolders, as
    ``load_video_folder`` reads them); returns the paths in the world's order."""
    from vit22b.clients.video import write_video

    folder = Path(folder)
    paths = []
    for i, (video, label) in enumerate(zip(world.videos, world.labels)):
        path = folder / world.class_names[label] / f"{i:05d}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_video(path, video, fps=world.fps)
        paths.append(path)
    return paths


@dataclass
class LabelledVideos:
    paths: list[Path]
    labels: np.ndarray
    class_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.paths)


def load_video_folder(root: str | Path) -> LabelledVideos:
    """A folder of class subfolders of video files (``root/<class>/<video>``), classes sorted."""
    from vit22b.clients.video import is_video

    from .data import class_folder_files, labels_from_folders

    root = Path(root)
    paths = class_folder_files(root, is_video, "video")
    if not paths:
        raise DataError(f"{root}: no videos in class subfolders (expected {root}/<class>/<video>"
                        " with .mp4, .webm, .mkv, .mov or .avi files)")
    return LabelledVideos(paths, *labels_from_folders(paths))


def video_features(
    paths, frames: int, *, server: str | None = None, token: str | None = None,
    tls: bool | str = False, model: str | None = None, seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Pooled features [N, frames, d] of ``frames`` uniformly sampled frames per video, their
    timestamps [N, frames] and where they came from: through a server (the SDK's
    ``embed_videos``) or in process (decoded here, the backbone with ``seed``'s weights)."""
    from vit22b.clients.video import Sampling, VideoError, read_clips

    paths = [str(p) for p in paths]
    if server:
        from vit22b.clients import FeatureClient

        with FeatureClient(server, token=token, tls=tls) as client:
            try:
                result = client.embed_videos(paths, frames=frames, outputs=["pooled"])
            except VideoError as err:
                raise DataError(str(err)) from None
            info = client.model_info()
        pooled = np.stack([np.asarray(v.pooled, np.float32) for v in result.videos])
        stamps = np.stack([v.timestamps for v in result.videos])
        from vit22b.v1 import wire

        meta = {"source": server, **identity_meta(wire.identity_of(info))}
        return pooled, stamps, meta
    from .features import features_from_model

    clips = read_clips(paths, Sampling(frames=frames))
    for clip in clips:
        if isinstance(clip, VideoError):
            raise DataError(str(clip))
    # a list: clips of other sizes and shapes each go through the pixel contract
    features = features_from_model([frame for c in clips for frame in c.frames], model=model,
                                   seed=seed)
    pooled = features.require("pooled").reshape(len(paths), frames, -1)
    return pooled, np.stack([c.timestamps for c in clips]), dict(features.meta)


def video_features_from_embed_folder(path) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
    """Per-frame pooled features [N, K, d], timestamps [N, K] and video paths of a
    ``vit22b embed --frames K`` output folder, with the job's model identity."""
    from vit22b.clients.embed_video import FRAMES, TIMESTAMPS

    from .features import open_embed_output

    if Path(path).is_file():
        raise DataError(f"{path}: a file; the video probe reads a `vit22b embed --frames K` "
                        "output folder (a --save-features .npz holds image features)")
    outputs = open_embed_output(path, "videos")
    name = FRAMES + "pooled"
    if name not in outputs.names:
        raise DataError(f"{path}: no {name!r} (its outputs: {outputs.names}); the video probe "
                        "reads a `vit22b embed --frames K` output with pooled features")
    identity = outputs.manifest.get("identity", {})
    meta = {"source": str(path), **identity_meta(identity), "video": identity.get("video"),
            "left_out": len(outputs.failed)}
    frames = np.asarray(outputs[name], np.float32)
    return frames, np.asarray(outputs[TIMESTAMPS]), outputs.paths, meta
