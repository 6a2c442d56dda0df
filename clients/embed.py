"""The batch embedding job behind `vit22b embed`: inputs -> shards, resumable, over any backend.

The sorted input list is cut into shards of ``shard_size`` positions and each shard into batches
of ``batch_size``; a batch is the unit of work handed to a backend worker (a connection to one
server, or a thread of the in-process engine). Workers pull batches in order from one queue; a
worker whose server is lost puts its batch back at the front and retires, so the others finish
the job. A shard is written (see embed_store) once all its batches are back. Because a batch's
members are fixed by position, results do not depend on which worker computed them, how often
the job was killed, or in what order shards completed. (Bit for bit, that holds while each image
is computed in a batch of the same padded size: always in local mode, and remotely with one
request in flight per server; a server's batcher may pack concurrent requests into other batch
sizes, and XLA's results for one image then move by an ulp or so.)

Backends (embed_local: the in-process engine, needs jax; embed_remote: gRPC servers, no jax)
provide ``model`` (a ``ModelIdentity``) and ``workers()``; a worker's
``embed(items) -> BatchResult`` records unreadable images as failures instead of raising.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from vit22b.model.features import Features
from vit22b.model.identity import ModelIdentity
from vit22b.model.outputs import OutputRequest
from vit22b.model.pixels import (
    HEAD_BYTES,
    Geometry,
    accepted_format,
    refused_for_format,
    refused_over_limit,
)

from .embed_formats import FORMATS
from .embed_formats import exact as to_stored  # the backends' features, in the stored dtype
from .embed_inputs import InputItem, enumerate_inputs, ids_digest, places_digest, shard_slices
from .embed_store import OutputStore, ShardWriter
from .files import MAX_IMAGE_BYTES, READ_FAILURE, os_reason
from .outputs import ERRORS, array_name
from .storage import check_readable, read_bytes, read_head
from .video import DISPLAY, Sampling

OUTPUT_CHOICES = ("pooled", "class_token", "patch_tokens")
GRID = "grid"  # a dense job's array of each image's patch grid (rows, cols)
FORMAT_CHOICES = tuple(FORMATS)
STOP_POLL_S = 0.1  # how often the job's thread looks at JobConfig.stop while batches run


@dataclass(frozen=True)
class OutputSpec:
    """What to store per image. ``patch_layers`` as given (negative count from the end)."""

    pooled: bool = True
    class_token: bool = False
    patch_layers: tuple[int, ...] = ()
    dtype: str = "float32"
    l2_normalize: bool = False  # pooled features only
    normalize_patches: bool = False  # the encoder's final norm on patch tokens
    resolution: int = 0  # the square input size, or dense's shorter side (0: the model's own)
    dense: bool = False  # aspect ratio kept: each image its own grid, stored padded (GRID)
    max_dense_patches: int = 0  # local dense bound (0: dense_bound's default); servers set theirs

    def geometry(self, max_patches: int = 0) -> Geometry:
        """The job's geometry (``model/pixels.py``); dense at ``max_patches`` at most."""
        return Geometry(self.resolution, self.dense, max_patches if self.dense else 0)

    @property
    def request(self) -> OutputRequest:
        return OutputRequest(
            pooled=self.pooled,
            class_token=self.class_token,
            patch_layers=self.patch_layers,
            norm_patches=self.normalize_patches,
        )

    def layers(self, depth: int) -> tuple[int, ...]:
        """Requested layers as sorted unique non-negative block indices."""
        return self.request.layers(depth)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The output kinds asked for besides patch tokens."""
        return tuple(n for n, on in (("pooled", self.pooled), ("class_token", self.class_token))
                     if on)

    def names(self, depth: int) -> list[str]:
        return [*self.kinds, *(array_name("patch_tokens", layer) for layer in self.layers(depth))]


def stored_arrays(features: Features, spec: OutputSpec) -> dict[str, np.ndarray]:
    """A backend's features (the engine's, or a server's answer) -> stored array name -> array
    in the output dtype."""
    arrays = {name: to_stored(value, spec.dtype) for name, value in features.arrays()}
    for layer, tokens in features.patch_tokens.items():
        arrays[array_name("patch_tokens", int(layer))] = to_stored(tokens, spec.dtype)
    return arrays


def dense_bound(cfg, spec: OutputSpec) -> int:
    """A local dense job's patch bound: ``max_dense_patches``, or twice the square grid at the
    job's resolution (aspect ratios up to 2:1 keep their size; longer images shrink)."""
    side = (spec.resolution or cfg.image_size) // cfg.patch
    return spec.max_dense_patches or 2 * side * side


