"""One model served by several processes with JAX's multi-controller runtime.

Every process joins the group (``jax.distributed``), restores its own shards of the checkpoint
onto the global mesh and compiles the same forwards. Process 0 runs the gRPC front end and the
batcher; for each batch it posts a header (run or stop, bucket, output set, chunk steps to run)
in the coordination service's key-value store and broadcasts the pixels; every process runs the
forward together and the features are gathered back. Workers do nothing else: they follow the
headers until process 0 says stop.

Liveness. With the runtime's defaults a dead peer takes everyone down: the coordination service
(in process 0) propagates the missed heartbeats as a fatal error and the survivors abort. Process 0
must outlive a worker to say so, so the group runs with ``jax_enable_recoverability`` and keeps
its own heartbeats in the coordination service's key-value store: each worker bumps a counter
every ``BEAT_S``; process 0 counts a worker gone when its counter stands still for the peer
timeout, when it reports a failure there, or at once when a collective fails (gloo sees the
closed connection of a dead peer). Then health goes NOT_SERVING and every call gets UNAVAILABLE.
A collective hung on a live but stuck peer runs on its own thread, so neither the batcher nor the
front end waits on it. When process 0 goes, the runtime aborts the workers (their heartbeats to the
coordinator fail): the group lives and dies with process 0, and is restarted as a whole.

``child_main`` is the JAX process of ``vit22b serve --coordinator ...``; ``distributed_cli``
supervises it, because the runtime ends a process that cannot join by aborting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NoReturn

import jax
import numpy as np
from grpc_health.v1 import health_pb2
from jax.experimental import multihost_utils
from vit22b.model.errors import NotReady
from vit22b.model.outputs import POOLED, OutputRequest

from . import logs
from .app import FeatureServer, build_engine, preflight, serve_started
from .cpu_devices import cpu_flags
from .distributed_cli import BEAT_S, STATUS_FD_ENV, Group
from .engine import Engine, pixel_dtype
from .infer import run_loop
from .plan import cpu_bf16
from .service import LIVENESS, READINESS
from .settings import ServeConfig

log = logging.getLogger(__name__)

_KEY = "vit22b/{}/{}"  # coordination-service keys: vit22b/<what>/<process>


class GroupLost(NotReady):
    """A process of the group is gone: the group cannot compute; health is NOT_SERVING."""


class GroupError(RuntimeError):
    """The group cannot start: a worker refused (other settings) or failed, or left."""


# ------------------------------------------------------------------------------------------
# the engine of a group
# ------------------------------------------------------------------------------------------


def outputs_from_dict(fields: dict) -> OutputRequest:
    return OutputRequest(**{**fields, "patch_layers": tuple(fields["patch_layers"])})


class GroupExecutor:
    """Runs each batch across every process of the group: process 0 leads, workers follow.

    Batch ``k``'s header (run or stop, bucket, output set, steps) is the coordination service's
    key ``vit22b/batch/k``: a worker waits for it there, not in a collective, because XLA's CPU
    collectives give up after 30 minutes and a server may idle for longer. Then every process
    makes the same collectives in the same order: the pixels' broadcast, the forward, the gather.
    Its health is the facade's admission check (``check``) and the server's health service
    (``on_lost``).
    """

    def __init__(self) -> None:
        self.client = _client()
        self.lost: str | None = None  # why the group cannot compute any more
        self.on_lost: Callable[[str], None] = lambda reason: None
        self._lost_lock = threading.Lock()
        self._batches = 0  # headers posted (process 0) or taken (workers)
        self.terminated: float | None = None  # a worker's SIGTERM (monotonic time)
        self.stop_grace_s = 60.0  # how long a terminated worker waits for process 0's stop
        # One thread makes every collective on process 0, so a hung one blocks only itself.
        self._collectives = ThreadPoolExecutor(1, thread_name_prefix="vit22b-collective")

    def lose(self, reason: str) -> None:
        """From any thread: the group is broken; refuse all work from now on (once)."""
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = reason
        log.error("the serving group is broken: %s; NOT_SERVING, calls get UNAVAILABLE", reason)
        self.on_lost(reason)

    def check(self) -> None:
        if self.lost is not None:
            raise GroupLost(f"the serving group lost a process ({self.lost}); retry elsewhere")

    def run(self, engine: Engine, bucket: int, outputs: OutputRequest, pixels: np.ndarray,
            active: int | None = None):
        """Process 0: the batch through every process; returns the host outputs."""
        self.check()
        grid = engine.cfg.grid_at(*pixels.shape[1:3])
        # a compile error here leaves the group in step
        engine.compiled(bucket, outputs, grid, pixels.dtype)
        step = self._collectives.submit(self._lead_step, engine, "run", bucket, outputs, pixels,
                                        active)
        while True:
            try:
                return step.result(timeout=BEAT_S / 5)
            except FutureTimeout:
                self.check()  # a worker went silent while this batch ran
            except Exception as err:  # the processes may have left lockstep: nothing is safe
                self.lose(f"a batch failed across the group: {type(err).__name__}: {err}")
                raise GroupLost(f"the serving group broke during this batch: {err}") from err

    def stop_workers(self, engine: Engine, timeout_s: float = 30.0) -> bool:
        """Process 0: tell the workers to stop (False when the group is broken)."""
        if self.lost is not None:
            return False
        step = self._collectives.submit(self._lead_step, engine, "stop", 0, POOLED, None)
        step.result(timeout_s)
        return True

    def follow(self, engine: Engine) -> None:
        """A worker's life: run every batch process 0 posts, until it says stop."""
        while True:
            self._batches += 1
            key = _KEY.format("batch", self._batches)
            header = None
            while header is None:  # the wait may be long: in slices, not in one call
                if self.terminated is not None and \
                        time.monotonic() - self.terminated > self.stop_grace_s:
                    raise GroupError(f"stopped by SIGTERM: process 0 did not stop the group "
                                     f"within --drain-timeout {self.stop_grace_s:g}s")
                try:
                    header = json.loads(self.client.blocking_key_value_get(key, 10_000))
                except jax.errors.JaxRuntimeError as err:
                    if "DEADLINE_EXCEEDED" not in str(err):
                        raise
            if header["command"] == "stop":
                return
            if header["command"] == "refuse":
                raise GroupError(f"refused by process 0: {header['reason']}")
            grid = tuple(header["grid"])
            self._step(engine, header["bucket"], outputs_from_dict(header["outputs"]), None, grid,
                       header["active"], header["pixels"])

    def _lead_step(self, engine: Engine, command: str, bucket: int, outputs, pixels,
                   active: int | None = None):
        self._batches += 1
        key = _KEY.format("batch", self._batches)
        header = {"command": command, "bucket": bucket, "outputs": dataclasses.asdict(outputs),
                  "active": active,
                  "grid": list(engine.grid if pixels is None else
                               engine.cfg.grid_at(*pixels.shape[1:3])),
                  "pixels": None if pixels is None else pixels.dtype.str}
        self.client.key_value_set(key, json.dumps(header))
        if command == "stop":
            return None
        result = self._step(engine, bucket, outputs, pixels, active=active)
        self.client.key_value_delete(key)  # every worker has taken it: they ran the batch
        return result

    def _step(self, engine: Engine, bucket: int, outputs: OutputRequest, pixels, grid=None,
              active: int | None = None, dtype: str | None = None):
        """One batch in step with the group: the pixels' broadcast, the forward, the gather;
        a worker (``pixels`` None) takes the batch's ``grid`` and ``dtype`` from the header."""
        if pixels is None:  # workers contribute zeros to the broadcast
            cfg, (rows, cols) = engine.cfg, grid or engine.grid
            shape = (bucket, rows * cfg.patch, cols * cfg.patch, cfg.channels)
            pixels = np.zeros(shape, pixel_dtype(dtype))
        pixels = multihost_utils.broadcast_one_to_all(pixels)
        batch = jax.make_array_from_callback(
            pixels.shape, engine.batch_sharding, lambda index: pixels[index]
        )
        result = engine.call(bucket, outputs, engine.placement(engine.plan.data), batch, active)
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(result, tiled=True))


