"""`vit22b embed --runner ray`: the batch job as a Ray Data pipeline, on one machine or a cluster.

The dataset is the job's shard plan (embed_inputs: shard ``k`` is positions ``k*shard_size ..``
of the sorted input list), one row per shard not yet done: its index and its images' ids and
paths. ``map_batches`` runs the callable class :class:`EmbedShards` in a pool of
``concurrency`` actors; an actor reads its shard's files (local paths or fsspec URLs), embeds
them batch by batch through its backend, and writes the shard's files (``ShardWriter``, in the
job's format) into the output. Its output row is the shard's manifest entry, which the driver
records: the manifest and errors.jsonl have one writer, the driver, and name a shard only after
its files are written. The identity, the refusal of a mix, the layout and the resume are the
threads runner's (embed.run_plan), so either runner can continue the other's output.

Two kinds of actors (``actors=``):

- :class:`ServerActors`: CPU actors calling gRPC servers through the SDK (``RemoteBackend``
  over every address; a batch whose server is lost moves to the next one): the way to use a
  model sharded over several devices or hosts.
- :class:`EngineActors`: each actor holds a local engine (``LocalBackend``), on one GPU each
  when the cluster has GPUs: for models that fit one device.

Failures. An actor whose process dies is restarted by Ray and the shard it ran is run again,
at most ``max_retries`` times (``max_task_retries``). An actor holds one shard at a time, so a
death costs only the shard it hit, never one queued behind it; the actor itself restarts
without bound, so sporadic deaths over a long job cost nothing but the shards they hit. A
shard that kills its process every time is given up after that: the other shards go on, and
the job then ends with JobFailed naming it (Ray Data's ``max_errored_blocks`` is unbounded for
this dataset: such system failures are the only errors a shard's task can end with, since the
job's own errors come back as the shard's row and end the job at once). A shard's files depend
on its slice alone and each is written whole, so a shard run twice leaves the same files, and
the manifest holds each index once: every image is in the output exactly once. Unreadable or
undecodable images are failures with their reason (errors.jsonl), never dropped. A driver that
dies loses only the shards in flight: rerun, and completed shards are skipped.

Why shards and not ``ray.data.read_binary_files``: that reader fails the whole dataset on an
unreadable file (or, with ``ignore_missing_paths``, drops missing ones without a word), and its
blocks are not a function of the input list, so outputs could not be named by shard and a rerun
could not tell what is done.

    from vit22b.clients.embed import JobConfig, OutputSpec
    from vit22b.clients.embed_ray import ServerActors, embed_with_ray

    config = JobConfig(["s3://bucket/photos/"], "s3://bucket/emb/", OutputSpec(dtype="bfloat16"),
                       shard_size=4096, format="parquet")
    summary = embed_with_ray(config, ServerActors(("h1:50051", "h2:50051")), concurrency=16)
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from vit22b.model.compile_cache import default_compile_cache
from vit22b.model.identity import ModelIdentity

from .embed import (
    BatchResult,
    JobConfig,
    JobFailed,
    OutputSpec,
    Summary,
    WorkerLost,
    batch_ranges,
    progress_bar,
    run_plan,
    shard_rows,
)
from .embed_inputs import InputItem
from .embed_store import JobMismatch, ShardWriter
from .outputs import OutputsError

MAX_RETRIES = 3  # runs of a shard after the first whose worker process died (--ray-max-retries)


@dataclass(frozen=True)
class ServerActors:
    """CPU actors, each with an SDK client per server (``num_cpus`` each)."""

    servers: tuple[str, ...]
    token: str | None = None
    tls: bool | str = False
    timeout: float = 300.0
    num_cpus: float = 1.0

    def backend(self, spec: OutputSpec, batch_size: int):
        from .embed_remote import RemoteBackend

        return RemoteBackend(self.servers, spec, token=self.token, tls=self.tls,
                             batch_size=batch_size, concurrency=1, timeout=self.timeout,
                             quiet=True)

    def model_and_limit(self, spec: OutputSpec,
                        batch_size: int) -> tuple[ModelIdentity, int | None]:
        """The model the actors serve and their pixel bound (the job's Backend's two)."""
        return _model_of(self, spec, batch_size)  # a few GetModelInfo calls, here

    def resources(self) -> dict:
        return {"num_cpus": self.num_cpus}


@dataclass(frozen=True)
class EngineActors:
    """Actors holding a local engine: a checkpoint, or a preset with seeded weights.

    ``num_gpus``: per actor; None means 1 when the cluster has GPUs, else none (CPU)."""

    model: str | None = None
    checkpoint: str | None = None
    mesh: str = "auto"
    seed: int = 0
    compute_dtype: str | None = "auto"  # LocalBackend's (the CLI's default)
    num_gpus: float | None = None
    num_cpus: float = 1.0
    max_image_pixels: int = 0  # LocalBackend's (0: the default)
    compile_cache: str | None = None  # LocalBackend's on each actor's node (None: its default)

    def backend(self, spec: OutputSpec, batch_size: int):
        from .embed_local import LocalBackend  # jax, in the actor's process

        return LocalBackend(spec, model=self.model, checkpoint=self.checkpoint, mesh=self.mesh,
                            seed=self.seed, compute_dtype=self.compute_dtype,
                            batch_size=batch_size, concurrency=1,
                            max_image_pixels=self.max_image_pixels,
                            compile_cache=self.compile_cache or default_compile_cache())

    def model_and_limit(self, spec: OutputSpec,
                        batch_size: int) -> tuple[ModelIdentity, int | None]:
        """As ServerActors': loaded once in a Ray task on an actor's resources (the driver may
        have no GPU and no jax); the cost of one extra load at the start of a job."""
        import ray

        task = ray.remote(_model_of).options(**self.resources(), max_retries=0)
        return ray.get(task.remote(self, spec, batch_size))

    def resources(self) -> dict:
        import ray

        gpus = self.num_gpus
        if gpus is None:
            gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        return {"num_cpus": self.num_cpus, **({"num_gpus": gpus} if gpus else {})}


def _model_of(actors, spec: OutputSpec, batch_size: int) -> tuple[ModelIdentity, int | None]:
    backend = actors.backend(spec, batch_size)
    backend.close()
    return backend.model, backend.max_image_pixels


class EmbedShards:
    """The ``map_batches`` callable class: one backend per actor; embeds and writes shards."""

    def __init__(self, actors, spec: OutputSpec, batch_size: int, writer: ShardWriter,
                 expected: tuple[str, ...], video=None):
        self.backend = actors.backend(spec, batch_size)
        if self.backend.model.key != tuple(expected):
            raise JobMismatch(f"this worker's model {self.backend.model.key} is not the job's "
                              f"{tuple(expected)}: refusing to mix")
        if hasattr(self.backend, "warm_up"):
            self.backend.warm_up()  # compile before the first shard
        if video is not None:  # a job over videos (embed_video): this actor decodes them
            from .embed_video import VideoBackend

            self.backend = VideoBackend(self.backend, video, spec.dtype)
        self.workers = self.backend.workers()  # remote: one per server; local: one
        self.batch_size, self.writer = batch_size, writer
        self.turn = os.getpid()  # actors start on different servers

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        """Per shard its manifest entry and failures, or the error that ends the job (pickled:
        the driver raises it; a raised one would be an errored block, see Failures)."""
        out: dict[str, list] = {"index": [], "entry": [], "failed": [], "error": []}
        for index, listing in zip(batch["index"], batch["items"]):
            entry, failed, error = {}, [], b""
            try:
                entry, failed = self._shard(int(index), json.loads(listing))
            except Exception as err:  # noqa: BLE001 - any error ends the job, in the driver
                error = pickle.dumps(_picklable(err))
            out["index"].append(int(index))
            out["entry"].append(json.dumps(entry))
            out["failed"].append(json.dumps(failed))
            out["error"].append(error)
        return out

    def _shard(self, index: int, listing: list) -> tuple[dict, list[dict]]:
        items = [InputItem(i, p) for i, p in listing]
        positions = range(len(items))
        results = {b: self._embed(items[r.start : r.stop])
                   for b, r in enumerate(batch_ranges(positions, self.batch_size))}
        rows = shard_rows(items, positions, self.batch_size, results, self.writer)
        return self.writer.write(index, *rows), rows[-1]

    def _embed(self, items: Sequence[InputItem]) -> BatchResult:
        """One batch, through the next server still up (remote); the engine (local)."""
        lost = []
        for _ in range(len(self.workers)):
            worker = self.workers[self.turn % len(self.workers)]
            self.turn += 1
            try:
                return worker.embed(items)
            except WorkerLost as err:
                lost.append(f"{worker.name}: {err}")
        raise JobFailed("every server is lost (" + "; ".join(lost) + ")")

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


def _reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """ValueError unless something answers at a HOST:PORT (or ray://HOST:PORT) address: Ray
    retries a cluster that is not there for many minutes, in warnings."""
    host, sep, port = (address or "").removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:  # "auto", "local", a new instance
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ValueError(f"cannot join the Ray cluster at {address}: nothing answers at "
                         f"{host}:{port} ({err.strerror or err})") from None


def connect(address: str | None = None) -> bool:
    """Join the Ray cluster at ``address`` (None: RAY_ADDRESS, or a new local instance) unless
    this process already has; True if this call connected (and so should disconnect)."""
    import ray

    if ray.is_initialized():
        return False
    _reachable(address or os.environ.get("RAY_ADDRESS"))
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ValueError(f"cannot join the Ray cluster at {address or 'a new local instance'}: "
                         f"{err}") from None
    return True


def _shard_rows_of(items: list[InputItem], slices: list[range], pending: list[int]) -> list[dict]:
    return [{"index": k, "items": json.dumps([[items[p].id, items[p].path] for p in slices[k]])}
            for k in pending]


def _check_room(actors, concurrency: int) -> dict:
    import ray

    need = actors.resources()
    have = ray.cluster_resources()
    for resource, key in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        want = need.get(resource, 0) * concurrency
        if want > have.get(key, 0):
            raise ValueError(f"--concurrency {concurrency} needs {want:g} {key} "
                             f"({need[resource]:g} per actor); the Ray cluster has "
                             f"{have.get(key, 0):g}")
    return need


def _picklable(err: Exception) -> Exception:
    """``err`` if it survives pickling, else the job's error with its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - an exception type that does not pickle
        return JobFailed(f"{type(err).__name__}: {err}")


def _cause(err: BaseException) -> BaseException:
    """The job's own error inside Ray's wrappers (RayTaskError, UserCodeException)."""
    seen = err
    while seen is not None:
        if isinstance(seen, (JobMismatch, JobFailed, OutputsError)):
            return seen
        seen = seen.__cause__ or getattr(seen, "cause", None)
    return JobFailed(f"the Ray job failed: {type(err).__name__}: {err}")


def _results(dataset):
    """The dataset's rows as they complete; a worker's error as the job's own."""
    try:
        yield from dataset.iter_rows()
    except Exception as err:  # noqa: BLE001 - Ray wraps the workers' errors
        raise _cause(err) from err


def embed_with_ray(
    config: JobConfig,
    actors: ServerActors | EngineActors,
    *,
    concurrency: int = 2,
    address: str | None = None,
    items: list[InputItem] | None = None,
    max_retries: int = MAX_RETRIES,
) -> Summary:
    """Embed every input not yet in ``config.output`` on a Ray cluster; returns the summary.

    ``concurrency`` actors of the given kind; ``address`` as for ``ray.init`` (used only when
    this process has not joined a cluster yet); ``max_retries``: how often a shard is run again
    after its worker process died (see Failures). Raises what the threads runner raises
    (JobMismatch, JobFailed, ValueError)."""
    try:
        import ray
        import ray.data
    except ModuleNotFoundError:
        raise ValueError("--runner ray needs Ray: pip install 'vit22b[ray]'") from None

    if concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if max_retries < 0:
        raise ValueError("--ray-max-retries must be at least 0")
    joined = connect(address)
    try:
        resources = _check_room(actors, concurrency)
        model, max_image_pixels = actors.model_and_limit(config.spec, config.batch_size)

        def run_pending(items, slices, pending, store, summary) -> None:
            logging.getLogger("ray.data").setLevel(logging.WARNING)
            shards = ray.data.from_items(_shard_rows_of(items, slices, pending),
                                         override_num_blocks=len(pending))
            shards.context.enable_progress_bars = False  # the job's own bar counts images
            shards.context.max_errored_blocks = -1  # a shard given up: named below
            with warnings.catch_warnings():  # Ray 2.60 deprecates these remote arguments (and
                # names no replacement for them): pyproject keeps ray below 2.64, which drops them
                warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated")
                done = shards.map_batches(
                    EmbedShards,
                    batch_size=1,
                    # one shard in flight per actor: a process that dies takes only the shard
                    # it runs, so a shard queued behind a poisonous one is never given up with it
                    compute=ray.data.ActorPoolStrategy(size=concurrency,
                                                       max_tasks_in_flight_per_actor=1),
                    fn_constructor_kwargs=dict(actors=actors, spec=config.spec,
                                               batch_size=config.batch_size, writer=store.writer,
                                               expected=model.key, video=config.video),
                    max_restarts=-1, max_task_retries=max_retries,
                    **resources,
                )
            bar = progress_bar(sum(len(slices[k]) for k in pending), config.quiet)
            rows = _results(done)
            try:
                for row in rows:
                    if row["error"]:
                        raise _cause(pickle.loads(row["error"]))
                    entry = json.loads(row["entry"])
                    store.record(entry, json.loads(row["failed"]))
                    summary.add(entry)
                    bar.update(entry["count"] + entry["failed"])
                    if config.on_shard is not None:
                        config.on_shard(entry["index"])
            finally:
                rows.close()  # a job's error raised here: Ray Data stops the pool now
                bar.close()
            lost = [k for k in pending if k not in store.done]
            if lost:
                raise JobFailed(_given_up(lost, slices, items, max_retries, len(store.done)))

        return run_plan(config, model, items, run_pending, max_image_pixels)
    finally:
        if joined:
            ray.shutdown()


def _given_up(lost: list[int], slices: list[range], items: list[InputItem], retries: int,
              done: int) -> str:
    named = ", ".join(f"shard {k} (inputs {items[slices[k][0]].id} .. "
                      f"{items[slices[k][-1]].id})" for k in lost[:5])
    more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
    return (f"{named}{more}: given up after {retries + 1} tries, the worker process died "
            f"each time (Ray's worker logs say why; --ray-max-retries sets the retries); the "
            f"{done} completed shards are kept: rerun the same command to resume")


@dataclass
class RayRunner:
    """What `vit22b embed --runner ray` runs: ``run(config, items)``, ``close()``."""

    actors: ServerActors | EngineActors
    concurrency: int = 2
    address: str | None = None
    max_retries: int = MAX_RETRIES

    def run(self, config: JobConfig, items: list[InputItem] | None = None) -> Summary:
        return embed_with_ray(config, self.actors, concurrency=self.concurrency,
                              address=self.address, items=items, max_retries=self.max_retries)

    def close(self) -> None:
        pass
