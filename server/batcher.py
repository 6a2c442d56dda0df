"""Dynamic batching and admission: the narrow core between the transport and the engine.

Admission is bounded in images: ``admit(n)`` reserves room for a call's images before they are
decoded, or raises ``QueueFull`` at once (the facade retries it for a stream: backpressure).
Preprocessed jobs are queued; one compute thread packs rows of jobs with
the same output set and the same patch grid, in arrival order, up to the grid's batch limit
(``max_batch_images``, and ``Engine.max_images(grid)``: the patch budget), splitting jobs larger
than a batch. When a batch is not full, ``batch_wait`` decides: ``"decoding"`` (the default)
runs the queued rows as soon as the compute thread is free and no admitted image is still being
decoded (none can join: TEI's policy), and otherwise waits for those images until the oldest job
has waited ``max_delay_s``; ``"delay"`` always waits ``max_delay_s`` for a fuller batch
(Triton's ``max_queue_delay``). The images being decoded are counted over every output set and
grid (their grid is known only once decoded). A ``solo`` job is never packed with others (its
batches are the same whatever else is queued: the batch job's bit-exact resumes); under
``"decoding"`` it never waits, since no company can join it.
The compute thread never compiles: a batch whose forward is not compiled yet is handed to the
engine's compile thread and waits while batches of other output sets run. A job whose caller has
gone or whose deadline has passed is dropped before its rows are computed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from vit22b.model.errors import CallerGone, DeadlineExpired, Draining, NotReady, QueueFull
from vit22b.model.features import Features
from vit22b.model.outputs import OutputRequest

from .engine import LEVELS, MAX_PENDING_COMPILES, CompileLimit, Engine
from .handoff import hand_back
from .metrics import Metrics
from .settings import ServeConfig, check_batch_wait

# A call its transport ends this close to its deadline is counted as ended by the deadline: a
# gRPC client's deadline comes before the server's by the request's transit and the rounding of
# its timeout header, so its cancellation arrives a little early, and the caller
# itself sees DEADLINE_EXCEEDED. A call is never dropped before its deadline for it.
DEADLINE_SLACK_S = 0.05


def ended_by_deadline(deadline: float | None, now: float) -> bool:
    """Whether a call that ended at ``now`` (``time.monotonic()``) counts as ended by its
    ``deadline`` rather than by its caller (``DEADLINE_SLACK_S``)."""
    return deadline is not None and now >= deadline - DEADLINE_SLACK_S

log = logging.getLogger(__name__)


@dataclass
class Result:
    features: Features
    queue_s: float  # submission to the start of the job's first batch
    compute_s: float  # forward time of the batches that held its rows


@dataclass(frozen=True)
class BatchRecord:
    """When one batch holding a job's rows ran (wall-clock ns, for trace spans)."""

    start_ns: int
    end_ns: int
    images: int  # real images in the batch
    bucket: int
    rows: int  # the job's rows among them


@dataclass(eq=False)
class Job:
    images: np.ndarray  # preprocessed uint8 levels [n, H, W, 3] (the forward normalises them)
    outputs: OutputRequest  # resolved
    grid: tuple[int, int]  # the images' patch grid (rows, cols)
    deadline: float | None  # time.monotonic() deadline, or None
    solo: bool = False  # never packed with other jobs
    submitted: float = field(default_factory=time.monotonic)
    submitted_ns: int = field(default_factory=time.time_ns)
    # settled from the compute thread through ``hand_back``: one wake-up of the caller's loop
    # per batch, not one per job as a concurrent future's asyncio wrapper costs
    future: asyncio.Future | None = None
    next_row: int = 0  # rows handed to batches so far
    done_rows: int = 0
    parts: list = field(default_factory=list)  # (first row, features) per batch
    started: float | None = None
    compute_s: float = 0.0
    cancelled: bool = False  # the caller is gone: ``Batcher.withdraw``
    batches: list[BatchRecord] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.images.shape[0]

    @property
    def key(self) -> tuple[OutputRequest, tuple[int, int]]:
        """What jobs packed into one batch share: the output set and the grid."""
        return self.outputs, self.grid