# ------------------------------------------------------------------------------------------
# the coordination service: joining, settings, heartbeats
# ------------------------------------------------------------------------------------------


def join(group: Group) -> None:
    """jax.distributed.initialize; the runtime aborts this process if a peer never arrives."""
    jax.config.update("jax_enable_recoverability", True)  # process 0 must outlive a worker
    jax.distributed.initialize(
        group.coordinator,
        group.num_processes,
        group.process_id,
        cluster_detection_method="deactivate",  # the flags say who is who
        initialization_timeout=group.init_timeout_s,
    )


def _client():
    from jax._src import distributed  # the runtime's client: its key-value store

    return distributed.global_state.client


def start_heartbeat(client, process_id: int) -> None:
    """A worker bumps its counter every BEAT_S until the coordinator is gone."""

    def beat() -> None:
        count = 0
        while True:
            count += 1
            try:
                client.key_value_set(_KEY.format("alive", process_id), str(count), True)
            except Exception:  # noqa: BLE001 - the coordinator is gone; the runtime ends us
                return
            time.sleep(BEAT_S)

    threading.Thread(target=beat, daemon=True, name="vit22b-heartbeat").start()


class Watch:
    """Process 0's view of the workers: who stopped beating or reported a failure."""

    def __init__(self, client, group: Group):
        self.client, self.group = client, group
        now = time.monotonic()
        self._seen: dict[int, tuple[str | None, float]] = {i: (None, now) for i in group.workers}

    def gone(self) -> dict[int, str]:
        """{process: why} for every worker that is gone, as of now (two reads, any group size)."""
        now, gone = time.monotonic(), {}
        failures, beats = self.failures(), self._read("alive")
        for i, (count, since) in self._seen.items():
            if i in failures:
                gone[i] = failures[i]
            elif beats.get(i) != count:
                self._seen[i] = (beats.get(i), now)
            elif now - since > self.group.peer_timeout_s:
                gone[i] = f"no heartbeat for {now - since:.1f}s"
        return gone

    def failures(self) -> dict[int, str]:
        """{process: its own report} for every worker that reported a failure (from any
        thread: nothing of the watch's state is touched)."""
        return self._read("failed")

    def _read(self, what: str) -> dict[int, str]:
        """Every worker's ``vit22b/<what>/<process>`` value."""
        prefix = _KEY.format(what, "")
        return {int(key[len(prefix) :]): v for key, v in self.client.key_value_dir_get(prefix)}

    def await_workers(self, stage: str) -> dict[int, str]:
        """Every worker's value for ``stage``; GroupError as soon as one is gone."""
        while True:
            gone = self.gone()
            if gone:
                raise GroupError("; ".join(f"process {i}: {why}" for i, why in gone.items()))
            values = self._read(stage)
            if len(values) == len(self._seen):
                return values
            time.sleep(BEAT_S / 5)

    def watch_forever(self, group: GroupExecutor) -> None:
        """Name each worker that goes, once; the first one breaks the group."""
        named: set[int] = set()
        while len(named) < len(self._seen):
            for i, why in self.gone().items():
                if i not in named:
                    named.add(i)
                    log.error("process %d of the group is gone: %s", i, why)
                    group.lose(f"process {i} is gone: {why}")
            time.sleep(BEAT_S)


