"""Cost against resolution: engine and the PyTorch peer at 224, 448, 512 and 896 px, same run.

ViT-B/16 (Hugging Face ``ViTModel``, seeded init, through this project's importer: the same
weights on both sides); the peer runs ``interpolate_pos_encoding=True``, the engine resamples its
position table once per grid (the same bicubic). Per resolution: images/s and milliseconds per
patch for both sides in float32 compute, alternating after warm-up, pooled features checked to
agree. (518, DINOv2's size, is no whole grid of 16-pixel patches: 512 stands in for it.) Tokens
grow with the square of the side and attention with the square of the tokens: ms
per patch rising with the side is the quadratic term (fit: ms/image = a * tokens + b * tokens^2,
least squares over the engine's points).

    python benchmarks/resolution.py                        # 224 448 512 896, batch 2, 3 repeats
    python benchmarks/resolution.py --sizes 224 448 --batch 4

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import sys

from benchlib import alternate, emit, log, machine, median
from forward import hf_peer, imported, rel_err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 448, 512, 896])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()  # what `vit22b serve` does before jax starts
    import numpy as np
    import torch
    from vit22b.model.outputs import POOLED
    from vit22b.model.sharding import shard_params
    from vit22b.server.engine import Engine, auto_mesh

    peer = hf_peer("vit-b/16", args.seed)
    cfg, params, source = imported(peer, "vit-b/16")
    cfg = cfg.replace(compute_dtype="float32")
    mesh = auto_mesh(cfg)
    engine = Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="bench",
                    source=source, max_batch_images=args.batch)
    outputs = engine.resolve(POOLED)
    rng = np.random.default_rng(args.seed)

    def torch_pooled(x):
        with torch.inference_mode():
            out = peer(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
        return out[:, 0].numpy()

    rows = []
    for size in args.sizes:
        patches = (size // cfg.patch) ** 2
        x = rng.standard_normal((args.batch, size, size, 3), np.float32)
        x_torch = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
        sides = {
            "engine": lambda x=x: engine.forward(x, outputs)["pooled"],
            "torch": lambda x=x_torch: torch_pooled(x),
        }
        first = {name: fn() for name, fn in sides.items()}  # warm-up (the engine compiles)
        for fn in sides.values():
            fn()
        agreement = rel_err(first["engine"], first["torch"])
        seconds = {name: median(t) for name, t in alternate(sides, args.repeats).items()}
        row = {"size": size, "patches": patches, "tokens": cfg.tokens_at((size // cfg.patch,) * 2),
               "pooled_rel_err": float(f"{agreement:.2g}")}
        for name, s in seconds.items():
            row[f"{name}_images_per_s"] = round(args.batch / s, 3)
            row[f"{name}_ms_per_patch"] = round(1e3 * s / args.batch / patches, 4)
        row["ratio"] = round(seconds["torch"] / seconds["engine"], 3)
        rows.append(row)
        log(f"{size:4d} px ({patches:5d} patches): engine {row['engine_images_per_s']:7.3f} img/s "
            f"{row['engine_ms_per_patch']:.4f} ms/patch | torch {row['torch_images_per_s']:7.3f} "
            f"img/s {row['torch_ms_per_patch']:.4f} ms/patch | ratio {row['ratio']} | rel err "
            f"{row['pooled_rel_err']}")
    fit = {}
    if len(rows) >= 2:  # ms/image = a * T + b * T^2 (the linear and the attention terms)
        tokens = np.array([r["tokens"] for r in rows], np.float64)
        for side in ("engine", "torch"):
            ms = np.array([1e3 / r[f"{side}_images_per_s"] for r in rows])
            (a, b), *_ = np.linalg.lstsq(np.stack([tokens, tokens**2], 1), ms, rcond=None)
            fit[side] = {"ms_per_token": float(f"{a:.3g}"), "ms_per_token_squared": float(
                f"{b:.3g}"), "quadratic_share_at_largest": round(
                b * tokens[-1] ** 2 / (a * tokens[-1] + b * tokens[-1] ** 2), 3)}
    emit({"benchmark": "resolution", "model": "vit-b/16", "compute_dtype": "float32",
          "batch": args.batch, "repeats": args.repeats, "engine_mesh": engine.mesh_spec,
          "rows": rows, "fit": fit, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
