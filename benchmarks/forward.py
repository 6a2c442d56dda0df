"""Engine forward against the CPU runtimes a user would pick for the same model, same run.

The peer is a transformers ``ViTModel`` (ViT-B/16 at 224 by default, seeded init); its weights
go through this project's importer (``model.convert``), so every side computes the same numbers
(checked: the pooled features must agree). The engine side is ``Engine.forward`` itself (pad to
the bucket, put on the mesh, the compiled forward, back to the host) with the execution plan it
chooses on its own (``mesh="auto"``, pre-cast kernels, chunks), unless overridden below.

The peers (``runtimes.py``; each optional, skipped with a note when not installed):
torch eager, torch.compile (Inductor, freezing), ONNX Runtime (the peer's graph exported once),
OpenVINO; f32 and bf16 (the engine's bf16 policy: bf16 matmul inputs, f32 accumulation and
activations; torch as bf16 weights and under ``torch.autocast``; OpenVINO's bf16 inference
precision). Each repeat runs every side once, in turn (engine, then the peers), after warm-up;
medians are compared, and the ratio is the engine's over the BEST peer of that dtype and batch.
MFU is achieved FLOP/s (``ViTConfig.flops_per_image``) over (a) the best GEMM GFLOP/s measured
in this run (JAX or torch, same dtype; ``benchlib.CPU_GEMMS``) and (b) the CPU's theoretical
peak (``benchlib.theoretical_peak``: cores x FMA units x lanes x 2 x clock, assumptions stated).

    python benchmarks/forward.py                                   # batches 1 8 32, f32 and bf16
    python benchmarks/forward.py --dtypes bfloat16 --batches 32 --chunk-images 0   # a lever off
    python benchmarks/forward.py --peers "torch eager" onnxruntime                  # some peers
    python benchmarks/forward.py --model vit-ti/16 --batches 2 --repeats 1          # plumbing

The last line of stdout is one JSON object; ``ratio_<dtype>_b<batch>`` (engine / best peer
images/s) are the figures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (
    alternate,
    emit,
    log,
    machine,
    matmul_peaks,
    median,
    plan_extras,
    theoretical_peak,
)
from runtimes import runners

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from peers import rel_err  # noqa: E402  (the parity tests' measure of agreement)

PEER_SIZES = {  # transformers.ViTConfig fields of the presets benchmarked here
    "vit-b/16": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072, patch_size=16, image_size=224),
    "vit-s/16": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                     intermediate_size=1536, patch_size=16, image_size=224),
    "vit-ti/16": dict(hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                      intermediate_size=768, patch_size=16, image_size=224),
}


def hf_peer(model: str, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.ViTConfig(**PEER_SIZES[model])
    return transformers.ViTModel(config, add_pooling_layer=False).eval()


def imported(peer, model: str):
    """The peer's weights through this project's Hugging Face importer."""
    from vit22b.model.convert import convert

    with tempfile.TemporaryDirectory() as folder:
        peer.save_pretrained(folder)
        converted = convert("hf", folder)
    return converted.config.replace(name=model), converted.params, converted.source


def compare(engine, peers: dict, batch: int, repeats: int, rng) -> dict:
    """One batch size: warm-up (a peer failing there is dropped, with its reason), agreement of
    the pooled features, alternating timed runs."""
    import numpy as np
    from vit22b.model.outputs import POOLED

    cfg, outputs = engine.cfg, engine.resolve(POOLED)
    x = rng.standard_normal((batch, cfg.image_size, cfg.image_size, 3), np.float32)
    x_nchw = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    sides = {"engine": lambda: engine.forward(x, outputs)["pooled"]}
    sides.update({name: (lambda fn=fn: fn(x_nchw)) for name, fn in peers.items()})
    results, failed, warm_s = {}, {}, {}
    for name, fn in sides.items():  # warm-up (and compile), twice
        start = time.perf_counter()
        try:
            results[name] = fn()
            fn()
        except Exception as err:  # noqa: BLE001 - a peer that cannot run is reported
            if name == "engine":
                raise
            failed[name] = f"failed at batch {batch}: {type(err).__name__}: {str(err)[:200]}"
        warm_s[name] = round(time.perf_counter() - start, 1)
    sides = {name: fn for name, fn in sides.items() if name not in failed}
    agreement = {n: rel_err(results["engine"], out) for n, out in results.items() if n != "engine"}
    ips = {name: batch / median(t) for name, t in alternate(sides, repeats).items()}
    return {"images_per_s": ips, "agreement": agreement, "failed": failed, "warm_up_s": warm_s}


def mfu(images_per_s: float, flops: float, peak_gflops: float | None) -> float | None:
    return round(images_per_s * flops / 1e9 / peak_gflops, 3) if peak_gflops else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-b/16", choices=sorted(PEER_SIZES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, default=None,
                        help="engine override: this many devices on the data axis "
                        "(default: mesh 'auto', the engine's own choice)")
    parser.add_argument("--chunk-images", type=int, default=None,
                        help="engine override: images per device and step (0: no chunks)")
    parser.add_argument("--no-precast", action="store_true", help="engine override (ablation)")
    parser.add_argument("--no-peak", action="store_true",
                        help="skip the measured GEMM peak (MFU against the theoretical only)")
    parser.add_argument("--peers", nargs="+", default=None,
                        help="only these peers (names as in the table); default: every one")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()  # what `vit22b serve` does before jax starts
    import jax
    import numpy as np
    import torch
    from vit22b.model.sharding import make_mesh, shard_params
    from vit22b.server.engine import Engine, auto_mesh

    peer = hf_peer(args.model, args.seed)
    cfg, params, source = imported(peer, args.model)
    flops = cfg.flops_per_image()
    log(f"{args.model}: {flops / 1e9:.1f} GFLOP/image; torch threads {torch.get_num_threads()}, "
        f"jax devices {jax.device_count()}, attention {peer.config._attn_implementation}")
    peaks = {} if args.no_peak else matmul_peaks()
    if peaks:
        log("GEMM GFLOP/s: " + ", ".join(f"{k} {v}" for k, v in peaks.items()))
    theory = theoretical_peak()
    log(f"theoretical peak: {theory['assumption']} = {theory['peak_float32']} / "
        f"{theory['peak_bfloat16']} GFLOP/s (f32 / bf16)")

    rng = np.random.default_rng(args.seed)
    rows, figures, skipped = [], {}, {}
    folder = tempfile.TemporaryDirectory(prefix="vit22b-onnx-")
    for dtype in args.dtypes:
        cfg_d = cfg.replace(compute_dtype=dtype)
        mesh = (auto_mesh(cfg_d) if args.devices is None
                else make_mesh(f"data={args.devices},model=1", jax.devices()[: args.devices]))
        engine = Engine(cfg_d, shard_params(cfg_d, params, mesh), mesh, fingerprint="bench",
                        source=source, max_batch_images=max(args.batches),
                        chunk_images=args.chunk_images, precast=not args.no_precast)
        peers, skipped[dtype] = runners(peer, dtype, cfg.image_size, folder.name)
        if args.peers is not None:
            peers = {n: fn for n, fn in peers.items() if n in args.peers}
        for name, why in skipped[dtype].items():
            log(f"{dtype}: peer {name} skipped: {why}")
        for batch in args.batches:
            measured = compare(engine, peers, batch, args.repeats, rng)
            ips, agreement = measured["images_per_s"], measured["agreement"]
            skipped[dtype].update(measured["failed"])
            peers = {n: fn for n, fn in peers.items() if n not in measured["failed"]}
            best = max((n for n in ips if n != "engine"), key=ips.get, default=None)
            ratio = ips["engine"] / ips[best] if best else None
            peak = peaks.get(f"peak_{dtype}")
            bucket = engine.bucket(batch)
            row = {
                "dtype": dtype,
                "batch": batch,
                "engine_mesh": engine.mesh_spec,
                "engine_bucket": bucket,
                "engine_chunk_images": engine.plan.chunk_images(bucket),
                "engine_transposed": sorted(engine.plan.transposed_kernels),
                "engine_mlp_slices": engine.plan.mlp_slices(bucket),
                "engine_images_per_s": round(ips["engine"], 2),
                "peer": best,
                "peer_images_per_s": round(ips[best], 2) if best else None,
                "peers_images_per_s": {n: round(v, 2) for n, v in ips.items() if n != "engine"},
                "ratio": round(ratio, 3) if ratio else None,
                "engine_mfu": mfu(ips["engine"], flops, peak),
                "peer_mfu": mfu(ips[best], flops, peak) if best else None,
                "engine_mfu_theoretical": mfu(ips["engine"], flops, theory[f"peak_{dtype}"]),
                "peer_mfu_theoretical": (mfu(ips[best], flops, theory[f"peak_{dtype}"])
                                         if best else None),
                "pooled_rel_err": {n: float(f"{e:.2g}") for n, e in agreement.items()},
                "warm_up_s": measured["warm_up_s"],
            }
            rows.append(row)
            figures[f"ratio_{dtype}_b{batch}"] = row["ratio"]
            log(f"{dtype:8s} b={batch:<3d} engine {ips['engine']:6.2f} img/s "
                f"[{engine.mesh_spec}, chunk {row['engine_chunk_images']}"
                f"{plan_extras(row)}]  "
                + "  ".join(f"{n} {v:6.2f}" for n, v in ips.items() if n != "engine")
                + f"  ratio {row['ratio']} (vs {best})  rel err {row['pooled_rel_err']}")
        engine.close()
    folder.cleanup()
    emit({
        "benchmark": "forward",
        "model": args.model,
        "flops_per_image": flops,
        "repeats": args.repeats,
        "overrides": {"devices": args.devices, "chunk_images": args.chunk_images,
                      "precast": not args.no_precast},
        "matmul_gflops": peaks,
        "theoretical_peak": theory,
        "skipped_peers": skipped,
        "rows": rows,
        **figures,
        "machine": machine(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
