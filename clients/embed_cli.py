"""`vit22b embed INPUT... --output DIR`: embed folders, globs or list files into sharded outputs.

Backends: ``--server ADDR`` (repeatable; work is spread over all of them and moves off one that
fails) or ``--local`` (the in-process engine: ``--model``, ``--checkpoint``, ``--mesh``), which is
also what runs when neither is given. Remote mode never imports jax.
"""

from __future__ import annotations

import argparse
import sys

from .embed import DTYPE_CHOICES, OUTPUT_CHOICES, JobConfig, JobFailed, OutputSpec, run_job
from .embed_inputs import InputListError, enumerate_inputs
from .embed_store import JobMismatch
from .outputs import OutputsError


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want integers like -1,6; got {text!r}") from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(command: str, parser: argparse.ArgumentParser):
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="folder (recursive), glob, or list file (.txt/.lst/.list) of paths")
    parser.add_argument("--output", "-o", required=True, metavar="DIR",
                        help="output directory; rerunning the same command resumes it")
    backend = parser.add_argument_group("backend (default: --local with the embedded model)")
    backend.add_argument("--server", action="append", default=[], metavar="ADDR",
                         help="feature server host:port; repeat to spread over several")
    backend.add_argument("--token", help="bearer token for the servers")
    backend.add_argument("--tls", nargs="?", const=True, default=False, metavar="ROOTS_PEM",
                         help="TLS to the servers (system roots, or this PEM of trusted roots)")
    backend.add_argument("--local", action="store_true", help="run the engine in this process")
    backend.add_argument("--model", help="local: preset name (default: the embedded model)")
    backend.add_argument("--checkpoint", help="local: checkpoint directory")
    backend.add_argument("--mesh", default="auto", help="local: e.g. data=2,model=4")
    backend.add_argument("--seed", type=int, default=0, help="local: seed of random weights")
    what = parser.add_argument_group("outputs")
    what.add_argument("--outputs", default="pooled",
                      help=f"comma-separated of {', '.join(OUTPUT_CHOICES)} (default: pooled)")
    what.add_argument("--layers", type=_layers, default=None,
                      help="patch-token layers, e.g. -1,6 (implies patch_tokens; default -1)")
    what.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    what.add_argument("--l2-normalize", action="store_true", help="L2-normalise pooled features")
    what.add_argument("--normalize-patches", action="store_true",
                      help="apply the encoder's final norm to patch tokens")
    job = parser.add_argument_group("job")
    job.add_argument("--batch-size", type=_positive, default=32, help="images per request")
    job.add_argument("--shard-size", type=_positive, default=1024, help="images per shard")
    job.add_argument("--concurrency", type=_positive, default=2,
                     help="requests in flight per server (local: worker threads)")
    job.add_argument("--ext", type=_csv, default=[],
                     help="only files with these extensions, e.g. jpg,png (default: every file)")
    job.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return run


def output_spec(args: argparse.Namespace) -> OutputSpec:
    kinds = set(_csv(args.outputs))
    unknown = kinds - set(OUTPUT_CHOICES)
    if unknown:
        raise ValueError(f"unknown output {sorted(unknown)[0]!r}; choose from {OUTPUT_CHOICES}")
    if args.layers is not None:
        kinds.add("patch_tokens")
    layers = (args.layers or (-1,)) if "patch_tokens" in kinds else ()
    return OutputSpec(
        pooled="pooled" in kinds,
        class_token="class_token" in kinds,
        patch_layers=tuple(layers),
        dtype=args.dtype,
        l2_normalize=args.l2_normalize,
        normalize_patches=args.normalize_patches,
    )


def make_backend(args: argparse.Namespace, spec: OutputSpec):
    if args.server and (args.local or args.checkpoint or args.model):
        raise ValueError("--server and --local/--model/--checkpoint exclude each other")
    if args.server:
        from .embed_remote import RemoteBackend

        return RemoteBackend(args.server, spec, token=args.token, tls=args.tls,
                             batch_size=args.batch_size,
                             concurrency=args.concurrency, quiet=args.quiet)
    from .embed_local import LocalBackend  # imports jax

    backend = LocalBackend(spec, model=args.model, checkpoint=args.checkpoint, mesh=args.mesh,
                           seed=args.seed, batch_size=args.batch_size,
                           concurrency=args.concurrency)
    backend.warm_up()
    return backend


def run(args: argparse.Namespace) -> int:
    """Exit 0 complete, 1 incomplete (every server lost, at the start or during the job: rerun
    to resume), 2 bad options, inputs or a refused mix, 130 interrupted."""
    backend = None
    try:
        spec = output_spec(args)
        config = JobConfig(
            inputs=args.inputs,
            output=args.output,
            spec=spec,
            batch_size=args.batch_size,
            shard_size=args.shard_size,
            extensions=tuple(args.ext),
            quiet=args.quiet,
        )
        items = enumerate_inputs(config.inputs, config.extensions)  # fail fast, before the model
        backend = make_backend(args, spec)
        summary = run_job(config, backend, items)
    except (InputListError, JobMismatch, OutputsError, ValueError) as err:
        print(f"vit22b embed: {err}", file=sys.stderr)
        return 2
    except JobFailed as err:
        print(f"vit22b embed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vit22b embed: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        if backend is not None:
            backend.close()
    print(summary.line())
    return 0 if summary.complete else 1