def settings(config: ServeConfig, group: Group) -> dict:
    """What every process must agree on before loading: one model, one mesh, the same code."""
    from importlib.metadata import version

    return {
        "model": config.model,
        "checkpoint": bool(config.checkpoint),  # paths may differ by host; the fingerprint may not
        "seed": None if config.checkpoint else config.seed,
        "mesh": config.mesh,
        "compute_dtype": config.compute_dtype,
        # what "auto" resolves by on a CPU: hosts that differ would compute different programs
        "cpu_bf16": cpu_bf16(cpu_flags()) if jax.devices()[0].platform == "cpu" else None,
        "max_batch_images": config.max_batch_images,
        "max_batch_patches": config.max_batch_patches,
        "chunk_images": config.chunk_images,  # the programs' chunk steps, posted per batch
        # the pixels are broadcast to a [processes, local devices] layout
        "local_devices": jax.local_device_count(),
        "warm_outputs": [repr(o) for o in config.warm_outputs],
        "warm_resolutions": list(config.warm_resolutions),
        "num_processes": group.num_processes,
        "vit22b": version("vit22b"),
        "jax": jax.__version__,
    }


def _differences(mine: dict, leader: dict) -> list[str]:
    keys = sorted(set(mine) | set(leader))
    return [
        f"{k}: {mine.get(k)!r} here, {leader.get(k)!r} on process 0"
        for k in keys
        if mine.get(k) != leader.get(k)
    ]


# ------------------------------------------------------------------------------------------
# the processes' lives
# ------------------------------------------------------------------------------------------


