"""`vit22b init` and `vit22b convert`: write a checkpoint from a seed or from public weights.

    vit22b init --model vit-22b-tiny/16 --seed 0 --out ckpt/tiny
    vit22b convert --from timm --input vit_base_patch16_224.safetensors --heads 12 --out ckpt/b16
    vit22b convert --from hf --input google-vit-base-patch16-224/ --model vit-b/16 --out ckpt/hf
    vit22b convert --from hf --input openai/clip-vit-base-patch16 --out ckpt/clip   # the hub
    vit22b convert --from timm --input hf-hub:timm/vit_small_patch14_dinov2.lvd142m --heads 6 ...
    vit22b convert --from big_vision --input vit.npz --heads 12 --mean 0.5 0.5 0.5 --resize 256 ...

The last line printed is one JSON object describing the checkpoint (path, model, fingerprint, ...).
"""

from __future__ import annotations

import argparse
import json
import sys

from .compile_cache import COMPILE_CACHE_DEFAULT_HELP, COMPILE_CACHE_HELP, default_compile_cache
from .config import DEFAULT_MODEL, INTERPOLATIONS, SOURCES, ConfigError, get_config, parse_seed
from .schema import real_number, whole_number


def _summary(out: str, meta, **extra) -> str:
    cfg = meta.config
    return json.dumps(
        {
            "path": out,
            "model": cfg.name,
            "source": meta.source,
            "fingerprint": meta.fingerprint,
            "param_count": meta.param_count,
            "param_bytes": meta.param_bytes,
            "param_dtype": cfg.param_dtype,
            "compute_dtype": cfg.compute_dtype,
            "num_classes": cfg.num_classes,
            "preprocess_hash": meta.preprocess_hash,
            **extra,
        }
    )


def _init(args: argparse.Namespace) -> int:
    from .checkpoint import check_writable, save
    from .compile_cache import use_compile_cache
    from .sharding import init_sharded, make_mesh

    check_writable(args.out, args.overwrite)  # before minutes of initialising a large model
    cfg = get_config(args.model)
    if args.dtype:
        cfg = cfg.replace(param_dtype=args.dtype)
    if args.compute_dtype:
        cfg = cfg.replace(compute_dtype=args.compute_dtype)
    mesh = make_mesh(args.mesh) if args.mesh else _tensor_parallel_mesh(cfg)
    try:
        use_compile_cache(args.compile_cache or default_compile_cache())
    except ValueError as err:  # a folder given that cannot be one
        raise ConfigError(str(err)) from None
    params = init_sharded(cfg, mesh, args.seed)
    meta = save(args.out, cfg, params, f"init:seed={args.seed}", overwrite=args.overwrite)
    print(_summary(args.out, meta))
    return 0


def _tensor_parallel_mesh(cfg):
    """The most devices that split the heads evenly, all on the model axis: no replicas."""
    import jax

    from .sharding import make_mesh

    devices = jax.devices()
    model = max(
        n for n in range(1, len(devices) + 1) if cfg.heads % n == 0 and cfg.mlp_dim % n == 0
    )
    return make_mesh(f"data=1,model={model}", devices[:model])


def _convert(args: argparse.Namespace) -> int:
    from .checkpoint import check_writable, save
    from .convert import Hints, convert
    from .convert_preprocess import PreprocessFlags

    check_writable(args.out, args.overwrite)
    hints = Hints(
        preset=get_config(args.model) if args.model else None,
        heads=args.heads,
        dtype=args.dtype,
        mlp=args.mlp,
    )
    flags = PreprocessFlags(
        resize=args.resize,
        crop=args.crop,
        interpolation=args.interpolation,
        mean=tuple(args.mean) if args.mean else None,
        std=tuple(args.std) if args.std else None,
    )
    converted = convert(args.source, args.input, hints, flags)
    for note in converted.notes:
        print(f"note: {note}", file=sys.stderr)
    cfg = converted.config
    if args.compute_dtype:  # the default every server of this checkpoint computes in
        cfg = cfg.replace(compute_dtype=args.compute_dtype)
    meta = save(
        args.out,
        cfg,
        converted.params,
        converted.source,
        notes=tuple(converted.notes),
        overwrite=args.overwrite,
    )
    print(_summary(args.out, meta, preprocess_from=converted.preprocess_from))
    return 0


