"""The model's attention (``vit.attend``) against the formulations it replaced, alone, same run.

ViT-B/16's shapes (12 heads of 64), the inputs [B, T, H, hd] sharded over the 2 emulated data
devices as in the engine. Sides, each jitted on its own:
- ``softmax first``: heads next to the batch, ``softmax(q k^T) v`` (the normalisation over the
  Tq x Tk weights), all queries at once (the attention before this pass);
- ``normalised after``: ``exp(l - max) v / sum`` (Tq x hd divisions), heads still [B, H];
- ``model, one step``: ``vit.attend`` with heads folded and every query in one step;
- ``model``: ``vit.attend`` as the engine runs it (folded; queries in steps past
  2 x ``QUERY_BLOCK``).
Milliseconds per call (median of ``--repeats``, the sides alternating) and each side's largest
difference from ``model`` relative to its largest value.

    python benchmarks/attention.py
    python benchmarks/attention.py --tokens 197 785 --repeats 3

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import math
import sys

from benchlib import alternate, emit, load_average, log, machine, median

HEADS, HEAD_DIM = 12, 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[197, 785, 1025, 3137])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()  # what `vit22b serve` does before jax starts
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from vit22b.model import vit

    def softmax_first(q, k, v, dtype):
        q, k, v = (jnp.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
        logits = vit.dot("bhqd,bhkd->bhqk", q, k, dtype) / math.sqrt(HEAD_DIM)
        out = vit.dot("bhqk,bhkd->bhqd", jax.nn.softmax(logits, axis=-1), v, dtype)
        return jnp.transpose(out, (0, 2, 1, 3))

    def normalised_after(q, k, v, dtype):
        q, k, v = (jnp.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
        logits = vit.dot("bhqd,bhkd->bhqk", q / math.sqrt(HEAD_DIM), k, dtype)
        weights = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
        out = vit.dot("bhqk,bhkd->bhqd", weights, v, dtype) / weights.sum(-1, keepdims=True)
        return jnp.transpose(out, (0, 2, 1, 3))

    def model(q, k, v, dtype):
        return vit.attend(q, k, v, dtype, False, True)[0]

    def one_step(q, k, v, dtype):
        block, vit.QUERY_BLOCK = vit.QUERY_BLOCK, 10**9  # read while tracing
        try:
            return model(q, k, v, dtype)
        finally:
            vit.QUERY_BLOCK = block

    sides = {"softmax first": softmax_first, "normalised after": normalised_after,
             "model, one step": one_step, "model": model}
    devices = jax.devices()[:2]
    sharding = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    rng = np.random.default_rng(0)
    load = load_average()
    rows = []
    for tokens in args.tokens:
        batch = 8 if tokens <= 256 else 2
        q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal(
            (batch, tokens, HEADS, HEAD_DIM)), jnp.float32), sharding) for _ in range(3))
        for dtype in ("float32", "bfloat16"):
            fns = {name: jax.jit(lambda q, k, v, f=f, dt=dtype: f(q, k, v, dt))
                   for name, f in sides.items()}
            outs = {name: fn(q, k, v) for name, fn in fns.items()}  # compiled, warm
            ref = np.asarray(outs["model"])
            diffs = {name: float(np.abs(np.asarray(o) - ref).max() / np.abs(ref).max())
                     for name, o in outs.items()}
            inputs = (q, k, v)
            times = alternate({name: lambda fn=fn, x=inputs: jax.block_until_ready(fn(*x))
                               for name, fn in fns.items()}, args.repeats)
            ms = {name: round(median(t) * 1e3, 2) for name, t in times.items()}
            rows.append({"tokens": tokens, "batch": batch, "dtype": dtype, "ms": ms,
                         "rel_diff_to_model": {n: float(f"{d:.2g}") for n, d in diffs.items()}})
            log(f"T={tokens:5d} batch {batch} {dtype:8s} "
                + "  ".join(f"{n} {t:8.2f} ms" for n, t in ms.items())
                + f"  (rel. diff to model: {rows[-1]['rel_diff_to_model']})")
    emit({"benchmark": "attention", "heads": HEADS, "head_dim": HEAD_DIM, "devices": len(devices),
          "query_block": vit.QUERY_BLOCK, "rows": rows, "load_average": load,
          "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
