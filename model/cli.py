"""`vit22b models` and `vit22b info`: the presets and their sizes, from abstract shapes."""

from __future__ import annotations

import argparse
import json
import sys

from .config import DEFAULT_MODEL, PRESETS, get_config


def _models(args: argparse.Namespace) -> int:
    columns = ("name", "block", "width", "depth", "heads", "mlp", "patch", "res", "head", "norm")
    rows = [
        (
            name + (" (default)" if name == DEFAULT_MODEL else ""),
            c.block,
            c.width,
            c.depth,
            c.heads,
            c.mlp_dim,
            c.patch,
            c.image_size,
            c.head,
            c.norm + ("+qk" if c.qk_norm else ""),
        )
        for name, c in PRESETS.items()
    ]
    widths = [max(len(str(v)) for v in col) for col in zip(columns, *rows)]
    for row in (columns, *rows):
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def _info(args: argparse.Namespace) -> int:
    from .info import model_info  # imports jax: only when asked

    try:
        cfg = get_config(args.model)
        print(json.dumps(model_info(cfg, mesh=args.mesh, dtype=args.dtype), indent=2))
    except ValueError as err:  # ConfigError, MeshError, bad flags
        print(f"vit22b info: {err}", file=sys.stderr)
        return 2
    return 0


def add_arguments(command: str, parser: argparse.ArgumentParser):
    if command == "models":
        return _models
    parser.add_argument("--model", default=DEFAULT_MODEL, help="preset name (vit22b models)")
    parser.add_argument("--mesh", help="e.g. data=1,model=8: adds bytes_per_device")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="parameter dtype for bytes_per_device"
    )
    return _info
