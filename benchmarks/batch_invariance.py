"""How much an image's served features depend on the batch it is computed in.

The server packs callers' images into batches of bucket sizes, and each bucket is a compiled
forward of its own (its rows on one data row or two, in chunks of its own size): XLA's GEMMs may
order a dot product's sums differently from one program to another. Here the same images run
through the in-process facade (``LocalInfer``: the server's batcher, buckets and compiled
forwards) alone and as the first rows of batches of every size, in each compute dtype, and each
batch's rows are compared with the same images computed alone.

    python benchmarks/batch_invariance.py                       # the tiny default model
    python benchmarks/batch_invariance.py --model vit-b/16 --sizes 1 2 4 8 --seeds 1

Per compute dtype and batch size, over ``--seeds`` sets of random images: the bucket, whether
the rows were bit-identical to their solo runs for every set, and the largest difference
relative to the largest magnitude of the output (pooled and the last block's patch tokens). In
bfloat16 the differences come from roundings that fall on the other side in another program:
how large, and from which batch size, depends on the images. Ends with one JSON line.
"""

from __future__ import annotations

import argparse

import numpy as np
from benchlib import emit, log, machine
from vit22b.server.cpu_devices import prepare_xla_cpu

prepare_xla_cpu()  # what `vit22b serve` does before jax starts: its devices and vectors


def relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def measure(model: str, dtype: str, sizes: list[int], seed: int) -> list[dict]:
    from vit22b.model import OutputRequest
    from vit22b.server.engine import Engine
    from vit22b.server.infer import LocalInfer

    engine = Engine.load(model, compute_dtype=dtype, max_batch_images=max(sizes))
    size = engine.cfg.image_size
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (size, size, 3), np.uint8) for _ in range(max(sizes))]
    outputs = OutputRequest(pooled=True, patch_layers=(-1,))
    rows = []
    with LocalInfer(engine) as local:
        def run(batch: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            features = local.embed(batch, outputs, solo=True).features
            return features.pooled, features.patch_tokens[engine.cfg.depth - 1]

        alone = [run([image]) for image in images]
        for n in sizes:
            pooled, patches = run(images[:n])
            solo_pooled = np.stack([alone[i][0][0] for i in range(n)])
            solo_patches = np.stack([alone[i][1][0] for i in range(n)])
            rows.append({
                "dtype": dtype, "batch": n, "bucket": engine.plan.bucket(n),
                "bit_identical": bool(np.array_equal(pooled, solo_pooled)
                                      and np.array_equal(patches, solo_patches)),
                "pooled_rel": relative(pooled, solo_pooled),
                "patch_rel": relative(patches, solo_patches),
            })
            log(f"{dtype} batch {n:>2} (bucket {rows[-1]['bucket']}): identical "
                f"{rows[-1]['bit_identical']}, pooled {rows[-1]['pooled_rel']:.2e}, patches "
                f"{rows[-1]['patch_rel']:.2e}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit-22b-tiny/16")
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--seeds", type=int, default=3, help="sets of random images")
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes:
        runs = [measure(args.model, dtype, args.sizes, seed) for seed in range(args.seeds)]
        for per_seed in zip(*runs):  # one batch size, every set of images
            rows.append({**per_seed[0],
                         "bit_identical": all(r["bit_identical"] for r in per_seed),
                         "pooled_rel": max(r["pooled_rel"] for r in per_seed),
                         "patch_rel": max(r["patch_rel"] for r in per_seed)})
    print(f"{args.seeds} sets of {max(args.sizes)} random images; the largest differences\n")
    print("| compute dtype | batch | bucket | bit-identical to alone | pooled (rel.) | "
          "last-block patches (rel.) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch']} | {r['bucket']} | {r['bit_identical']} | "
              f"{r['pooled_rel']:.1e} | {r['patch_rel']:.1e} |")
    emit({"model": args.model, "seeds": args.seeds, "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