def run_process(config: ServeConfig, group: Group, report: Callable[[str], None]) -> int:
    """Join, agree, load and compile, then lead (process 0) or follow (workers)."""
    join(group)
    # jax.distributed's preemption notifier took SIGTERM (it logs it and nothing else): a
    # worker told to stop, or process 0 still loading, ends as the signal says; process 0
    # drains on it once serving (its own handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    report("joined")
    client = _client()
    mine = settings(config, group)
    if group.leader:
        preflight(config)  # the front end's files, before the group loads
        watch = Watch(client, group)
        client.key_value_set(_KEY.format("settings", 0), json.dumps(mine))
        watch.await_workers("agreed")
        engine = _load_with(watch, config)
        fingerprints = watch.await_workers("ready")
        wrong = {i: f for i, f in fingerprints.items() if f != engine.identity.fingerprint}
        if wrong:
            reason = (f"the workers hold other weights: fingerprints {wrong}, process 0 has "
                      f"{engine.identity.fingerprint}; give every process the same checkpoint")
            _refuse(client, watch, reason)
            raise GroupError(reason)
        return run_loop(_lead(config, group, engine, watch, report))
    _claim(client, group)
    start_heartbeat(client, group.process_id)
    try:
        leader = json.loads(
            client.blocking_key_value_get(_KEY.format("settings", 0), group.init_timeout_s * 1000)
        )
        differences = _differences(mine, leader)
        if differences:
            raise GroupError("settings differ from process 0's: " + "; ".join(differences))
        client.key_value_set(_KEY.format("agreed", group.process_id), "yes")
        engine = _load(config)
        client.key_value_set(_KEY.format("ready", group.process_id), engine.identity.fingerprint)
        report("ready")
        _stop_on_term(engine.executor, config.drain_timeout_s)
        print(
            f"vit22b serve: process {group.process_id} of {group.num_processes} ready "
            f"({jax.local_device_count()} of {jax.device_count()} devices, mesh "
            f"{engine.mesh_spec}); following process 0",
            flush=True,
        )
        engine.executor.follow(engine)
    except BaseException as err:
        with contextlib.suppress(Exception):  # the coordinator may be gone already
            client.key_value_set(
                _KEY.format("failed", group.process_id), f"{type(err).__name__}: {err}"
            )
        raise
    # Stopped: tell the supervisor first (the runtime aborts us once process 0 has left), then
    # process 0, which waits for this before it leaves.
    report("stopped")
    print(f"vit22b serve: process {group.process_id} stopped (process 0 stopped)", flush=True)
    client.key_value_set(_KEY.format("stopped", group.process_id), "yes")
    return 0


def _stop_on_term(executor: GroupExecutor, grace_s: float) -> None:
    """A worker's SIGTERM once loaded: the whole group is being stopped (every member gets it
    at once), so it serves on until process 0 has drained and stops it, for at most
    ``grace_s``; then it leaves, which breaks the group (it alone was being stopped)."""
    executor.stop_grace_s = grace_s

    def on_term(signum, frame) -> None:
        log.warning("SIGTERM: serving until process 0 stops the group, at most %gs", grace_s)
        executor.terminated = executor.terminated or time.monotonic()

    signal.signal(signal.SIGTERM, on_term)


def _refuse(client, watch: Watch, reason: str) -> None:
    """Process 0 refuses the loaded workers: the reason as their first header, and a wait
    (a peer timeout) for each to report it, which it says before process 0 leaves; else the
    runtime aborts them as "process 0 is gone", saying nothing of why."""
    client.key_value_set(_KEY.format("batch", 1), json.dumps({"command": "refuse",
                                                               "reason": reason}))
    end = time.monotonic() + watch.group.peer_timeout_s
    while time.monotonic() < end and len(watch.gone()) < len(watch.group.workers):
        time.sleep(BEAT_S / 5)


def _claim(client, group: Group) -> None:
    """GroupError when another process already holds this process id in the group (a stray,
    or a worker restarted into a group that cannot take it back): before it could beat or
    report for the process that holds it."""
    try:
        client.key_value_set(_KEY.format("member", group.process_id), str(os.getpid()))
    except Exception:  # noqa: BLE001 - ALREADY_EXISTS, the runtime's own error type
        raise GroupError(
            f"process id {group.process_id} is already in the group at {group.coordinator} (a "
            "process with the same --process-id, or this one restarted: a group cannot take "
            "a process back; restart the whole group)") from None


def _load_with(watch: Watch, config: ServeConfig) -> Engine:
    """Process 0's load, watched: its restore and warm-up wait in collectives for every
    worker, and a worker that failed before it joined them (one without its checkpoint) left
    process 0 waiting there for gloo's 30 s, then failing as if its own checkpoint were
    damaged. A worker's reported failure now ends process 0 at once, naming it (a silent
    heartbeat does not: a worker busy loading may miss beats). A load that fails first names
    a worker gone by then as its cause."""
    loaded = threading.Event()

    def watch_reports() -> None:
        while not loaded.wait(BEAT_S):
            try:
                failed = watch.failures()
            except Exception:  # noqa: BLE001 - the service's own errors: the load says more
                return
            if failed and not loaded.is_set():
                _leave(2, f"vit22b serve: process 0: {_causes(failed)} (process 0 stopped its "
                          "own load, which waits for every process)")

    watcher = threading.Thread(target=watch_reports, daemon=True, name="vit22b-load-watch")
    watcher.start()
    try:
        try:
            return _load(config)
        finally:
            loaded.set()
            watcher.join()
    except Exception as err:
        gone = watch.gone()
        if not gone:
            raise
        raise GroupError(f"{_causes(gone)} (process 0's own load then failed: "
                         f"{type(err).__name__})") from err


