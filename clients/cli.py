"""`vit22b` command line: a thin dispatcher.

Each subcommand lives in the module of its folder and is imported only when called, so
`vit22b embed --server ...` works on a client-only install (no jax) and `vit22b --help` is instant.
A command module provides ``add_arguments(command, parser) -> handler`` where ``handler(args)``
returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from .settings import spell_flags

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("vit22b.model.cli", "list the model presets"),
    "info": ("vit22b.model.cli", "parameter count, FLOPs and memory of a preset (abstract shapes)"),
    "init": ("vit22b.model.checkpoint_cli", "write a checkpoint with seeded random weights"),
    "convert": ("vit22b.model.checkpoint_cli",
                "convert timm / Hugging Face / open_clip / big_vision weights"),
    "serve": ("vit22b.server.cli", "run the gRPC feature server"),
    "embed": ("vit22b.clients.embed_cli", "embed folders of images or videos into sharded outputs"),
    "probe": ("vit22b.probes.cli", "evaluate features with a probe (linear, knn, depth, ...)"),
    "explore": ("vit22b.probes.cli", "attention-entropy explorer: QK-norm and block types"),
}

# The extra each command needs beyond the base install (the client SDK); `embed` needs one only
# for what it runs here (embed_cli.py asks for it: --local, --frames, --format parquet, ...).
EXTRA_OF_COMMAND = {"info": "model", "init": "model", "convert": "model", "serve": "server",
                    "probe": "probes", "explore": "probes"}

# Which extra brings each optional dependency (by the top-level name it is imported as).
EXTRA_OF_DEPENDENCY = {
    **dict.fromkeys(("jax", "jaxlib", "flax", "orbax", "tensorstore", "safetensors",
                     "huggingface_hub", "simplejpeg", "pillow_heif"), "model"),
    **dict.fromkeys(("grpc_health", "grpc_reflection", "prometheus_client", "fastapi",
                     "pydantic", "jiter", "uvicorn", "httptools", "uvloop", "opentelemetry"),
                    "server"),
    **dict.fromkeys(("optax", "sklearn", "scipy", "matplotlib"), "probes"),
    **dict.fromkeys(("fsspec", "s3fs", "gcsfs", "pyarrow"), "storage"),
    "ray": "ray",
    "av": "video",
}

# model < server < probes: each of these extras includes the ones before it.
_NESTED = ("model", "server", "probes")


def extra_to_install(command: str, dependency: str | None) -> str | None:
    """The extra that brings ``dependency`` to ``command``; None for a module no extra brings."""
    extra = EXTRA_OF_DEPENDENCY.get((dependency or "").split(".")[0])
    if extra is None:
        return None
    own = EXTRA_OF_COMMAND.get(command)
    if extra in _NESTED and own in _NESTED:
        return max(extra, own, key=_NESTED.index)
    return extra


def needed_by(what: str, extra: str, err: ModuleNotFoundError) -> ModuleNotFoundError:
    """``err`` marked with what needs the missing module and the extra that brings what does
    (``embed --local`` needs all of `server`, where jax alone would name `model`)."""
    err.what, err.extra = what, extra
    return err


def _missing(command: str, err: ModuleNotFoundError) -> int:
    """Exit 2 saying what to install; a module no extra brings (ours), or a part missing from
    a package that is installed (another version's layout), is a bug: raised."""
    extra = extra_to_install(command, err.name)
    top = (err.name or "").split(".")[0]
    if extra is None or top != err.name and importlib.util.find_spec(top) is not None:
        raise err
    extra = getattr(err, "extra", None) or extra
    what = getattr(err, "what", None)
    needs = f"{what} needs" if what else "needs"
    print(f"vit22b {command}: {needs} {err.name.split('.')[0]}, which is not installed; "
          f"install it with: pip install 'vit22b[{extra}]'", file=sys.stderr)
    return 2


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
        parser = argparse.ArgumentParser(prog=f"vit22b {name}", description=help_)
        handler = module.add_arguments(name, parser)
        args = parser.parse_args(spell_flags(parser, argv[1:]))
        return int(handler(args) or 0)
    except ModuleNotFoundError as err:  # also one imported on first use (jax for `info`)
        return _missing(name, err)
    except KeyboardInterrupt:  # Ctrl-C where a command has no stop of its own: no traceback
        print(f"vit22b {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `vit22b models | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second complaint
        return 0


if __name__ == "__main__":
    sys.exit(main())