def array_specs(model: ModelIdentity, spec: OutputSpec) -> dict[str, dict]:
    """Stored array name -> {"dtype", "shape"} (shape of one image's row).

    Dense jobs: patch tokens are ``[model.num_patches, width]`` (the bound), an image's
    ``rows * cols`` tokens first (row-major), zeros after; ``GRID`` holds (rows, cols)."""
    for kind in spec.request.kinds:
        if kind not in model.outputs:
            raise ValueError(f"model {model.name} has no {kind} output (its outputs: "
                             f"{', '.join(model.outputs)})")
    shapes = {"pooled": [model.pooled_dim or model.width], "class_token": [model.width]}
    specs = {
        name: {"dtype": spec.dtype, "shape": shapes.get(name, [model.num_patches, model.width])}
        for name in spec.names(model.depth)
    }
    if spec.dense:
        specs[GRID] = {"dtype": "int64", "shape": [2]}
    return specs


def dense_rows(arrays: dict[str, np.ndarray], grid: tuple[int, int],
               max_patches: int) -> dict[str, np.ndarray]:
    """Rows of one grid in a dense job's stored shapes: patch tokens zero-padded to
    ``max_patches``, and each row's grid in ``GRID``."""
    out = {}
    for name, array in arrays.items():
        if name.startswith("patch_tokens"):  # [n, rows * cols, width]
            pad = max_patches - array.shape[1]
            array = np.pad(array, ((0, 0), (0, pad), (0, 0))) if pad else array
        out[name] = array
    rows = len(next(iter(arrays.values())))
    out[GRID] = np.tile(np.asarray(grid, np.int64), (rows, 1))
    return out


@dataclass
class BatchResult:
    rows: list[int]  # positions within the batch that were embedded, ascending
    arrays: dict[str, np.ndarray]  # array name -> [len(rows), ...] in the stored dtype
    failed: list[tuple[int, str]]  # (position within the batch, reason)

    @classmethod
    def joined(cls, parts: Sequence[BatchResult]) -> BatchResult:
        """Parts of one batch (rows in the batch's positions, e.g. one per grid) -> one,
        rows ascending."""
        rows = [row for part in parts for row in part.rows]
        order = np.argsort(rows, kind="stable")
        with_rows = [part for part in parts if part.rows]
        arrays = {name: np.concatenate([p.arrays[name] for p in with_rows])[order]
                  for name in (with_rows[0].arrays if with_rows else {})}
        failed = sorted(f for part in parts for f in part.failed)
        return cls([rows[i] for i in order], arrays, failed)


class WorkerLost(Exception):
    """The worker's server is gone (after the SDK's retries): its batch goes to another worker."""


class Worker(Protocol):
    name: str

    def embed(self, items: Sequence[InputItem]) -> BatchResult: ...

    def embed_images(self, images: Sequence[bytes | np.ndarray]) -> BatchResult:
        """Encoded images or uint8 [H, W, 3] pixels; rows and failures are their positions."""
        ...


class Backend(Protocol):
    model: ModelIdentity
    # the decoded-size bound its workers apply: a local engine's, or the servers' smallest
    # (None: not known)
    max_image_pixels: int | None

    def workers(self) -> list[Worker]: ...

    def close(self) -> None: ...


class JobFailed(RuntimeError):
    """The job cannot go on (every server lost, or a bug); completed shards stay resumable."""


def read_file(item: InputItem) -> bytes:
    """The file's bytes (a local path or an fsspec URL); OSError's message is the failure
    reason for errors.jsonl."""
    return read_bytes(item.path, MAX_IMAGE_BYTES)


def readable_now(failure: dict, max_bytes: int | None = MAX_IMAGE_BYTES) -> bool:
    """Whether a failure recorded as a file that could not be read is one whose file can be
    read now (its folder mounted again, a link or a permission fixed), within ``max_bytes``
    (None for videos, read in pieces): a rerun recomputes its shard. A file that could not be
    decoded stays a failure (but see ``allowed_now``)."""
    if not failure.get("reason", "").startswith(READ_FAILURE):
        return False
    try:
        check_readable(failure["path"], max_bytes)
    except (OSError, ValueError):
        return False
    return True


def allowed_now(failure: dict, max_image_pixels: int | None) -> bool:
    """Whether a failure recorded as an image over the pixel limit is one the job's limit now
    takes (a rerun with a larger --max-image-pixels, or servers started with one): a rerun
    recomputes its shard. An image that declared more pixels than the new limit stays a
    failure."""
    refused = refused_over_limit(failure.get("reason", ""))
    if refused is None or not max_image_pixels:
        return False
    declared, limit = refused
    return max_image_pixels > limit and (declared is None or declared <= max_image_pixels)


