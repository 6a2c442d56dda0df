"""`make demo`: the feature service end to end on one machine.

Starts `vit22b serve` with the embedded default (the tiny ViT-22B-recipe preset, seeded random
weights) on 8 emulated CPU devices as a ``data=2,model=4`` mesh, embeds the cue-conflict sample
(``SAMPLE``, the workplace's data beside the checkout; ``--images`` for another folder of
``<class>/<name>.png``) through the client SDK, prints a summary and stops the server with
SIGTERM. This module is a client: it never imports jax (the server is a subprocess).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .client import FeatureClient
from .embeddings import Embeddings

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT.parent / "shared" / "data" / "cue-conflict-sample"
MESH, DEVICES = "data=2,model=4", 8
LAYER = -1  # patch tokens of the last block, besides the pooled feature


@contextmanager
def served(
    mesh: str = MESH, devices: int = DEVICES, args: tuple[str, ...] = (), startup_s: float = 600.0
) -> Iterator[str]:
    """`vit22b serve` in a subprocess on ``devices`` emulated CPU devices; yields its address.

    Leaving the block sends SIGTERM (drain, exit 0) and checks the exit code.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    command = [
        sys.executable,
        "-m",
        "vit22b.clients.cli",
        "serve",
        "--mesh",
        mesh,
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--log-level",
        "WARNING",
        *args,
    ]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    address = _wait_serving(proc, startup_s)
    echo = threading.Thread(target=_echo, args=(proc,), daemon=True)
    echo.start()
    try:
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        echo.join(5)
        if code != 0:
            raise RuntimeError(f"the server exited with code {code} after SIGTERM")


def _wait_serving(proc: subprocess.Popen, timeout: float) -> str:
    end = time.monotonic() + timeout
    for line in proc.stdout:
        print(f"  [server] {line.rstrip()}", flush=True)
        match = re.search(r"SERVING .* on (\S+),", line)
        if match:
            return match[1]
        if time.monotonic() > end:
            break
    proc.kill()
    raise RuntimeError("the server did not report SERVING (its output is above)")


def _echo(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        print(f"  [server] {line.rstrip()}", flush=True)


def sample_images(folder: Path = SAMPLE) -> list[Path]:
    paths = sorted(p for p in folder.glob("*/*.png"))
    if not paths:
        raise SystemExit(f"demo: no images in {folder} (expected <category>/<name>.png)")
    return paths


def summary(result: Embeddings, paths: list[Path], folder: Path, info, seconds: float) -> str:
    categories = Counter(p.parent.name for p in paths)
    compute_ms = sum(t.compute_ms for t in result.timings)
    queue_ms = max((t.queue_ms for t in result.timings), default=0.0)
    norms = np.linalg.norm(result.pooled.astype(np.float32), axis=1)
    lines = [
        f"model       {info.model.name} ({info.parameter_count:,} parameters), weights "
        f"{info.source}"
        + (" (random: the features carry no meaning)" if info.source.startswith("init:") else ""),
        f"mesh        {info.mesh.spec} on {info.mesh.num_devices} {info.mesh.platform} devices; "
        f"batch buckets {list(info.limits.batch_buckets)}",
        f"traceable   fingerprint {result.model.fingerprint}, preprocessing "
        f"{result.model.preprocess_hash}",
        f"images      {len(result)} from {len(categories)} categories in {folder}",
        f"pooled      {result.pooled.shape} {result.pooled.dtype}, L2 norms "
        f"{norms.min():.2f}..{norms.max():.2f}",
        f"patches     layer {LAYER}: {result.patch_tokens[LAYER].shape} "
        f"{result.patch_tokens[LAYER].dtype}",
        f"throughput  {len(result) / seconds:.1f} images/s end to end ({seconds:.2f} s: "
        f"{len(result.timings)} requests, server compute {compute_ms:.0f} ms summed over "
        f"requests, longest queue wait {queue_ms:.0f} ms)",
    ]
    return "\n".join(lines)


def video_summary(video, seconds: float) -> str:
    """One ``embed_video`` result (``video_features.VideoEmbedding``) in a few lines."""
    info, stamps = video.info, ", ".join(f"{t:.2f}" for t in video.timestamps)
    return "\n".join([
        f"video       {video.id}: {info.codec} in {info.container.split(',')[0]}, "
        f"{info.width}x{info.height}, {info.frame_count} frames, {info.duration_s:.3f} s at "
        f"{info.fps:g} fps",
        f"frames      {len(video.timestamps)} sampled at {stamps} s (centres of equal segments)",
        f"features    pooled {video.pooled.shape} per frame, temporal mean "
        f"{video.temporal_mean.shape}; {seconds * 1000:.0f} ms decode + embed",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vit22b.clients.demo", description=__doc__)
    parser.add_argument("--images", type=Path, default=SAMPLE, help="folder of <class>/<x>.png")
    args = parser.parse_args(argv)
    paths = sample_images(args.images)
    print(
        f"demo: starting `vit22b serve` (embedded default) on {DEVICES} emulated CPU devices, "
        f"mesh {MESH}",
        flush=True,
    )
    # Compile both output sets used below before SERVING, so no request waits for a compile.
    warm = ("--warm-outputs", "pooled", "--warm-outputs", f"pooled+patch:{LAYER}")
    with served(args=warm) as address, FeatureClient(address) as client:
        info = client.model_info()
        print(f"demo: embedding {len(paths)} images through the SDK at {address}", flush=True)
        start = time.perf_counter()
        result = client.embed(paths, outputs=["pooled"], layers=[LAYER], batch_size=8)
        seconds = time.perf_counter() - start
        print("\n" + summary(result, paths, args.images, info, seconds) + "\n", flush=True)
        print("demo: stopping the server (SIGTERM: drain, then exit)", flush=True)
    print("demo: server stopped cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
