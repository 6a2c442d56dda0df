"""`vit22b` command line: a thin dispatcher.

Each subcommand lives in the module of its folder and is imported only when called, so
`vit22b embed --server ...` works on a client-only install (no jax) and `vit22b --help` is instant.
A command module provides ``add_arguments(command, parser) -> handler`` where ``handler(args)``
returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .settings import spell_bool_flags

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("vit22b.model.cli", "list the model presets"),
    "info": ("vit22b.model.cli", "parameter count, FLOPs and memory of a preset (abstract shapes)"),
    "init": ("vit22b.model.checkpoint_cli", "write a checkpoint with seeded random weights"),
    "convert": ("vit22b.model.checkpoint_cli", "convert timm / Hugging Face / big_vision weights"),
    "serve": ("vit22b.server.cli", "run the gRPC feature server"),
    "embed": ("vit22b.clients.embed_cli", "embed folders of images or videos into sharded outputs"),
    "probe": ("vit22b.probes.cli", "evaluate features with a probe (linear, knn, depth, ...)"),
    "explore": ("vit22b.probes.cli", "attention-entropy explorer: QK-norm and block types"),
}

EXTRA_FOR_MODULE = {
    "vit22b.model": "model",
    "vit22b.server": "server",
    "vit22b.probes": "probes",
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: vit22b COMMAND [options]   (vit22b COMMAND --help for its options)", ""]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"vit22b: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        package = ".".join(module_name.split(".")[:2])
        extra = EXTRA_FOR_MODULE.get(package, "all")
        print(
            f"vit22b {name}: needs a dependency that is not installed ({err.name}); "
            f"install it with: pip install 'vit22b[{extra}]'",
            file=sys.stderr,
        )
        return 2
    parser = argparse.ArgumentParser(prog=f"vit22b {name}", description=help_)
    handler = module.add_arguments(name, parser)
    args = parser.parse_args(spell_bool_flags(parser, argv[1:]))
    try:
        return int(handler(args) or 0)
    except BrokenPipeError:  # `vit22b models | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second complaint
        return 0


if __name__ == "__main__":
    sys.exit(main())