def _causes(gone: dict[int, str]) -> str:
    return "; ".join(f"process {i}: {why}" for i, why in gone.items())


_said_to: int | None = None  # this process's standard error as it started (_keep_stderr)


def _keep_stderr() -> None:
    """Keep the process's standard error for ``_leave``: a checkpoint restore puts file
    descriptor 2 on /dev/null while it runs (``checkpoint._quiet_orbax``), and process 0's load
    watcher may leave from its own thread just then (its message was lost, exit 2 unexplained)."""
    global _said_to
    if _said_to is None:
        _said_to = os.dup(2)


def _leave(code: int, message: str | None = None) -> NoReturn:
    """Out of this process at once, ``message`` said and the streams flushed: a broken group
    may leave a collective hung on a thread, and an orderly exit would wait on it and on the
    runtime's shutdown. From any thread."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    if message:
        os.write(2 if _said_to is None else _said_to, f"{message}\n".encode(errors="replace"))
    os._exit(code)


def _load(config: ServeConfig) -> Engine:
    # "auto" is every device of every process on data (a single process's "auto" plans for
    # its own host's CPU devices only).
    spec = f"data={jax.device_count()},model=1" if config.mesh == "auto" else config.mesh
    return build_engine(dataclasses.replace(config, mesh=spec), GroupExecutor())


async def _lead(
    config: ServeConfig, group: Group, engine: Engine, watch: Watch, report
) -> int:
    """Process 0: the front end over the group until SIGTERM; then the workers stop too."""
    server = FeatureServer(config, engine)
    await server.start()
    loop = asyncio.get_running_loop()

    async def not_serving() -> None:
        for name in (*READINESS, LIVENESS):  # never whole again: not live either
            await server.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    executor = engine.executor
    executor.on_lost = lambda reason: asyncio.run_coroutine_threadsafe(not_serving(), loop)
    if executor.lost is not None:  # lost while the server started
        executor.on_lost(executor.lost)
    threading.Thread(target=watch.watch_forever, args=(executor,), daemon=True).start()
    report("serving")
    note = f" over {group.num_processes} processes ({engine.mesh.size} devices)"
    code = await serve_started(server, note)  # until SIGTERM, then drained
    try:
        stopped = await asyncio.to_thread(executor.stop_workers, engine)
    except Exception as err:  # noqa: BLE001 - leaving anyway
        log.warning("the workers did not take the stop: %s", err)
        stopped = False
    if stopped:  # each worker says so before it leaves (it must not see process 0 go first)
        try:
            await asyncio.to_thread(watch.await_workers, "stopped")
        except GroupError as err:
            log.warning("a worker did not confirm its stop: %s", err)
    print(
        "vit22b serve: " + ("workers stopped" if stopped else f"group broken: {executor.lost}"),
        flush=True,
    )
    return code if stopped else 1


# ------------------------------------------------------------------------------------------
# the JAX process of `vit22b serve --coordinator ...` (started by distributed_cli)
# ------------------------------------------------------------------------------------------


def decode_spec(text: str) -> tuple[ServeConfig, Group]:
    spec = json.loads(text)
    config = spec["config"]
    config["warm_outputs"] = tuple(outputs_from_dict(o) for o in config["warm_outputs"])
    for name in ("resolutions", "warm_resolutions"):
        config[name] = tuple(config[name])
    return ServeConfig(**config), Group(**spec["group"])


def _reporter() -> Callable[[str], None]:
    fd = os.environ.get(STATUS_FD_ENV)
    if fd is None:
        return lambda phase: None
    stream = os.fdopen(int(fd), "w", buffering=1)
    return lambda phase: stream.write(phase + "\n")


def child_main(spec: str) -> NoReturn:
    _keep_stderr()
    config, group = decode_spec(spec)
    logs.configure(config.log_level, config.log_format, group.process_id)
    if not group.leader:  # waiting inside the runtime, a worker ends on the first signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        code = run_process(config, group, _reporter())
    except (ValueError, OSError, GroupError) as err:  # flags, checkpoint, refusal, a peer gone
        _leave(2, f"vit22b serve: process {group.process_id}: {err}")
    except BaseException:  # a collective that failed under a worker, or a bug: say where
        traceback.print_exc()
        code = 1
    _leave(code)
