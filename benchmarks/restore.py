"""Peak resident memory of restoring a checkpoint onto 8 devices, as a ratio to its size.

1. ``vit22b init`` writes a checkpoint of the preset (created sharded over its heads).
2. In a fresh process per variant (8 emulated CPU devices, so device memory *is* resident host
   memory), the parameter tree is restored and the process's peak RSS is read from
   /proc/self/status (VmHWM, reset just before the restore through /proc/self/clear_refs; a
   1 ms sampler of VmRSS backs it up). The figure is (peak - RSS before restore) / the
   checkpoint's parameter bytes. Variants, same checkpoint, same run:
   - sharded: ``checkpoint.restore`` (orbax fills an abstract tree whose leaves carry their
     target shardings: each device reads its own slice);
   - host-then-shard, the peer: the whole tree restored to host numpy arrays, then
     ``jax.device_put`` onto the same shardings (what a restore without target shardings costs).

    python benchmarks/restore.py                           # vit-22b-large/14, f32 (1.2 GB)
    python benchmarks/restore.py --model vit-22b-base/14 --mesh data=2,model=4

The last line of stdout is one JSON object; ``peak_rss_ratio`` (sharded) is the figure, target
under 1.5; ``peer_peak_rss_ratio`` is the host-then-shard one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=8",
)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRss:
    """Peak RSS over a block: the kernel's high-water mark (reset at entry) and a 1 ms sampler."""

    def __enter__(self):
        self.before = _status_kib("VmRSS") * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.hwm = True
        except OSError:
            self.hwm = False
        self.sampled = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.sampled = max(self.sampled, _status_kib("VmRSS") * 1024)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        hwm = _status_kib("VmHWM") * 1024 if self.hwm else 0
        self.peak = max(hwm, self.sampled)
        self.after = _status_kib("VmRSS") * 1024


def measure(path: str, mesh_spec: str, variant: str) -> dict:
    """Runs in the child process: one restore, its peak RSS."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from vit22b.model import checkpoint
    from vit22b.model.sharding import make_mesh, param_shardings

    mesh = make_mesh(mesh_spec)
    meta = checkpoint.read_metadata(path)
    shardings = param_shardings(meta.config, mesh)  # abstract shapes only
    jax.block_until_ready(jax.device_put(np.zeros(8), jax.devices()[0]))  # backend up
    start = time.perf_counter()
    with PeakRss() as rss:
        if variant == "sharded":
            _, params, _ = checkpoint.restore(path, mesh)
        else:  # the peer: whole tree to host memory first, then onto the devices
            host = ocp.PyTreeCheckpointer().restore(os.path.join(path, checkpoint.PARAMS_DIR))
            params = jax.device_put(host, shardings)
            del host
        jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    assert checkpoint.fingerprint(params) == meta.fingerprint
    return {
        "variant": variant,
        "seconds": round(seconds, 2),
        "rss_before": rss.before,
        "rss_peak": rss.peak,
        "rss_after": rss.after,
        "peak_increase": rss.peak - rss.before,
        "param_bytes": meta.param_bytes,
        "ratio": round((rss.peak - rss.before) / meta.param_bytes, 3),
        "hwm_reset": rss.hwm,
    }


def _child(path: str, mesh: str, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--dir", path, "--mesh", mesh]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{variant} restore failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _disk_bytes(folder: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in names
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vit-22b-large/14")
    parser.add_argument("--mesh", default="data=1,model=8", help="mesh restored onto")
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--child", choices=("sharded", "host-then-shard"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.dir, args.mesh, args.child)))
        return 0

    with tempfile.TemporaryDirectory(prefix="vit22b-restore-") as tmp:
        path = args.dir or os.path.join(tmp, "ckpt")
        if not os.path.exists(os.path.join(path, "metadata.json")):
            start = time.perf_counter()
            init = [sys.executable, "-m", "vit22b.clients.cli", "init", "--model", args.model]
            done = subprocess.run([*init, "--out", path], env=ENV, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"vit22b init failed:\n{done.stderr[-3000:]}")
            print(f"wrote {path} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
        sharded = _child(path, args.mesh, "sharded")
        peer = _child(path, args.mesh, "host-then-shard")
        for run in (sharded, peer):
            mib = run["peak_increase"] / 2**20
            print(
                f"{run['variant']:>16}: peak RSS +{mib:,.0f} MiB over "
                f"{run['param_bytes'] / 2**20:,.0f} MiB of parameters = {run['ratio']:.3f}x "
                f"({run['seconds']}s)",
                file=sys.stderr,
            )
        result = {
            "model": args.model,
            "mesh": args.mesh,
            "param_bytes": sharded["param_bytes"],
            "disk_bytes": _disk_bytes(os.path.join(path, "params")),
            "peak_rss_ratio": sharded["ratio"],
            "peer_peak_rss_ratio": peer["ratio"],
            "target_ratio": 1.5,
            "sharded": sharded,
            "host_then_shard": peer,
        }
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
