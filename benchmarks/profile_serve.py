"""Where a served call's time goes: py-spy samples of the server and the client process while
single-image clients call the tiny model, folded into the serving path's stages.

    python benchmarks/profile_serve.py                    # 32 clients, then 1 client
    python benchmarks/profile_serve.py --clients 32 --images 2048 --rate 200

The server is ``serve.py``'s (the tiny default model, in this process, loopback); the clients
are its driver process (``FeatureClient.embed([jpeg])`` per call, one channel each). Both
processes are sampled by py-spy (``--nonblocking``: the processes are not paused; CPU samples
only, idle threads left out) for the timed phase. Each sample is put in the first stage, from
the innermost frame out, whose rule matches (``STAGES``): so a JPEG decode inside the
preprocessing pool counts as decoding, not as the pool. The split is in percent of each
process's CPU samples and, with the phase's wall time and image count, in CPU microseconds per
image. The server's cycle collections in the phase (``gc.callbacks``: count and wall ms by
generation) come beside them; ``--unfreeze`` undoes the server's freeze of its start-up heap
(``app.freeze_startup_heap``) to see them as they were before it. Needs py-spy (``make bench``
installs it) and permission to read another process's memory (root, or ptrace_scope 0). Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchlib import emit, log, machine
from serve import TRANSPORTS, jpegs, run_phase

# the server's timings in a phase (serve.phase_figures), reported beside the samples
PHASE_KEYS = ("compute_busy", "compute_ms_per_batch", "preprocess_ms_per_call",
              "queue_ms_per_job")

# stage -> substrings of a py-spy frame ("function (file:line)"); the innermost match wins
STAGES: dict[str, tuple[str, ...]] = {
    "decode + preprocess (pixels.py)": ("pixels.py",),
    "forward: to device (device_put)": ("device_put", "make_array_from"),
    "forward: compiled call": ("pjit.py", "_cpp_pjit", "compiled(", "stages.py", "api.py"),
    "forward: to host, pad, Features": ("engine.py", "features.py"),
    "batcher (packing, condition waits)": ("batcher.py",),
    "proto parse + translate (service.parse, to_call, wire)": (
        "parse (", "to_call", "_image (", "from_tensor", "FromString"),
    "response building (service._response, wire.to_tensor)": (
        "_response", "to_tensor", "SerializeToString", "CopyFrom"),
    "facade (infer.py: validate, admit, finish)": ("infer.py",),
    "metrics (prometheus_client)": ("prometheus_client",),
    "service door (service.py other)": ("service.py",),
    "SDK: request building, results (clients/)": ("clients/", "vit22b/clients"),
    "thread pools and futures (hops)": ("concurrent/futures", "threading.py", "queue.py"),
    "asyncio event loop (incl. gRPC aio callbacks)": ("asyncio/",),
    "gRPC Python (grpc/)": ("grpc/",),
}


def classify(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        for stage, needles in STAGES.items():
            if any(n in frame for n in needles):
                return stage
    return "other"


def fold(path: str) -> collections.Counter:
    """py-spy raw (collapsed) output -> samples per stage."""
    counts: collections.Counter = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if stack and n.isdigit():
                counts[classify(stack.split(";"))] += int(n)
    return counts


def py_spy() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    found = beside if os.path.exists(beside) else shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy not found (pip install py-spy; `make bench` installs it)")
    return found


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, CPU seconds so far) of every thread of ``pid`` (/proc: exact, unlike
    sampling on a loaded machine, where a runnable thread waiting for a core looks busy)."""
    tick = os.sysconf("SC_CLK_TCK")
    python_names = {t.native_id: t.name for t in threading.enumerate()} if pid == os.getpid() \
        else {}
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended
            continue
        name = python_names.get(int(tid), comm)
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_group(name: str) -> str:
    """Threads by role (Python threads by their names, native ones by their comm)."""
    for prefix, group in (("vit22b-server", "event loop (gRPC aio, door, facade)"),
                          ("vit22b-preprocess", "preprocessing pool (decode)"),
                          ("vit22b-decode", "handoff worker (a call's small image)"),
                          ("vit22b-batcher", "batcher (compute thread, XLA dispatch)"),
                          ("vit22b-compile", "compile thread"),
                          ("MainThread", "main thread")):
        if name.startswith(prefix):
            return group
    if name.startswith(("grpc", "default-executo", "resolver", "timer")):
        return "gRPC core threads"
    if name.startswith(("Thread-", "ThreadPoolExec")):
        return "Python threads (client calls, pools)"
    if name == "python":  # native threads that never named themselves
        return "unnamed native threads (XLA's runtime in the server, gRPC's in the client)"
    return f"native: {name.rstrip('0123456789-_')}" if name else "other"


