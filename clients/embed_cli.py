"""`vit22b embed INPUT... --output DIR`: embed folders, globs or list files into sharded outputs.

Backends: ``--server ADDR`` (repeatable; work is spread over all of them and moves off one that
fails) or ``--local`` (the in-process engine: ``--model``, ``--checkpoint``, ``--mesh``), which is
also what runs when neither is given. Remote mode never imports jax. Runners: this process's
threads (default), or ``--runner ray`` (embed_ray: a Ray Data pipeline of ``--concurrency``
actors of the chosen backend, on the cluster at ``--ray-address``). ``--frames K`` makes it a
job over videos (clients/embed_video.py, either runner): inputs narrowed to video files unless
``--ext`` says.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, replace

from vit22b.model.compile_cache import (
    COMPILE_CACHE_DEFAULT_HELP,
    COMPILE_CACHE_HELP,
    default_compile_cache,
)
from vit22b.model.config import parse_seed
from vit22b.model.outputs import OutputRequest
from vit22b.model.schema import whole_number
from vit22b.v1 import wire

from . import settings
from .cli import needed_by
from .embed import (
    FORMAT_CHOICES,
    OUTPUT_CHOICES,
    JobConfig,
    JobFailed,
    OutputSpec,
    run_job,
)
from .embed_inputs import InputListError, enumerate_inputs
from .embed_ray import MAX_RETRIES
from .embed_store import JobMismatch, OutputStore
from .embed_video import video_arrays
from .outputs import OutputsError
from .settings import (
    COMPUTE_DTYPE_HELP,
    at_most,
    compute_dtype,
    non_negative,
    one_of,
    parse_tls,
    positive,
    setting,
)
from .storage import storage_failure
from .video import VIDEO_SUFFIXES, Sampling, load_av


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(whole_number(v) for v in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want integers like -1,6; got {text!r}") from None


MAX_CONCURRENCY = 1024  # an outside tester's --concurrency 2000000: 5.5 GB for 28 images


@dataclass
class EmbedSettings:
    """Every `vit22b embed` option besides INPUT and --output, each also ``VIT22B_<FLAG>``."""

    server: tuple[str, ...] = setting(
        (), "feature server host:port; repeat to spread over several", repeat=True)
    token: str | None = setting(None, "bearer token for the servers")
    tls: bool | str = setting(
        False, "TLS to the servers (alone: the system's roots; or a PEM file of trusted roots)",
        parse=parse_tls)
    local: bool = setting(False, "run the engine in this process (the default without --server)")
    model: str | None = setting(None, "local: preset name (default: the embedded model)")
    checkpoint: str | None = setting(None, "local: checkpoint directory")
    mesh: str = setting("auto", "local: device mesh, e.g. data=2,model=4")
    seed: int = setting(0, "local: seed of random weights", parse=parse_seed)
    compute_dtype: str | None = setting("auto", f"local: {COMPUTE_DTYPE_HELP}",
                                        parse=compute_dtype)
    outputs: str = setting("pooled", f"comma-separated of {', '.join(OUTPUT_CHOICES)}")
    layers: tuple[int, ...] | None = setting(
        None, "patch-token layers, e.g. --layers -1,6 (implies patch_tokens; default -1)",
        parse=_layers)
    dtype: str = setting("float32", f"stored dtype: {', '.join(wire.OUTPUT_DTYPES)}",
                         check=one_of(wire.OUTPUT_DTYPES))
    l2_normalize: bool = setting(False, "L2-normalise pooled features")
    normalize_patches: bool = setting(False, "apply the encoder's final norm to patch tokens")
    format: str = setting(
        "npy", "npy (a file per output and shard; bfloat16 as float32), parquet (a table per "
        "shard) or safetensors (a file per shard, bfloat16 native)", check=one_of(FORMAT_CHOICES))
    resolution: int = setting(
        0, "square input size, one the server allows (default: the model's own); recorded in "
        "the manifest: a resumed job refuses another", check=non_negative)
    dense: bool = setting(
        False, "aspect ratio kept, no crop: the shorter side to about --resolution, each image "
        "its own patch grid; patch tokens stored zero-padded to the dense bound, the grid in "
        "the 'grid' array (a server needs --max-dense-patches)")
    max_dense_patches: int = setting(
        0, "local --dense: patches per image at most (default: twice the square grid at "
        "--resolution); a server states its own", check=non_negative)
    max_image_pixels: int = setting(
        0, "local: the largest decoded image, in pixels (a decompression bomb guard; default "
        "the server's, 40,000,000); a server states its own",
        check=non_negative)
    compile_cache: str | None = setting(
        None, f"local: {COMPILE_CACHE_HELP} ({COMPILE_CACHE_DEFAULT_HELP})")
    batch_size: int = setting(32, "images per request", check=positive)
    shard_size: int = setting(1024, "images per shard", check=positive)
    concurrency: int = setting(
        2, f"requests in flight per server (local: worker threads; --runner ray: actors in "
        f"all), at most {MAX_CONCURRENCY}",
        check=at_most(MAX_CONCURRENCY, "each one a thread and its batch in memory"))
    runner: str = setting("threads", "threads of this process, or ray: a Ray Data pipeline "
                          "(pip install 'vit22b[ray]')", check=one_of(("threads", "ray")))
    ray_address: str | None = setting(
        None, "Ray cluster to join (default: RAY_ADDRESS, or a new local instance)")
    ray_max_retries: int = setting(
        MAX_RETRIES, "--runner ray: how often a shard runs again after its worker process "
        "died; then the job ends naming it (completed shards are kept)",
        check=non_negative)
    ext: tuple[str, ...] = setting(
        (), "only files with these extensions, e.g. jpg,png (default: every file; with "
        "--frames: .mp4 .webm .mkv .mov .avi)", parse=lambda text: tuple(_csv(text)))
    frames: int | None = setting(
        None, "a job over videos (decoded here, PyAV): K frames per video, at the centres of K "
        "equal segments; --batch-size then counts frames", check=positive)
    stride_seconds: float | None = setting(
        None, "refused by the job (each video would store its own number of frames); the "
        "SDK's embed_videos(stride_s=S) does it")
    quiet: bool = setting(False, "no progress bar", short="-q")


def add_arguments(command: str, parser: argparse.ArgumentParser):
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="folder (recursive), glob, or list file (.txt/.lst/.list) of paths")
    parser.add_argument("--output", "-o", required=True, metavar="DIR",
                        help="output directory or URL; rerunning the same command resumes it")
    settings.add_arguments(parser, EmbedSettings)
    return run


def output_spec(options: EmbedSettings) -> OutputSpec:
    kinds = _csv(options.outputs)
    unknown = set(kinds) - set(OUTPUT_CHOICES)
    if unknown:
        raise ValueError(f"unknown output {sorted(unknown)[0]!r}; choose from {OUTPUT_CHOICES}")
    if options.dense and (options.frames or options.stride_seconds):
        raise ValueError("--dense is for images: a video job stores frames of one grid")
    if options.max_dense_patches and not options.dense:
        raise ValueError("--max-dense-patches is the local --dense bound")
    asked = OutputRequest.of(kinds, options.layers or (), options.normalize_patches)
    return OutputSpec(
        pooled=asked.pooled,
        class_token=asked.class_token,
        patch_layers=asked.patch_layers,
        dtype=options.dtype,
        l2_normalize=options.l2_normalize,
        normalize_patches=options.normalize_patches,
        resolution=options.resolution,
        dense=options.dense,
        max_dense_patches=options.max_dense_patches,
    )


def video_sampling(options: EmbedSettings) -> Sampling | None:
    """The job's frame sampling, or None for an image job."""
    if options.frames is None and options.stride_seconds is None:
        return None
    if options.frames is not None and options.stride_seconds is not None:
        raise ValueError("--frames and --stride-seconds exclude each other")
    sampling = Sampling(options.frames, options.stride_seconds)
    video_arrays({}, sampling)  # refuses a stride, with the reason
    return sampling


