"""ViT-22B/14 in bf16 on one GPU: the engine against a PyTorch peer, MFU against a measured peak.

One prepared script for a single H200 (about 141 GB: the 43.5 GB of bf16 weights fit once for
JAX and once for PyTorch). Needs jax with CUDA (``pip install 'jax[cuda12]'``) and, for the
peer, a CUDA torch and timm (run through tests/peers.py's torchvision stand-in).

- engine: ``Engine`` with weights from a seeded init created directly on the device
  (``init_sharded``), ``mesh="auto"`` (one GPU: data=1); its forward as the server runs it
  (bucket padding, host -> device images, pooled features back to the host);
- peer: timm's ``VisionTransformer`` with ``ParallelScalingBlock`` (the ViT-22B block: one fused
  in-projection, QK-norm, RmsNorm, MAP head, no class token), created on the GPU in bf16 with
  timm's own seeded init, eager, ``inference_mode``; skipped (and said so) if it does not fit;
- peak: the best bf16 GEMM (f32 accumulation, n = 8192 and 16384) of JAX and torch on this GPU,
  same run;
- MFU: ``ViTConfig.flops_per_image`` x images/s over that peak (and over the datasheet figure
  given by ``--datasheet-tflops``, for reference only).
Each repeat runs the engine then the peer, after warm-up; medians are compared.

    python benchmarks/gpu_22b.py                                   # on the GPU machine
    python benchmarks/gpu_22b.py --dry-run                         # the same logic on CPU:
                                                                   # vit-22b-tiny/16, tiny batches

The dry run also converts the peer's weights through the timm importer and checks that both
sides give the same features (for the 22B model both sides use their own seeded init: the
speed does not depend on the values, and a 22B host-side conversion would need 87 GB of RAM).
The last line of stdout is one JSON object; ``ratio_engine_to_peer_b<batch>`` and
``engine_mfu_b<batch>`` are the figures (target: MFU >= 0.5).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchlib import alternate, emit, log, machine, matmul_peaks, median

TESTS = Path(__file__).resolve().parents[1] / "tests"


def timm_peer(cfg, device: str, dtype):
    """timm's ParallelScalingBlock ViT with ``cfg``'s sizes (the ViT-22B recipe), on ``device``."""
    import torch

    sys.path.insert(0, str(TESTS))
    from peers import import_timm

    timm = import_timm()
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = timm.create_model(
                "vit_base_patch16_xp_224",
                pretrained=False,
                img_size=cfg.image_size,
                patch_size=cfg.patch,
                embed_dim=cfg.width,
                depth=cfg.depth,
                num_heads=cfg.heads,
                mlp_ratio=cfg.mlp_dim / cfg.width,
                num_classes=0,
                class_token=False,
                global_pool="map",
                pre_norm=False,
            )
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def peer_params(model, cfg):
    """The peer's weights in this project's layout (timm importer), as the config's preset."""
    from safetensors.torch import save_file
    from vit22b.model.convert import convert
    from vit22b.model.convert_common import Hints

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "peer.safetensors")
        save_file({k: v.float().cpu().contiguous() for k, v in model.state_dict().items()}, path)
        converted = convert("timm", path, Hints(preset=cfg, dtype=cfg.param_dtype))
    return converted.params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-22b/14")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gemm-sizes", type=int, nargs="+", default=[8192, 16384],
                        help="sides of the GEMMs the peak is the best of")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--datasheet-tflops", type=float, default=989.0,
                        help="dense bf16 TFLOP/s of the GPU's datasheet (H200 SXM: 989)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, vit-22b-tiny/16, batches 2 and 4: checks the script's logic")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.model, args.batches, args.repeats = "vit-22b-tiny/16", [2, 4], 2
        args.gemm_sizes = [1024]
    # Leave the GPU's memory to both libraries: JAX must not pre-allocate 75% of it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax
    import numpy as np
    from vit22b.model import get_config
    from vit22b.model.outputs import POOLED
    from vit22b.model.sharding import init_sharded, shard_params
    from vit22b.server.engine import Engine, auto_mesh

    platform = jax.devices()[0].platform
    if platform != "gpu" and not args.dry_run:
        log(f"no GPU visible to jax (platform {platform!r}); use --dry-run to check on CPU")
        return 2
    cfg = get_config(args.model)
    flops = cfg.flops_per_image()
    mesh = auto_mesh(cfg)
    log(f"{cfg.name}: {flops / 1e12:.2f} TFLOP/image, {jax.devices()[0].device_kind}, "
        f"mesh {dict(mesh.shape)}")

    torch_device = "cpu" if args.dry_run else "cuda"
    peer_device = None if args.no_peer else torch_device
    cubes = tuple((n, n, n) for n in args.gemm_sizes)
    peaks = matmul_peaks(cubes, 5, peer_device, ("bfloat16",))
    peak = peaks["peak_bfloat16"]
    log(f"bf16 GEMM GFLOP/s: {peaks}")

    peer, peer_error = None, None
    if not args.no_peer:
        import torch

        try:
            peer = timm_peer(cfg, torch_device, torch.bfloat16)
        except torch.OutOfMemoryError as err:  # report it; the engine's figures stand alone
            peer_error = f"the peer does not fit beside the engine: {err}".splitlines()[0]
            log(peer_error)
    if peer is not None and args.dry_run:
        params = shard_params(cfg, peer_params(peer, cfg), mesh)
    else:
        params = init_sharded(cfg, mesh, seed=0)
    engine = Engine(cfg, params, mesh, fingerprint="seeded", source="init:seed=0",
                    max_batch_images=max(args.batches))
    outputs = engine.resolve(POOLED)

    rng = np.random.default_rng(0)
    rows, figures = [], {}
    for batch in args.batches:
        x = rng.standard_normal((batch, cfg.image_size, cfg.image_size, 3), np.float32)
        sides = {"engine": lambda x=x: engine.forward(x, outputs)["pooled"]}
        if peer is not None:
            sides["peer"] = peer_runner(peer, x, torch_device)
        results = {name: fn() for name, fn in sides.items()}  # warm-up and compile
        agreement = None
        if "peer" in results and args.dry_run:
            sys.path.insert(0, str(TESTS))
            from peers import rel_err

            agreement = float(f"{rel_err(results['engine'], results['peer']):.2g}")
        ips = {n: batch / median(t) for n, t in alternate(sides, args.repeats).items()}
        row = {
            "batch": batch,
            "engine_images_per_s": round(ips["engine"], 3),
            "engine_mfu": round(ips["engine"] * flops / 1e9 / peak, 3),
            "engine_mfu_datasheet": round(ips["engine"] * flops / 1e12 / args.datasheet_tflops, 3),
        }
        if "peer" in ips:
            row.update(
                peer_images_per_s=round(ips["peer"], 3),
                peer_mfu=round(ips["peer"] * flops / 1e9 / peak, 3),
                ratio=round(ips["engine"] / ips["peer"], 3),
            )
            figures[f"ratio_engine_to_peer_b{batch}"] = row["ratio"]
        if agreement is not None:
            row["pooled_rel_err"] = agreement
        figures[f"engine_mfu_b{batch}"] = row["engine_mfu"]
        rows.append(row)
        log(f"b={batch}: {row}")
    emit({
        "benchmark": "gpu_22b",
        "dry_run": args.dry_run,
        "platform": platform,
        "device_kind": jax.devices()[0].device_kind,
        "model": cfg.name,
        "flops_per_image": flops,
        "matmul_gflops": peaks,
        "peer": None if peer is None else "timm ParallelScalingBlock ViT, bf16, eager",
        "peer_error": peer_error,
        "rows": rows,
        **figures,
        "machine": machine(),
    })
    return 0


def peer_runner(model, x, device: str):
    import numpy as np
    import torch

    pixels = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).to(device)
    pixels = pixels.to(torch.bfloat16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        with torch.inference_mode():
            out = model.forward_head(model.forward_features(pixels), pre_logits=True)
        sync()
        return out.float().cpu().numpy()

    return run


if __name__ == "__main__":
    sys.exit(main())
