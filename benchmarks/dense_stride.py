"""The dense probes' training stride: what half-resolution training costs the depth and
segmentation decoders, against training at full resolution, on the generated shapes world (the
demo's smooth depth) and on depth that is one value per token's 4x4 pixels (sharp edges at
every token, a linear function of a token channel: a linear decoder can learn it exactly).

    python benchmarks/dense_stride.py [--images 160] [--steps 300]

Features of the shapes world come from the embedded default model in process. Each line: the
data, the decoder, the stride, its test RMSE (depth) or mIoU (segmentation), the mean-depth
baseline, seconds. The closing JSON line holds every figure.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from benchlib import emit, log, machine
from vit22b.probes import dense
from vit22b.probes.data import shapes_world
from vit22b.probes.features import Features, features_from_model


def _blocky(n: int, seed: int = 8) -> tuple[Features, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.normal(size=(n, 16, 16)).astype(np.float32)  # a 4x4 grid of 16-wide tokens
    depth = np.repeat(np.repeat(5 + tokens[:, :, 0].reshape(n, 4, 4), 4, axis=1), 4, axis=2)
    return Features(pooled=tokens.mean(1), patch_tokens={0: tokens}), depth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=160)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    world = shapes_world(args.images, seed=0)
    worlds = {
        "shapes world": (features_from_model(world.images, patch_layers=(-1,)), world.depth),
        "token blocks": _blocky(args.images),
    }
    index = np.random.default_rng(0).permutation(args.images)
    cut = args.images * 3 // 4
    train, test = np.sort(index[:cut]), np.sort(index[cut:])
    rows = []
    for name, (features, depth) in worlds.items():
        layers = tuple(features.patch_tokens)
        for stride in (2, 1):
            for kind in ("linear", "dpt"):
                start = time.perf_counter()
                report, _ = dense.depth_probe(features, depth, train, test, layers,
                                              decoders=(kind,), steps=args.steps,
                                              train_stride=stride)
                rows.append({"data": name, "probe": f"depth {kind}", "stride": stride,
                             "rmse": report[kind]["rmse"],
                             "baseline_rmse": report["baselines"]["mean_depth"]["rmse"],
                             "seconds": time.perf_counter() - start})
                log(rows[-1])
            if name == "shapes world":
                start = time.perf_counter()
                report, _ = dense.segmentation_probe(
                    features, world.mask, world.num_mask_classes, train_index=train,
                    test_index=test, layers=layers, steps=args.steps, train_stride=stride)
                rows.append({"data": name, "probe": "segmentation", "stride": stride,
                             "miou": report["linear"]["miou"],
                             "seconds": time.perf_counter() - start})
                log(rows[-1])
    emit({"machine": machine(), "images": args.images, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