# the in-process engine's settings. `vit22b serve` reads the same variables (VIT22B_MODEL,
# VIT22B_COMPILE_CACHE, ...), so a job against servers leaves their values unread
LOCAL_ONLY = ("local", "model", "checkpoint", "mesh", "seed", "compute_dtype",
              "max_dense_patches", "max_image_pixels", "compile_cache")


def job_settings(args: argparse.Namespace) -> EmbedSettings:
    """The job's settings, for the backend chosen: servers (``--server``), or the in-process
    engine. A flag wins over a variable: the engine's flags (``--local``, ``--model``, ...)
    beside ``$VIT22B_SERVER`` run it in process; beside a typed ``--server`` they are refused.
    Against servers the engine's variables are not read (they may be a server's own), nor is
    ``$VIT22B_MAX_DENSE_PATCHES`` without ``--dense``."""
    fields = {f.name: f for f in dataclasses.fields(EmbedSettings)}
    asked = [settings.flag_of(fields[name]) for name in LOCAL_ONLY if settings.typed(args, name)
             and (name != "local" or args.local is True)]  # --local=false asks for nothing
    remote = settings.from_args(EmbedSettings, args, unread=frozenset(LOCAL_ONLY))
    if remote.server and not asked:
        local = args.local  # a variable's, unless typed
        if isinstance(local, settings.Variable) and not settings.typed(args, "server") \
                and local.value(fields["local"]):
            raise ValueError("$VIT22B_SERVER and $VIT22B_LOCAL exclude each other")
        return remote
    if remote.server and settings.typed(args, "server"):
        raise ValueError(f"--server and {', '.join(asked)} exclude each other (the in-process "
                         "engine's; a server has its own)")
    unread = frozenset() if remote.dense or settings.typed(args, "max_dense_patches") else \
        frozenset({"max_dense_patches"})  # the server's dense bound: not a square job's
    return replace(settings.from_args(EmbedSettings, args, unread), server=())  # in process


