"""`vit22b serve`: the gRPC feature server.

With no arguments it serves the embedded default (the tiny ViT-22B-recipe preset, weights from a
fixed seed, labelled ``init:seed=0`` in GetModelInfo) on 127.0.0.1:50051, every local device on
the data axis (two on a single-process CPU host: ``server.plan.auto_data_devices``).
"""

from __future__ import annotations

import argparse
import sys

from .cpu_devices import prepare_xla_cpu

prepare_xla_cpu()  # before jax is imported (in run): the device count is fixed at its start

from vit22b.clients import settings  # noqa: E402

from . import logs  # noqa: E402
from .distributed_cli import add_group_arguments, group_from_args, supervise  # noqa: E402
from .settings import ServeConfig  # noqa: E402


def add_arguments(command: str, parser: argparse.ArgumentParser):
    settings.add_arguments(parser, ServeConfig)
    add_group_arguments(parser)
    return run


def run(args: argparse.Namespace) -> int:
    try:
        config = settings.from_args(ServeConfig, args)
        logs.configure(config.log_level, config.log_format)
        group = group_from_args(args)  # several processes: supervise this one's JAX process
        if group is not None:
            config.check()  # here: before the JAX process starts
            return supervise(config, group)
        # the server's modules import jax: only once the flags are read, so that `--help` and a
        # bad flag answer at once (and a group's supervisor never imports it)
        from .app import serve_until_signal
        from .infer import run_loop

        return run_loop(serve_until_signal(config))  # FeatureServer checks the settings
    except (ValueError, OSError) as err:  # bad flags, mesh, model, checkpoint or port
        print(f"vit22b serve: {err}", file=sys.stderr)
        return 2