def accepted_now(failure: dict) -> bool:
    """Whether a failure recorded as a file of a refused format (or of one whose decoder was not
    installed) is one whose bytes are of a format the pixel contract accepts now (HEIC and AVIF
    joined on 2026-12-06): a rerun recomputes its shard. A file of a format still refused, or
    whose content was refused, stays a failure."""
    if not refused_for_format(failure.get("reason", "")):
        return False
    try:
        head = read_head(failure["path"], HEAD_BYTES, MAX_IMAGE_BYTES)
    except (OSError, ValueError):
        return False
    return accepted_format(head) is not None


def retry_now(failure: dict, max_bytes: int | None, max_image_pixels: int | None) -> bool:
    """Whether a rerun recomputes the shard of this recorded failure."""
    return (readable_now(failure, max_bytes) or allowed_now(failure, max_image_pixels)
            or accepted_now(failure))


def embed_files(worker, items: Sequence[InputItem]) -> BatchResult:
    """Read each item's file and embed the readable ones with ``worker.embed_images(blobs)``
    (whose rows and failures are positions among the blobs); an unreadable file is a failure."""
    blobs, positions, failed = [], [], []
    for position, item in enumerate(items):
        try:
            blobs.append(read_file(item))
            positions.append(position)
        except OSError as err:
            failed.append((position, os_reason(err)))
    if not blobs:
        return BatchResult([], {}, failed)
    result = worker.embed_images(blobs)
    failed += [(positions[p], reason) for p, reason in result.failed]
    return BatchResult([positions[r] for r in result.rows], result.arrays, sorted(failed))


@dataclass
class Summary:
    inputs: int
    shards: int
    embedded: int = 0  # this run
    failed: int = 0  # this run
    skipped: int = 0  # in shards completed by earlier runs
    seconds: float = 0.0
    complete: bool = False
    output: str = ""
    held: int = 0  # inputs the output directory holds now (all runs)
    held_failed: int = 0  # failures it lists now (all runs)
    lost_workers: list[str] = field(default_factory=list)
    noun: str = "images"  # what the inputs are: "videos" for a job over videos

    def add(self, entry: dict) -> None:
        """Count a shard written by this run (its manifest entry)."""
        self.embedded += entry["count"]
        self.failed += entry["failed"]

    def line(self) -> str:
        rate = self.embedded / self.seconds if self.seconds > 0 else 0.0
        state = "complete" if self.complete else "INCOMPLETE (rerun the same command to resume)"
        return (
            f"embedded {self.embedded}, skipped {self.skipped} (done by an earlier run), "
            f"failed {self.failed}; {self.output} holds {self.held} {self.noun} and "
            f"{self.held_failed} failures ({ERRORS}) of {self.inputs} inputs in {self.shards} "
            f"shards, {state}; {self.seconds:.1f}s, {rate:.1f} {self.noun}/s"
        )


@dataclass
class JobConfig:
    inputs: list[str]
    output: str
    spec: OutputSpec = field(default_factory=OutputSpec)
    batch_size: int = 32
    shard_size: int = 1024
    extensions: tuple[str, ...] = ()
    quiet: bool = False
    format: str = "npy"  # how shards are stored: FORMAT_CHOICES
    video: Sampling | None = None  # a job over videos (embed_video): frames sampled per video
    on_shard: Callable[[int], None] | None = None  # called after each shard is written
    # set to stop (the CLI's first Ctrl-C): no batch is started after it, those in flight end
    # and their finished shards are written, then the job raises KeyboardInterrupt
    stop: threading.Event | None = None


@dataclass
class _ShardProgress:
    results: dict[int, BatchResult] = field(default_factory=dict)
    batches: int = 0


