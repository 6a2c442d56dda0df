"""Where the engine's forward spends its time: XLA:CPU's own per-operation trace, grouped.

The engine (the forward benchmark's ViT, ``forward.py``'s importer, the engine's own plan) runs
a few forwards under ``jax.profiler.trace``; XLA:CPU records one event per executed operation
(a fused loop, a library GEMM, a copy), named as the instruction in the optimised HLO, which
this script also has XLA dump. Each event is labelled by what its instruction computes (the jax
op it came from, with the block index dropped, so the 12 blocks' MLP GEMMs are one row) and the
times are summed per label: device-milliseconds per forward, summed over the data devices (they
run at the same time, so the wall time is about the sum over the device count).

    python benchmarks/forward_profile.py                                  # f32, batch 8
    python benchmarks/forward_profile.py --dtype bfloat16 --batch 32 --rows 25

Beside the sums, how the traced forwards' span (the first operation's start to the last one's
end) splits by how many operations run at once (``concurrency_ms``: ms per forward with 0, 1,
2, ... running). With a data device per core, time with fewer operations running than devices
is a device idle: a wait for the other, a runtime gap between operations, or (none running)
the host's work between the programs.

The last line of stdout is one JSON object (``rows``: label, ms, share; ``gemm_share``;
``concurrency_ms``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

from benchlib import emit, load_average, log, machine
from forward import PEER_SIZES, hf_peer, imported

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) (\w[\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^%?([\w.\-]+) .*\{$")


def parse_hlo(text: str) -> dict[str, dict]:
    """Instruction name -> its opcode, result shape, op_name and (fusions) the called ops."""
    computations: dict[str, list[tuple[str, str]]] = {}
    instructions: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = computations.setdefault(head.group(1), [])
            continue
        m = _INSTRUCTION.match(line)
        if not m or current is None:
            continue
        name, shape, opcode, rest = m.groups()
        current.append((opcode, shape))
        calls = re.search(r"calls=%([\w.\-]+)", rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        instructions[name] = {"opcode": opcode, "shape": shape,
                              "calls": calls.group(1) if calls else None,
                              "op_name": op_name.group(1) if op_name else ""}
    for info in instructions.values():
        called = computations.get(info["calls"] or "", [])
        info["ops"] = sorted({op for op, _ in called} - {"parameter", "constant", "bitcast",
                                                          "broadcast"})
        info["dots"] = [shape for op, shape in called if op == "dot"]
    return instructions


def label(info: dict) -> str:
    """What an instruction computes, the same for every block: kind, jax op, shapes of its GEMMs."""
    where = re.sub(r"^jit\([^)]*\)/", "", info["op_name"])
    where = re.sub(r"block_\d+", "block_*", where)
    where = re.sub(r"params\['block_\*'\]", "weights of block_*", where)
    if info["dots"]:
        kind = "GEMM" if info["ops"] == ["dot"] else "GEMM + " + ",".join(
            op for op in info["ops"] if op != "dot")
        return f"{kind} -> {' '.join(s.split('{')[0] for s in info['dots'])} [{where}]"
    if info["opcode"] == "fusion":
        return f"loop ({','.join(info['ops'][:8])}) [{where}]"
    return f"{info['opcode']} [{where}]"


def running_at_once(edges: list[tuple[int, int]], forwards: int) -> dict[int, float]:
    """ms per forward during which N operations were running, N = 0, 1, ..., over the span from
    the first operation's start to the last one's end (``edges``: (ns, +1 start / -1 end))."""
    spent: collections.Counter = collections.Counter()
    running, last = 0, None
    for t, step in sorted(edges):  # at equal times an end (-1) sorts before a start
        if last is not None:
            spent[running] += t - last
        running, last = running + step, t
    return {n: round(spent[n] / 1e6 / forwards, 2) for n in range(max(spent, default=0) + 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-b/16", choices=sorted(PEER_SIZES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--forwards", type=int, default=3, help="forwards traced")
    parser.add_argument("--rows", type=int, default=15, help="labels printed")
    args = parser.parse_args(argv)

    dump = tempfile.TemporaryDirectory(prefix="vit22b-hlo-")
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_dump_to={dump.name}").strip()
    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()  # what `vit22b serve` does before jax starts
    import jax
    import numpy as np
    from vit22b.model.outputs import POOLED
    from vit22b.model.sharding import shard_params
    from vit22b.server.engine import Engine, auto_mesh

    cfg, params, source = imported(hf_peer(args.model, 0), args.model)
    cfg = cfg.replace(compute_dtype=args.dtype)
    mesh = auto_mesh(cfg)
    engine = Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="bench",
                    source=source, max_batch_images=args.batch)
    images = np.random.default_rng(0).random((args.batch, cfg.image_size, cfg.image_size, 3),
                                              dtype=np.float32)
    for _ in range(2):
        engine.forward(images, POOLED)
    trace = tempfile.TemporaryDirectory(prefix="vit22b-trace-")
    load = load_average()
    with jax.profiler.trace(trace.name):
        start = time.perf_counter()  # the forwards only, not the profiler's start and stop
        for _ in range(args.forwards):
            engine.forward(images, POOLED)
        wall = (time.perf_counter() - start) / args.forwards
    engine.close()

    # The forward's module is the largest optimised one XLA dumped.
    modules = glob.glob(f"{dump.name}/*after_optimizations.txt")
    with open(max(modules, key=os.path.getsize)) as f:
        instructions = parse_hlo(f.read())
    (xplane,) = glob.glob(f"{trace.name}/**/*.xplane.pb", recursive=True)
    profile = jax.profiler.ProfileData.from_file(xplane)
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    edges: list[tuple[int, int]] = []  # (time ns, +1 an operation starts / -1 it ends)
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                info = instructions.get(event.name)
                if info is not None:
                    key = label(info)
                    totals[key] += event.duration_ns / 1e6 / args.forwards
                    counts[key] += 1
                    edges += [(event.start_ns, 1), (event.start_ns + event.duration_ns, -1)]
    concurrency = running_at_once(edges, args.forwards)
    total = sum(totals.values())
    gemm = sum(ms for key, ms in totals.items() if key.startswith("GEMM ->"))
    devices = mesh.devices.size
    log(f"{args.model} {args.dtype} batch {args.batch}: wall {wall * 1e3:.1f} ms per forward "
        f"({args.batch / wall:.2f} img/s), {total:.1f} device-ms traced over {devices} "
        f"device(s), load {load}")
    log(f"plain GEMMs {gemm / total:.1%} of the traced time")
    log("ms per forward with N operations running: "
        + ", ".join(f"{n}: {ms}" for n, ms in concurrency.items()))
    rows = []
    for key, ms in totals.most_common():
        rows.append({"label": key, "ms": round(ms, 2), "share": round(ms / total, 4),
                     "calls": counts[key] // args.forwards})
    for row in rows[: args.rows]:
        log(f"{row['ms']:8.2f} ms {row['share']:6.1%} {row['calls']:4d}x  {row['label']}")
    emit({"benchmark": "forward_profile", "model": args.model, "dtype": args.dtype,
          "batch": args.batch, "wall_ms": round(wall * 1e3, 2), "devices": devices,
          "traced_device_ms": round(total, 2), "gemm_share": round(gemm / total, 4),
          "concurrency_ms": concurrency,
          "rows": rows, "load_average": load, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