def _guarded(handler):
    """Every refusal (bad preset, mesh, checkpoint or source) is one line on stderr, exit 2;
    a failed write (the disk's error) one line too, exit 1. Their modules import jax: only when
    the command runs, so that `--help` and a bad flag answer at once."""

    def run(args: argparse.Namespace) -> int:
        from .checkpoint import CheckpointError
        from .convert import ConvertError
        from .sharding import MeshError

        try:
            return handler(args)
        except (ConfigError, MeshError, CheckpointError, ConvertError) as err:
            print(f"vit22b {args.command}: {err}", file=sys.stderr)
            return 2
        except OSError as err:  # the disk's word: a folder that cannot be made, a full disk
            print(f"vit22b {args.command}: {err.filename or args.out}: {err.strerror or err}",
                  file=sys.stderr)
            return 1

    return run


def add_arguments(command: str, parser: argparse.ArgumentParser):
    parser.set_defaults(command=command)
    dtype_help = "parameter dtype (default: the preset's, or the source's)"
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help=dtype_help)
    parser.add_argument(
        "--compute-dtype",
        choices=("bfloat16", "float32"),
        help="matmul input dtype stored as the checkpoint's default (float32: exact, float32 end "
        "to end; default: the preset's, bfloat16)",
    )
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
    if command == "init":
        parser.add_argument("--model", default=DEFAULT_MODEL, help="preset name (vit22b models)")
        parser.add_argument("--seed", type=parse_seed, default=0)
        parser.add_argument(
            "--mesh",
            help="mesh the weights are created on, e.g. data=1,model=8 (default: as many devices "
            "as split the heads, on the model axis)",
        )
        parser.add_argument(
            "--compile-cache", metavar="DIR|off",
            help=f"for the seeded init's program (seconds of compiling even for the tiny "
            f"preset): {COMPILE_CACHE_HELP} ({COMPILE_CACHE_DEFAULT_HELP})",
        )
        return _guarded(_init)
    parser.add_argument("--from", dest="source", required=True, choices=SOURCES)
    parser.add_argument(
        "--input",
        required=True,
        help="weight file, or a directory holding one, or a Hugging Face Hub model: ORG/NAME "
        "(--from hf) or hf-hub:ORG/NAME, each with an optional @REVISION, read from the hub "
        "cache (HF_HUB_CACHE / HF_HOME) or downloaded into it unless HF_HUB_OFFLINE=1",
    )
    parser.add_argument(
        "--model", help="preset the checkpoint must match (default: inferred from the weights)"
    )
    parser.add_argument(
        "--heads", type=whole_number,
        help="attention heads, when neither weights nor config.json tell"
    )
    parser.add_argument(
        "--mlp",
        choices=("gelu", "quick_gelu"),
        help="the MLP's activation, when the source's config does not say (OpenCLIP)",
    )
    group = parser.add_argument_group(
        "preprocessing", "each replaces what the source's files say (or supplies it)"
    )
    channels = dict(nargs=3, type=real_number, metavar=("R", "G", "B"))
    group.add_argument("--mean", **channels, help="per-channel mean of pixels scaled to [0, 1]")
    group.add_argument("--std", **channels, help="per-channel std (positive)")
    group.add_argument("--resize", type=whole_number, help="the shorter side is resized to this")
    group.add_argument(
        "--crop", type=whole_number, help="centre crop: the served input size (a learned "
        "position table of another size is resampled as its source does)"
    )
    group.add_argument("--interpolation", choices=INTERPOLATIONS, help="resampling of the resize")
    return _guarded(_convert)