def make_backend(args: EmbedSettings, spec: OutputSpec):
    if args.runner == "ray":
        return ray_runner(args)
    if args.server:
        from .embed_remote import RemoteBackend

        return RemoteBackend(args.server, spec, token=args.token, tls=args.tls,
                             batch_size=args.batch_size,
                             concurrency=args.concurrency, quiet=args.quiet)
    try:
        from .embed_local import LocalBackend  # imports jax and the server's facade
    except ModuleNotFoundError as err:
        raise needed_by("the in-process engine (--local, the default without --server)",
                        "server", err) from None

    backend = LocalBackend(spec, model=args.model, checkpoint=args.checkpoint, mesh=args.mesh,
                           seed=args.seed, compute_dtype=args.compute_dtype,
                           batch_size=args.batch_size, concurrency=args.concurrency,
                           max_image_pixels=args.max_image_pixels,
                           compile_cache=args.compile_cache or default_compile_cache())
    backend.warm_up()
    return backend


INTERRUPTED = "vit22b embed: interrupted; rerun the same command to resume"


@contextlib.contextmanager
def stop_on_ctrl_c():
    """SIGINT as a request to stop (the event it yields): no batch starts after it, those in
    flight end and their shards are written; a second SIGINT exits 130 at once. Python's own
    KeyboardInterrupt lands wherever the main thread is: inside JAX's load and compile (and its
    gc callbacks) it was lost (the job ran on to exit 0) or crashed the interpreter at exit."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signals reach the main thread only: nothing to install
        return

    def requested(signum, frame) -> None:
        if stop.is_set():
            os.write(2, f"{INTERRUPTED}\n".encode())  # not print: it may be mid-write
            os._exit(130)  # written shards are whole (storage.py) and resume
        stop.set()
        os.write(2, b"vit22b embed: stopping: batches in flight finish and their shards are "
                    b"written (Ctrl-C again to stop at once)\n")

    previous = signal.signal(signal.SIGINT, requested)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def ray_runner(args: EmbedSettings):
    """The Ray runner with the backend's actors (each builds its backend, not this process)."""
    from .embed_ray import EngineActors, RayRunner, ServerActors

    if args.server:
        actors = ServerActors(tuple(args.server), token=args.token, tls=args.tls)
    else:
        actors = EngineActors(model=args.model, checkpoint=args.checkpoint, mesh=args.mesh,
                              seed=args.seed, compute_dtype=args.compute_dtype,
                              max_image_pixels=args.max_image_pixels,
                              compile_cache=args.compile_cache)
    return RayRunner(actors, concurrency=args.concurrency, address=args.ray_address,
                     max_retries=args.ray_max_retries)