class Batcher:
    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        *,
        max_batch_images: int | None = None,
        max_delay_s: float = ServeConfig.max_delay_ms / 1e3,
        max_queue_images: int = ServeConfig.max_queue_images,
        batch_wait: str = ServeConfig.batch_wait,
    ):
        if error := check_batch_wait(batch_wait):
            raise ValueError(f"batch wait {error}")
        self.engine, self.metrics = engine, metrics
        # read at each scrape: a compile whose callers left before it ended runs no batch
        metrics.compilations.set_function(lambda: engine.compilations)
        self.batch_wait = batch_wait
        self.max_batch_images = min(
            max_batch_images or engine.max_batch_images, engine.max_batch_images
        )
        self.max_delay_s = max_delay_s
        self.max_queue_images = max_queue_images
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._pending = 0  # admitted images not yet computed or dropped (includes preprocessing)
        self._decoding = 0  # admitted images not yet submitted or released
        self._closed = False  # no new admissions (stopped)
        self._flush = False  # no waiting for fuller batches (draining)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vit22b-batcher", daemon=True)

    # ---- admission -------------------------------------------------------------------------
    def try_admit(self, n: int) -> bool:
        """Reserve room for ``n`` images if there is some (a waiting stream polls this)."""
        with self._cond:
            if self._closed:
                raise Draining("server is shutting down; retry on another replica")
            if self._pending + n > self.max_queue_images:
                return False
            self._pending += n
            self._decoding += n
            self.metrics.queue_images.set(self._pending)
            return True

    def admit(self, n: int) -> None:
        """Reserve room for ``n`` images, or ``QueueFull`` at once."""
        if not self.try_admit(n):
            self.metrics.images.labels("rejected").inc(n)
            raise QueueFull(
                f"queue full: {self._pending} images queued, {n} more would exceed the "
                f"limit of {self.max_queue_images}; retry with backoff"
            )

    def release(self, n: int) -> None:
        """Give back admitted room whose images will not be submitted (invalid, caller gone)."""
        if not n:
            return
        with self._cond:
            self._pending -= n
            self._decoding -= n
            self.metrics.queue_images.set(self._pending)
            if not self._decoding:  # queued rows need wait no longer for them
                self._cond.notify()

    def withdraw(self, job: Job) -> None:
        """The caller is gone (from any thread): the compute thread drops the job's rows not
        yet in a batch now, not at its next wake-up (a compile it waits on may take minutes)."""
        with self._cond:
            job.cancelled = True
            self._cond.notify()

    def submit(
        self,
        images: np.ndarray,
        outputs: OutputRequest,
        deadline: float | None,
        solo: bool = False,
    ) -> Job:
        """Queue admitted, preprocessed images (uint8 levels at the geometry); call on an event
        loop: the job's future, on that loop, gets a ``Result``."""
        if images.dtype != LEVELS:  # a float batch would be taken for levels or mixed with them
            raise TypeError(f"the batcher takes uint8 pixel levels, not {images.dtype}")
        grid = self.engine.cfg.grid_at(images.shape[1], images.shape[2])
        job = Job(images, outputs, grid, deadline, solo,
                  future=asyncio.get_running_loop().create_future())
        with self._cond:
            if grid != tuple(self.engine.grid):
                self._check_new_grid(job.key)
            self._queue.append(job)
            self._decoding -= job.size
            self._cond.notify()
        return job

    def _check_new_grid(self, key: tuple[OutputRequest, tuple[int, int]]) -> None:
        """``CompileLimit`` for a job of a grid no forward is compiled for while the queued
        jobs already wait on ``MAX_PENDING_COMPILES`` such (output set, grid) pairs (lock
        held). Every dense aspect ratio is a compile of its own (minutes for ViT-22B): a
        client cycling through them would queue compiles without end ahead of everyone's.
        The queue is the count, so a job that leaves it (done, expired, gone) frees its place."""
        own = tuple(self.engine.grid)
        waiting = {job.key for job in self._queue if job.key[1] != own}
        if key in waiting or self.engine.has_forwards(*key):
            return  # its compile is counted already, or needs none
        waiting = [k for k in waiting if not self.engine.has_forwards(*k)]
        if len(waiting) >= MAX_PENDING_COMPILES:
            rows, cols = key[1]
            raise CompileLimit(
                f"{len(waiting)} patch grids are waiting to be compiled (the limit); this "
                f"request's images make a {rows}x{cols} grid, which would be another: retry "
                "later, or send images of a grid already in use (dense: the same aspect ratio)"
            )

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def flush(self) -> None:
        """From now on queued work runs at once, without waiting for fuller batches (draining)."""
        with self._cond:
            self._flush = True
            self._cond.notify()

    def stop(self) -> None:
        """Compute what is queued (without waiting for fuller batches), then end the thread."""
        with self._cond:
            self._closed = self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    # ---- the compute thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._compute(batch)

    def _next_batch(self) -> list[tuple[Job, int, int]] | None:
        """Wait for a batch that is full or due, and compiled; returns (job, first row, rows)."""
        with self._cond:
            while True:
                self._drop_dead()
                if not self._queue:
                    if self._stopping:
                        return None
                    self._cond.wait()
                    continue
                now, wait = time.monotonic(), None
                eager = self.batch_wait == "decoding"
                alone = eager and not self._decoding  # no image on its way to join
                for head in self._heads():
                    ready = self._ready_rows(head)
                    due = head.submitted + self.max_delay_s - now
                    limit = self._limit(head)
                    go = alone or (eager and head.solo) or self._flush or self._stopping
                    if not (go or ready >= limit or due <= 0):
                        wait = due if wait is None else min(wait, due)
                        continue
                    bucket = self.engine.bucket(min(ready, limit))
                    if self._compiled(bucket, head):
                        return self._take(head)
                expiry = [j.deadline - now for j in self._queue if j.deadline is not None]
                if expiry:  # a job waiting on its compile still expires on time
                    wait = max(0.0, min(expiry if wait is None else [*expiry, wait]))
                self._cond.wait(wait)

    def _limit(self, head: Job) -> int:
        """Rows in one batch of the head's grid: the image limit within the patch budget."""
        return max(1, min(self.max_batch_images, self.engine.max_images(head.grid)))

    def _heads(self) -> list[Job]:
        """The first job of each (output set, grid) (and every solo job), in arrival order."""
        heads, seen = [], set()
        for job in self._queue:
            if job.solo or job.key not in seen:
                heads.append(job)
                if not job.solo:
                    seen.add(job.key)
        return heads

    def _ready_rows(self, head: Job) -> int:
        if head.solo:
            return head.size - head.next_row
        return sum(j.size - j.next_row for j in self._queue if j.key == head.key and not j.solo)

    def _compiled(self, bucket: int, head: Job) -> bool:
        """True when the forward is ready; else it compiles off this thread (lock held)."""
        outputs, grid = head.key
        if self.engine.is_compiled(bucket, outputs, grid):
            return True
        future = self.engine.compile_async(bucket, outputs, grid, self._wake)
        if not future.done():
            return False  # its callback wakes this thread (it needs the lock we hold)
        err = future.exception()
        if err is None:  # compiled since the check: its wake-up already went by
            return True
        # the compile failed: fail its jobs, keep serving the others
        log.error("compiling %s for bucket %d at grid %s failed: %s", outputs, bucket, grid, err)
        for job in [j for j in self._queue if j.key == head.key]:
            self._queue.remove(job)
            self._pending -= job.size - job.next_row
            _fail(job.future, err)
        self.metrics.queue_images.set(self._pending)
        return False

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _take(self, head: Job) -> list[tuple[Job, int, int]]:
        batch, room = [], self._limit(head)
        for job in [head] if head.solo else list(self._queue):
            if room == 0:
                break
            if job.key != head.key or (job.solo and job is not head):
                continue
            rows = min(room, job.size - job.next_row)
            batch.append((job, job.next_row, rows))
            job.next_row += rows
            room -= rows
            if job.next_row == job.size:
                self._queue.remove(job)
        return batch

    def _drop_dead(self) -> None:
        """Fail queued jobs whose caller has gone or whose deadline passed (lock held)."""
        now = time.monotonic()
        for job in list(self._queue):
            if not (job.cancelled or job.future.cancelled()
                    or (job.deadline is not None and now >= job.deadline)):
                continue
            expired = ended_by_deadline(job.deadline, now)
            self._queue.remove(job)
            rows = job.size - job.next_row
            self._pending -= rows
            self.metrics.queue_images.set(self._pending)
            if expired:  # the transport may also have cancelled it: the deadline came first
                self.metrics.images.labels("expired").inc(rows)
                err: Exception = DeadlineExpired(
                    f"deadline passed in the queue; {rows} of {job.size} images not computed"
                )
            else:
                self.metrics.images.labels("cancelled").inc(rows)
                err = CallerGone(f"caller gone; {rows} of {job.size} images not computed")
            _fail(job.future, err)

    def _compute(self, batch: list[tuple[Job, int, int]]) -> None:
        outputs = batch[0][0].outputs
        images = np.concatenate([job.images[first : first + rows] for job, first, rows in batch])
        start, start_ns = time.monotonic(), time.time_ns()
        for job, _, _ in batch:
            if job.started is None:
                job.started = start
                self.metrics.queue_seconds.observe(start - job.submitted)
        try:
            features = self.engine.forward(images, outputs)
        except Exception as err:  # a bug: fail the batch's callers, keep serving the others
            if isinstance(err, NotReady):  # a group that lost a process: said where it broke
                log.warning("a batch of %d images not computed: %s", len(images), err)
            else:
                log.exception("forward failed for a batch of %d images", len(images))
            for job, _, _ in batch:
                _fail(job.future, err)
            features = None
        elapsed, end_ns = time.monotonic() - start, time.time_ns()
        n = len(images)
        bucket = self.engine.bucket(n)
        for job, _, rows in batch:
            job.batches.append(BatchRecord(start_ns, end_ns, n, bucket, rows))
        self.metrics.compute_seconds.observe(elapsed)
        self.metrics.batch_images.observe(n)
        self.metrics.batches.labels("{}x{}".format(*batch[0][0].grid)).inc()
        self.metrics.padding_images.inc(bucket - n)
        with self._cond:
            self._pending -= n
            self.metrics.queue_images.set(self._pending)
        if features is None:
            return
        self.metrics.images.labels("computed").inc(n)
        offset, finished = 0, []
        for job, first, rows in batch:
            job.parts.append((first, features.take(slice(offset, offset + rows))))
            job.compute_s += elapsed
            job.done_rows += rows
            offset += rows
            if job.done_rows == job.size:
                parts = [part for _, part in sorted(job.parts, key=lambda p: p[0])]
                result = Result(Features.concat(parts), job.started - job.submitted, job.compute_s)
                finished.append((job.future, result, None))
        hand_back(finished)


def _fail(future: asyncio.Future, err: Exception) -> None:
    """The caller's future fails with ``err`` (skipped if it was cancelled meanwhile)."""
    hand_back([(future, None, err)])
