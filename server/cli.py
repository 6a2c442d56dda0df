"""`vit22b serve`: the gRPC feature server.

With no arguments it serves the embedded default (the tiny ViT-22B-recipe preset, weights from a
fixed seed, labelled ``init:seed=0`` in GetModelInfo) on all local devices, on 127.0.0.1:50051.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from .cpu_devices import emulate_cpu_devices

emulate_cpu_devices()  # before jax is imported (below): the device count is fixed at its start

from vit22b.model import DEFAULT_MODEL, OutputRequest  # noqa: E402

from .app import ServeConfig, serve_until_signal  # noqa: E402
from .distributed_cli import add_group_arguments, group_from_args, supervise  # noqa: E402


def parse_outputs(spec: str) -> OutputRequest:
    """``pooled``, ``pooled+class_token``, ``patch:-1,-4+pooled`` ... -> an OutputRequest."""
    fields: dict = {"pooled": False}
    for part in filter(None, spec.split("+")):
        if part.startswith("patch:"):
            fields["patch_layers"] = tuple(int(v) for v in part[len("patch:") :].split(","))
        elif part in ("pooled", "class_token", "attention_stats", "logits", "norm_patches"):
            fields[part] = True
        else:
            raise argparse.ArgumentTypeError(f"unknown output {part!r} in {spec!r}")
    return OutputRequest(**fields)


def add_arguments(command: str, parser: argparse.ArgumentParser):
    d = ServeConfig()
    parser.add_argument(
        "--model", help=f"preset name (default {DEFAULT_MODEL}, or the checkpoint's)"
    )
    parser.add_argument("--checkpoint", help="checkpoint directory (vit22b init / convert)")
    parser.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the random weights when no checkpoint is given",
    )
    parser.add_argument(
        "--mesh",
        default=d.mesh,
        help="device mesh, e.g. data=2,model=4 (default: all devices on data)",
    )
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="Prometheus /metrics port; 0 picks a free one, -1 turns it off",
    )
    parser.add_argument("--token-file", help="bearer tokens, one per line (health stays open)")
    parser.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key")
    parser.add_argument("--max-batch-images", type=int, default=d.max_batch_images)
    parser.add_argument(
        "--max-delay-ms", type=float, default=d.max_delay_ms, help="longest wait for a fuller batch"
    )
    parser.add_argument(
        "--max-queue-images",
        type=int,
        default=d.max_queue_images,
        help="admitted images not yet computed; beyond: RESOURCE_EXHAUSTED",
    )
    parser.add_argument("--max-request-images", type=int, default=d.max_request_images)
    parser.add_argument(
        "--max-message-mb",
        type=float,
        default=d.max_message_mb,
        help="largest request or response message, MiB",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=d.max_image_pixels,
        help="largest decoded image (decompression-bomb guard)",
    )
    parser.add_argument("--preprocess-threads", type=int, default=d.preprocess_threads)
    parser.add_argument(
        "--chunk-images",
        type=int,
        default=d.chunk_images,
        help="at most this many images per device in one sequential step of a batch "
        "(0: whole batches); default: the platform's plan (bf16 on CPU: chunks)",
    )
    parser.add_argument(
        "--warm-outputs",
        type=parse_outputs,
        action="append",
        help="output set to compile before SERVING (repeatable), e.g. "
        "'pooled' or 'pooled+patch:-1,-4'; default: pooled",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        help="seconds accepted calls get to finish after SIGTERM",
    )
    parser.add_argument("--log-level", default="INFO")
    add_group_arguments(parser)
    return run


def run(args: argparse.Namespace) -> int:
    logging.getLogger("jax").setLevel(logging.WARNING)  # backend probing is not news
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ServeConfig(
        model=args.model,
        checkpoint=args.checkpoint,
        mesh=args.mesh,
        seed=args.seed,
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        token_file=args.token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_batch_images=args.max_batch_images,
        max_delay_ms=args.max_delay_ms,
        max_queue_images=args.max_queue_images,
        max_request_images=args.max_request_images,
        max_message_mb=args.max_message_mb,
        max_image_pixels=args.max_image_pixels,
        preprocess_threads=args.preprocess_threads,
        chunk_images=args.chunk_images,
        warm_outputs=tuple(args.warm_outputs or (OutputRequest(),)),
        drain_timeout_s=args.drain_timeout,
    )
    try:
        config.check()
        group = group_from_args(args)  # several processes: supervise this one's JAX process
        if group is not None:
            return supervise(config, group, args.log_level)
        return asyncio.run(serve_until_signal(config))
    except (ValueError, OSError) as err:  # bad flags, mesh, model, checkpoint or port
        print(f"vit22b serve: {err}", file=sys.stderr)
        return 2