# Storage libraries' own logs of a failure this command then says in one line: gcsfs logs each
# request out of retries with its traceback, asyncio each orphaned aiohttp task's.
QUIET_LOGGERS = ("gcsfs", "s3fs", "aiobotocore", "asyncio")


def run(args: argparse.Namespace) -> int:
    """Exit 0 complete, 1 incomplete (every server lost, at the start or during the job: rerun
    to resume), 2 bad options, inputs or a refused mix, 130 interrupted."""
    backend, made, summary = None, [], None
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        options = job_settings(args)
        settings.check(options)
        spec = output_spec(options)
        sampling = video_sampling(options)
        if sampling:  # decoded here: say a missing PyAV now, not as each worker's failure
            load_av()
        frames = sampling.frames if sampling else 1
        config = JobConfig(
            inputs=args.inputs,
            output=args.output,
            spec=spec,
            batch_size=max(1, options.batch_size // frames),  # videos: about batch_size frames
            shard_size=options.shard_size,
            extensions=options.ext or (VIDEO_SUFFIXES if sampling else ()),
            quiet=options.quiet,
            format=options.format,
            video=sampling,
        )
        if config.output.startswith("memory://"):
            raise ValueError(f"{config.output}: memory:// lives in this process only; the "
                             "outputs would be gone when the command ends")
        # fail fast, before the model
        items = enumerate_inputs(config.inputs, config.extensions, config.output)
        made = OutputStore.prepare(config.output)
        if options.runner == "ray":  # the engines are in Ray's processes, Ray's own Ctrl-C
            backend = make_backend(options, spec)
            summary = backend.run(config, items)
        else:
            with stop_on_ctrl_c() as stop:
                backend = make_backend(options, spec)
                if stop.is_set():  # asked while the model loaded
                    raise KeyboardInterrupt
                summary = run_job(replace(config, stop=stop), backend, items)
    except (InputListError, JobMismatch, OutputsError, ValueError) as err:
        print(f"vit22b embed: {err}", file=sys.stderr)
        return 2
    except JobFailed as err:
        print(f"vit22b embed: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # writing the outputs failed (disk full, ...), or a store could not
        # be reached (no file named: not the output's fault): what was written stays
        where = f"{err.filename}: " if err.filename else ""
        print(f"vit22b embed: {where}{err.strerror or err}; completed shards are kept: rerun the "
              "same command to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - only a storage library's own failures end here
        if (failure := storage_failure(err)) is None:
            raise
        print(f"vit22b embed: {failure}; completed shards are kept: rerun the same command "
              "to resume", file=sys.stderr)
        return 1
    finally:
        if backend is not None:
            backend.close()
        if summary is None:  # refused or failed before the job ran
            OutputStore.unprepare(made)
    try:
        print(summary.line(), flush=True)
    except OSError as err:  # stdout on a full disk, its reader gone: the outputs are written
        print(f"vit22b embed: cannot write the summary to stdout: {err.strerror or err} (the "
              f"job is {'complete' if summary.complete else 'incomplete'})", file=sys.stderr)
        return 1
    return 0 if summary.complete else 1