class _Queue:
    """Batches ``(shard, index, positions)`` in input order.

    A lost worker's batch goes back to the front, so a worker waits while batches are in flight
    elsewhere instead of leaving when the queue looks empty. Only batches of the first
    ``window`` unwritten shards are handed out: a slow or hung server then holds back the
    others instead of letting results pile up in memory behind the shard it blocks.
    """

    def __init__(self, tasks, shards: list[int], window: int):
        self._tasks = collections.deque(tasks)
        self._unwritten = list(shards)
        self._window = window
        self._open = set(self._unwritten[:window])
        self._cond = threading.Condition()
        self._in_flight = 0
        self._closed = False

    def take(self):
        with self._cond:
            while not self._closed:
                if self._tasks and self._tasks[0][0] in self._open:
                    self._in_flight += 1
                    return self._tasks.popleft()
                if not self._tasks and not self._in_flight:
                    break
                self._cond.wait()
            return None

    def written(self, shard: int) -> None:
        with self._cond:
            self._unwritten.remove(shard)
            self._open = set(self._unwritten[: self._window])
            self._cond.notify_all()

    def done(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def put_back(self, task) -> None:
        with self._cond:
            self._tasks.appendleft(task)
            self._in_flight -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def batch_ranges(positions: range, batch_size: int) -> list[range]:
    return [positions[i : i + batch_size] for i in range(0, len(positions), batch_size)]


def identity_of(model: ModelIdentity, config: JobConfig, items: list[InputItem], names) -> dict:
    """What must match for a resumed job to continue a directory."""
    spec = config.spec
    return {
        **model.described(),
        "outputs": names,
        "dtype": spec.dtype,
        "l2_normalize": spec.l2_normalize,
        "normalize_patches": spec.normalize_patches,
        "shard_size": config.shard_size,
        "format": config.format,
        "inputs": {"count": len(items), "sha256": ids_digest(items),
                   "places_sha256": places_digest(items)},
        # a resumed job never mixes geometries (absent: the model's own, as before geometries)
        **({"resolution": spec.resolution, "num_patches": model.num_patches}
           if spec.resolution or spec.dense else {}),
        **({"dense": True} if spec.dense else {}),
    } | ({"video": video_identity(config.video)} if config.video is not None else {})


def video_identity(sampling: Sampling) -> dict:
    """A video job's identity: which frames, and how they are shown."""
    return sampling.describe() | {"display": DISPLAY}


def run_plan(config: JobConfig, model: ModelIdentity, items: list[InputItem] | None,
             run_pending: Callable[[list[InputItem], list[range], list[int], OutputStore, Summary],
                                   None], max_image_pixels: int | None = None) -> Summary:
    """The job around a runner: open (or resume, refusing a mix) the output, hand the shards
    not yet done to ``run_pending(items, slices, pending, store, summary)``, which writes and
    records them, and finish the output; returns the summary of this run. A resumed job also
    recomputes the shards of recorded failures that may pass now (``retry_now``: files readable
    again, images within the runner's ``max_image_pixels``, files of a format accepted now)."""
    start = time.perf_counter()
    if config.batch_size < 1 or config.shard_size < 1:
        raise ValueError("--batch-size and --shard-size must be positive")
    if config.format not in FORMATS:
        raise ValueError(f"unknown --format {config.format!r}; choose from {FORMAT_CHOICES}")
    FORMATS[config.format].check()
    if items is None:
        items = enumerate_inputs(config.inputs, config.extensions, config.output)
    arrays = array_specs(model, config.spec)
    if config.video is not None:
        from .embed_video import video_arrays

        arrays = video_arrays(arrays, config.video)
    slices = shard_slices(len(items), config.shard_size)
    identity = identity_of(model, config, items, list(arrays))
    about = {"model_source": model.source, "width": model.width, "depth": model.depth,
             "num_patches": model.num_patches}
    limit = None if config.video is not None else MAX_IMAGE_BYTES
    recheck = None
    if config.video is not None:
        from .embed_video import shown_otherwise_before

        def recheck(shard: int) -> bool:
            return any(shown_otherwise_before(items[p]) for p in slices[shard])
    store = OutputStore.open(config.output, identity, arrays, len(slices), about,
                             retry=lambda failure: retry_now(failure, limit, max_image_pixels),
                             recheck=recheck)
    summary = Summary(len(items), len(slices), output=config.output,
                      noun="images" if config.video is None else "videos")
    try:
        pending = [k for k in range(len(slices)) if k not in store.done]
        summary.skipped = sum(len(slices[k]) for k in store.done)
        if pending:
            run_pending(items, slices, pending, store, summary)
        store.finish()
        summary.complete = len(store.done) == len(slices)
        summary.held = sum(entry["count"] for entry in store.done.values())
        summary.held_failed = sum(entry["failed"] for entry in store.done.values())
    finally:
        store.close()
        summary.seconds = time.perf_counter() - start
    return summary


def run_job(config: JobConfig, backend: Backend, items: list[InputItem] | None = None) -> Summary:
    """Embed every input not yet in ``config.output`` with this process's worker threads."""
    if config.video is not None:  # a job over videos: every worker decodes them
        from .embed_video import VideoBackend

        backend = VideoBackend(backend, config.video, config.spec.dtype)
    return run_plan(config, backend.model, items,
                    lambda *job: _run_pending(config, backend, *job),
                    max_image_pixels=backend.max_image_pixels)


def _run_pending(config, backend, items, slices, pending, store, summary) -> None:
    workers = backend.workers()
    if not workers:
        raise JobFailed("no worker available (no server reachable)")
    in_flight = len(workers) * config.batch_size
    tasks = _Queue(
        ((k, b, batch) for k in pending
         for b, batch in enumerate(batch_ranges(slices[k], config.batch_size))),
        pending,
        window=2 + -(-in_flight // config.shard_size),
    )
    shards = {k: _ShardProgress(batches=len(batch_ranges(slices[k], config.batch_size)))
              for k in pending}
    results: queue.Queue = queue.Queue()

    def work(worker: Worker) -> None:
        while (task := tasks.take()) is not None:
            shard, index, batch = task
            try:
                result = worker.embed([items[p] for p in batch])
            except WorkerLost as err:
                tasks.put_back(task)
                results.put(("lost", worker.name, str(err)))
                return
            except BaseException as err:  # noqa: BLE001 - a bug: stop the job, keep what is done
                tasks.put_back(task)
                results.put(("error", worker.name, err))
                return
            results.put(("done", task, result))
            tasks.done()
        results.put(("idle", worker.name, None))

    threads = [threading.Thread(target=work, args=(w,), daemon=True, name=f"embed-{w.name}")
               for w in workers]
    for t in threads:
        t.start()
    total = sum(len(slices[k]) for k in pending)
    bar = progress_bar(total, config.quiet)
    alive, remaining, reported, stopping = len(threads), len(pending), set(), False
    try:
        while remaining and alive:
            if config.stop is not None and config.stop.is_set() and not stopping:
                stopping = True
                tasks.close()  # each worker ends its batch, then goes idle
            try:
                kind, what, payload = results.get(timeout=STOP_POLL_S)
            except queue.Empty:
                continue
            if kind == "done":
                (shard, index, batch), result = what, payload
                bar.update(len(batch))
                progress = shards[shard]
                progress.results[index] = result
                if len(progress.results) == progress.batches:
                    rows = shard_rows(items, slices[shard], config.batch_size,
                                      shards.pop(shard).results, store.writer)
                    summary.add(store.write_shard(shard, *rows))
                    tasks.written(shard)
                    remaining -= 1
                    if config.on_shard is not None:
                        config.on_shard(shard)
            elif kind == "lost":
                alive -= 1
                summary.lost_workers.append(what)
                if payload not in reported:  # once per server, not once per connection
                    reported.add(payload)
                    bar.write(f"vit22b embed: {what} lost ({payload}); its work moves on")
            elif kind == "error":
                raise JobFailed(f"{what} failed: {type(payload).__name__}: {payload}") from payload
            else:  # idle: the queue was empty when it looked
                alive -= 1
        if stopping and remaining:
            raise KeyboardInterrupt
        if remaining:
            raise JobFailed(
                f"every worker is gone ({', '.join(summary.lost_workers) or 'none left'}); "
                f"{remaining} shards left: rerun the same command to resume"
            )
    finally:
        tasks.close()
        bar.close()


def shard_rows(items, positions: range, batch_size: int, results: dict[int, BatchResult],
               writer: ShardWriter) -> tuple:
    """A shard's batch results -> (inputs_sha256, ids, paths, arrays, failed), what
    ``ShardWriter.write`` takes after the shard's index."""
    ids, paths, failed, parts = [], [], [], collections.defaultdict(list)
    for index, batch in enumerate(batch_ranges(positions, batch_size)):
        result = results[index]
        for row in result.rows:
            ids.append(items[batch[row]].id)
            paths.append(items[batch[row]].shown_path)
        for row, reason in result.failed:
            failed.append({"id": items[batch[row]].id, "path": items[batch[row]].shown_path,
                           "reason": reason})
        for name, array in result.arrays.items():
            parts[name].append(array)
    arrays = {name: np.concatenate(parts[name]) if parts[name] else writer.empty(name)
              for name in writer.arrays}
    failed.sort(key=lambda row: row["id"])
    return ids_digest([items[p] for p in positions]), ids, paths, arrays, failed


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def write(self, message: str) -> None:
        print(message, file=sys.stderr)

    def close(self) -> None:
        pass


def progress_bar(total: int, quiet: bool):
    """tqdm bar on stderr: count, images/s and ETA."""
    if quiet:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="img", desc="embed", file=_BestEffort(sys.stderr),
                smoothing=0.1, dynamic_ncols=True)


class _BestEffort:
    """A stream whose failed writes are dropped (stderr on a full disk, a terminal gone): the
    progress bar must not end the job it reports on (its first write failed the job)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError):
            return self._stream.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
