"""`make demo`'s video step: moving-shapes videos through the SDK and the batch job.

While the demo's server runs: a seeded moving-shapes world written as MP4 files (h264), one
video through the SDK (``embed_video``: per-frame pooled features, temporal mean, timestamps),
then the whole folder through `vit22b embed --server ... --frames K`; the stored per-frame
features come back for ``vit22b probe video``'s heads.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from vit22b.clients import FeatureClient
from vit22b.clients.demo import video_summary

from .data import labels_from_folders
from .video import VideoFeatures
from .video_data import moving_world, video_features_from_embed_folder, write_moving_world

FRAMES = 9  # odd: the middle sampled frame is the clip's middle frame


def video_step(address: str, out: Path, videos: int, seed: int) -> VideoFeatures:
    world = moving_world(videos, seed=seed)
    folder, embeddings = out / "data" / "moving-world", out / "embeddings" / "moving-world"
    paths = write_moving_world(world, folder)
    print(f"demo: {videos} moving-shapes videos (approaching or receding) written to {folder}")
    with FeatureClient(address) as client:
        t0 = time.perf_counter()
        one = client.embed_video(paths[0], frames=FRAMES)
        print("\n" + video_summary(one, time.perf_counter() - t0) + "\n")
    print(f"demo: vit22b embed {folder} --frames {FRAMES} ({videos} videos)")
    t0 = time.perf_counter()
    command = [
        sys.executable, "-m", "vit22b.clients.cli", "embed", str(folder), "--server", address,
        "--output", str(embeddings), "--frames", str(FRAMES), "--quiet",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    rate = videos / (time.perf_counter() - t0)
    print(f"      {rate:.0f} videos/s ({rate * FRAMES:.0f} frames/s) through the batch job")
    frames, stamps, stored, meta = video_features_from_embed_folder(embeddings)
    return VideoFeatures(frames, *labels_from_folders(stored), stamps, meta)