def process_cpu(pid: int) -> float:
    """CPU seconds of the whole process, ended threads included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def snapshot(pid: int) -> tuple[float, dict]:
    return process_cpu(pid), thread_cpu(pid)


def cpu_by_group(before: tuple[float, dict], after: tuple[float, dict], images: int) -> dict:
    """CPU microseconds per image by thread group; threads that ended in between (a client's
    call threads) are the process's total less the living threads' share."""
    groups: collections.Counter = collections.Counter()
    for tid, (name, seconds) in after[1].items():
        groups[thread_group(name)] += seconds - before[1].get(tid, (name, 0.0))[1]
    total = after[0] - before[0]
    ended = total - sum(groups.values())
    if ended > 0:
        groups["threads that ended in the phase"] += ended
    return {"cpu_s": round(total, 3), "cpu_us_per_image": round(1e6 * total / images, 1),
            "threads": {g: round(1e6 * v / images, 1) for g, v in groups.most_common() if v}}


class CycleCollections:
    """The server process's cycle collections (``gc.callbacks``): count and wall ms by
    generation, while ``on``."""

    def __init__(self):
        self.on, self._start, self.by_generation = False, {}, {}
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        thread = threading.get_ident()
        if phase == "start":
            self._start[thread] = time.perf_counter()
        elif thread in self._start:
            entry = self.by_generation.setdefault(f"gen{info['generation']}", [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - self._start.pop(thread)

    def take(self) -> dict:
        out = {g: {"collections": n, "ms": round(1e3 * s, 1)}
               for g, (n, s) in sorted(self.by_generation.items())}
        self.on, self.by_generation = False, {}
        return out


def start_spy(pid: int, out: str, rate: int) -> subprocess.Popen:
    spy = py_spy()
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
         "--nonblocking", "--output", out],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def stop_spy(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    proc.wait(timeout=60)


def split(counts: collections.Counter, rate: int, images: int) -> dict:
    total = sum(counts.values()) or 1
    return {
        "cpu_samples": total,
        "cpu_us_per_image": round(total / rate / images * 1e6, 1),
        "stages": {
            stage: {"percent": round(100 * n / total, 1),
                    "us_per_image": round(n / rate / images * 1e6, 1)}
            for stage, n in counts.most_common()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-22b-tiny/16")
    parser.add_argument("--clients", type=int, nargs="+", default=[32, 1])
    parser.add_argument("--images", type=int, default=1024, help="images per phase")
    parser.add_argument("--size", type=int, default=64, help="side of the JPEG files")
    parser.add_argument("--batch", type=int, default=32, help="max_batch_images")
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--batch-wait", default="decoding", help="the server's --batch-wait")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--keep", metavar="DIR", help="keep py-spy's raw stacks in DIR")
    parser.add_argument("--transport", default="unary", choices=TRANSPORTS,
                        help="the clients' calls (serve.py's drive)")
    parser.add_argument("--unfreeze", action="store_true",
                        help="undo the server's gc.freeze of its start-up heap (as before it)")
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()
    from vit22b.server.app import BackgroundServer
    from vit22b.server.engine import Engine
    from vit22b.server.settings import ServeConfig

    engine = Engine.load(args.model, mesh="auto", max_batch_images=args.batch)
    engine.warm_up()
    jpegs(1, args.size)
    config = ServeConfig(mesh="auto", port=0, metrics_port=0, max_batch_images=args.batch,
                         max_request_images=args.batch, max_delay_ms=args.max_delay_ms,
                         batch_wait=args.batch_wait)
    phases = {}
    with BackgroundServer(config, engine=engine) as server, \
            tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or scratch
        os.makedirs(folder, exist_ok=True)
        metrics_url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
        if args.unfreeze:
            gc.unfreeze()
        collections_seen = CycleCollections()
        run_phase(args, server.address, metrics_url, max(args.clients),
                  transport=args.transport)  # warm-up
        for clients in args.clients:
            spies: dict[str, tuple[subprocess.Popen, str]] = {}

            cpu: dict[str, tuple[int, dict]] = {}

            def started(pid: int, clients=clients, spies=spies, cpu=cpu) -> None:
                for side, target in (("server", os.getpid()), ("client", pid)):
                    out = os.path.join(folder, f"{side}-{clients}.txt")
                    spies[side] = (start_spy(target, out, args.rate), out)
                time.sleep(1.0)  # py-spy attached before the clock starts
                cpu.update({"server": (os.getpid(), snapshot(os.getpid())),
                            "client": (pid, snapshot(pid))})
                collections_seen.on = True

            def finished(cpu=cpu) -> None:
                for side, (pid, before) in list(cpu.items()):
                    cpu[side] = cpu_by_group(before, snapshot(pid), args.images)

            result = run_phase(args, server.address, metrics_url, clients, on_ready=started,
                               on_done=finished, transport=args.transport)
            for proc, _ in spies.values():
                stop_spy(proc)
            phase = {"wall_s": round(result["wall_s"], 2),
                     "images_per_s": round(args.images / result["wall_s"], 1),
                     "avg_batch": round(result["avg_batch"], 2),
                     **{k: result[k] for k in PHASE_KEYS},
                     "server_cycle_collections": collections_seen.take()}
            for side, (_, out) in spies.items():
                phase[side] = {"cpu": cpu[side], "sampled": split(fold(out), args.rate,
                                                                  args.images)}
            phases[f"clients_{clients}"] = phase
            log(f"{clients} client(s): {phase['images_per_s']} img/s, avg batch "
                f"{phase['avg_batch']}; server cycle collections "
                f"{phase['server_cycle_collections']}")
            log(f"  the server's timings: compute thread busy {phase['compute_busy']:.0%} of the "
                f"wall time, {phase['compute_ms_per_batch']} ms per batch; a call "
                f"{phase['preprocess_ms_per_call']} ms in preprocessing (the decode queue "
                f"included), a job {phase['queue_ms_per_job']} ms in the queue")
            for side in ("server", "client"):
                measured = phase[side]["cpu"]
                log(f"  {side}: {measured['cpu_us_per_image']} CPU us/image (/proc), by thread:")
                for group, us in measured["threads"].items():
                    log(f"    {us:8.1f} us  {group}")
                log("   sampled stages (py-spy, % of samples):")
                for stage, v in phase[side]["sampled"]["stages"].items():
                    log(f"    {v['percent']:5.1f}%  {stage}")
    emit({"benchmark": "profile_serve", "model": args.model, "images": args.images,
          "jpeg_side": args.size, "max_delay_ms": args.max_delay_ms,
          "startup_heap_frozen": not args.unfreeze,
          "batch_wait": args.batch_wait, "rate": args.rate, "transport": args.transport,
          **phases, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
