"""Start-up: seconds from process start to SERVING, cold and with the compilation cache warm;
and the same for a one-image `vit22b embed --local` job and for `vit22b init`, start to exit.

    python benchmarks/startup.py                     # the embedded default and vit-22b-base/14
    python benchmarks/startup.py --models vit-22b-tiny/16 --repeats 1

For each model: a cold start (an empty --compile-cache folder), then warm starts reusing that
folder; each process is started afresh (``vit22b serve``, 2 emulated CPU devices as the CLI
asks), timed until it prints SERVING, then stopped with SIGTERM. Then a one-image local job of
that model, into a new output folder each time, cold and warm the same way; then `vit22b init`
of that model's seeded weights (its init program compiled or read), the same way. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import emit, log, machine, median

ROOT = Path(__file__).resolve().parents[1]


def time_to_serving(model: str, cache: str, extra: list[str] | None = None) -> tuple[float, str]:
    """Seconds from spawning ``vit22b serve`` to its SERVING line; returns (seconds, address)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-m", "vit22b.clients.cli", "serve", "--model", model,
               "--port", "0", "--metrics-port", "-1", "--compile-cache", cache,
               "--log-level", "WARNING", *(extra or [])]
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            match = re.search(r"SERVING .* on (\S+),", line)
            if match:
                return time.perf_counter() - start, match[1]
        raise RuntimeError(f"vit22b serve exited without SERVING (exit {proc.wait()})")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)


def time_command(*args: str) -> float:
    """Seconds of ``vit22b ARGS``, start to exit (it must succeed)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-m", "vit22b.clients.cli", *args]
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
    return time.perf_counter() - start


def one_image(folder: Path) -> Path:
    import numpy as np
    from PIL import Image

    folder.mkdir()
    path = folder / "image.png"
    pixels = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vit-22b-tiny/16", "vit-22b-base/14"])
    parser.add_argument("--repeats", type=int, default=2, help="warm starts per model")
    args = parser.parse_args(argv)
    out: dict = {"benchmark": "startup", "repeats": args.repeats, "models": {}}
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="vit22b-cache-") as cache:
            cold, _ = time_to_serving(model, cache)
            warm = [time_to_serving(model, cache)[0] for _ in range(args.repeats)]
            entries = sum(len(files) for _, _, files in os.walk(cache))
        with tempfile.TemporaryDirectory(prefix="vit22b-job-") as work:
            image = one_image(Path(work) / "data")
            jobs = [time_command("embed", str(image.parent), "-o", f"{work}/out{i}", "--model",
                                 model, "--compile-cache", f"{work}/cache", "--quiet")
                    for i in range(args.repeats + 1)]
            inits = [time_command("init", "--model", model, "--out", f"{work}/ckpt{i}",
                                  "--compile-cache", f"{work}/init-cache")
                     for i in range(args.repeats + 1)]
        row = {"cold_s": round(cold, 2), "warm_s": round(median(warm), 2),
               "ratio_warm_to_cold": round(median(warm) / cold, 3), "cache_entries": entries,
               "local_job_cold_s": round(jobs[0], 2),
               "local_job_warm_s": round(median(jobs[1:]), 2),
               "init_cold_s": round(inits[0], 2), "init_warm_s": round(median(inits[1:]), 2)}
        log(f"{model}: cold {cold:.1f}s, warm {median(warm):.1f}s ({entries} cache entries); "
            f"one-image local job cold {jobs[0]:.1f}s, warm {median(jobs[1:]):.1f}s; init cold "
            f"{inits[0]:.1f}s, warm {median(inits[1:]):.1f}s")
        out["models"][model] = row
    emit({**out, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
