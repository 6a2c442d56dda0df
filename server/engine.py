"""The engine: parameters on a mesh, a cache of compiled forwards, and an executor that runs them.

``Plan`` (server/plan.py) decides buckets, placements and chunks; the engine holds the compiled
forwards, one per (bucket, output set, patch grid, pixel dtype), and hands each batch to its
executor: ``LocalExecutor`` for one process, ``GroupExecutor`` (server/distributed.py) for a
``jax.distributed`` group.

Pixels. The serving path hands the engine uint8 levels (``LEVELS``), and the compiled forward
normalises them by the pixel contract's table (``model.forward.from_levels``): a quarter of the
bytes on the host and to the device, and no pass over every image on the host's interpreter-
bound threads. Normalised float32 pixels (``NORMALISED``: tests, benchmarks against peers fed
floats) have their own compiled forwards; the dtype is part of every compiled forward's key.

Compiled forwards. The warm output sets (by default: pooled features) are compiled for every
bucket before the server reports SERVING and stay. Any other output set is compiled on first use
for the bucket it needs, on the engine's compile thread (never the batcher's: warm batches keep
flowing), one at a time, and kept in an LRU of ``max_compiled`` entries. A new output set is
refused (``CompileLimit``) while the cache is full of sets used within ``CACHE_IDLE_S``, or
while ``MAX_PENDING_COMPILES`` sets wait to compile: thrashing would make every request compile
(for ViT-22B, minutes each). Compiling every combination of layers up front is impossible, and
one superset forward returning every layer would hold batch x depth x tokens x width activations
per device (about 10 GB for ViT-22B at batch 32).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from vit22b.model.config import DEFAULT_MODEL, ViTConfig, get_config
from vit22b.model.errors import QueueFull
from vit22b.model.features import Features
from vit22b.model.forward import cast_matmul_kernels, chunked_apply, store_transposed
from vit22b.model.identity import ModelIdentity, seeded_source
from vit22b.model.info import count
from vit22b.model.outputs import POOLED, OutputRequest
from vit22b.model.pixels import level_table
from vit22b.model.posemb import Grid
from vit22b.model.sharding import (
    batch_sharding,
    check_mesh_fits,
    init_sharded,
    make_mesh,
    mesh_spec,
    param_shardings,
)
from vit22b.model.vit import Execution, position_table

from .cpu_devices import cpu_flags
from .plan import AUTO_DTYPE, Plan, auto_compute_dtype, auto_data_devices, cpu_bf16

log = logging.getLogger(__name__)

CACHE_IDLE_S = 60.0  # an on-demand forward unused this long may make room for a new output set
MAX_PENDING_COMPILES = 4  # output sets (or patch grids) waiting to compile; beyond: refused
# XLA:CPU takes a host batch without copying it only when its data is this aligned; NumPy's
# allocator gives 16 bytes for arrays below the mmap threshold: a tiny model's batch of 16 goes
# to the device in 146 us copied, 49 us aligned (benchmarks/serve_parts.py, device_put_16_us).
HOST_ALIGN = 64


class CompileLimit(QueueFull):
    """A new output set or patch grid cannot be compiled now (cache full of recent sets, or
    compiles queued)."""


def stored_config(model: str | None, checkpoint_dir: str | None) -> ViTConfig:
    """The architecture ``Engine.load`` would serve, read without loading a weight: the
    checkpoint's metadata, else the preset (the default model without either)."""
    from vit22b.model import checkpoint  # orbax: only when serving

    if checkpoint_dir:
        return checkpoint.read_metadata(checkpoint_dir).config
    return get_config(model or DEFAULT_MODEL)


def chosen_dtype(default: str, asked: str | None, platform: str) -> str:
    """The compute dtype an engine runs: ``asked``, else ``default`` (the model's); ``"auto"``
    as the plan decides. A bfloat16 that runs slower than float32 here is said in the log."""
    if asked == AUTO_DTYPE:
        dtype, why = auto_compute_dtype(default, platform, cpu_flags())
        if why:
            log.info("compute dtype: %s", why)
        return dtype
    dtype = asked or default
    if dtype == "bfloat16" and platform == "cpu" and cpu_bf16(cpu_flags()) is False:
        log.warning("compute dtype bfloat16 on a CPU without bf16 instructions: slower than "
                    "float32 here (--compute-dtype auto or float32 is faster and exact)")
    return dtype


def _platform(mesh: str | Mesh) -> str:
    return (mesh.devices.flat[0] if isinstance(mesh, Mesh) else jax.devices()[0]).platform


def auto_mesh(cfg: ViTConfig, devices: Sequence | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    data = auto_data_devices(
        cfg.compute_dtype, devices[0].platform, jax.process_count(), len(devices)
    )
    return make_mesh("auto", devices[:data])


LEVELS = np.dtype(np.uint8)  # the pixel contract's levels: the forward normalises them
NORMALISED = np.dtype(np.float32)  # normalised already (the contract's float32 values)


def pixel_dtype(dtype) -> np.dtype:
    """The input dtype a compiled forward takes: ``LEVELS`` or ``NORMALISED``, nothing else."""
    dtype = np.dtype(dtype)
    if dtype not in (LEVELS, NORMALISED):
        raise ValueError(f"the engine takes uint8 pixel levels or normalised float32 pixels, "
                         f"not {dtype}")
    return dtype


@dataclass(frozen=True)
class Placement:
    """A mesh with the engine's parameters on it, and the shardings a forward there takes."""

    mesh: Mesh
    params: dict
    param_shardings: dict
    batch_sharding: NamedSharding


class Executor(Protocol):
    def check(self) -> None:
        """Raise ``NotReady`` when no batch can run (a group that lost a process)."""

    def run(self, engine: Engine, bucket: int, outputs: OutputRequest, pixels: np.ndarray,
            active: int | None = None):
        """``pixels`` padded to ``bucket`` -> the forward's output tree on the host;
        ``active``: the chunk steps that hold images (``Engine.layout``; None: all)."""


class LocalExecutor:
    """One process: the bucket's placement, the compiled forward, the result to the host."""

    def check(self) -> None:
        pass

    def run(self, engine: Engine, bucket: int, outputs: OutputRequest, pixels: np.ndarray,
            active: int | None = None):
        place = engine.placement(bucket, engine.cfg.grid_at(*pixels.shape[1:3]))
        batch = jax.device_put(pixels, place.batch_sharding)
        return jax.tree.map(np.asarray, engine.call(bucket, outputs, place, batch, active))


class Engine:
    def __init__(
        self,
        cfg: ViTConfig,
        params: dict,
        mesh: Mesh,
        *,
        fingerprint: str,
        source: str,
        max_batch_images: int = 32,
        max_batch_patches: int = 0,
        max_compiled: int = 64,
        chunk_images: int | None = None,
        precast: bool = True,
        small_buckets: bool | None = None,
        executor: Executor | None = None,
        transpose_kernels: bool | None = None,
        mlp_slices: int | None = None,
        skip_padding: bool = True,
        midpoint_buckets: bool | None = None,
    ):
        """``chunk_images`` / ``small_buckets`` / ``max_batch_patches`` / ``transpose_kernels`` /
        ``mlp_slices`` / ``midpoint_buckets`` (``midpoints``): see ``Plan.make``.
        ``precast=False`` keeps the parameters as given (kernels then cast on every forward:
        for measurements only); ``skip_padding=False`` runs every chunk step of a bucket, the
        padding's too (``layout``; for measurements only)."""
        check_mesh_fits(cfg, mesh)
        self.cfg, self.mesh = cfg, mesh
        self.platform = mesh.devices.flat[0].platform
        self.plan = Plan.make(
            cfg,
            platform=self.platform,
            data=mesh.shape["data"],
            model=mesh.shape["model"],
            process_count=jax.process_count(),
            max_batch_images=max_batch_images,
            max_batch_patches=max_batch_patches,
            chunk_images=chunk_images,
            small_buckets=small_buckets,
            cpu_flags=cpu_flags() if self.platform == "cpu" else None,
            transpose_kernels=transpose_kernels,
            mlp_slices=mlp_slices,
            midpoints=midpoint_buckets,
        )
        self.executor: Executor = executor or LocalExecutor()
        self.skip_padding = skip_padding
        # The parameters count and fingerprint as given; the forward reads the pre-cast tree.
        self.parameter_count = count(params)
        self.param_shardings = param_shardings(cfg, mesh, params)
        params = cast_matmul_kernels(cfg, params) if precast else params
        # on a model axis of 1 (Plan.make's condition) every kernel's sharding is whole either way
        params = store_transposed(params, self.plan.transposed_kernels)
        self.params = jax.device_put(params, self.param_shardings)  # no copy when in place
        self.batch_sharding = batch_sharding(mesh)
        self.identity = ModelIdentity.of(cfg, fingerprint, source)
        self._placements: dict[int, Placement] = {
            mesh.shape["data"]: Placement(mesh, self.params, self.param_shardings,
                                          self.batch_sharding)
        }
        self._max_compiled = max_compiled
        # compiled forwards by (bucket, output set, grid, pixel dtype)
        self._compiled: OrderedDict[tuple, jax.stages.Compiled] = OrderedDict()
        self._used: dict[OutputRequest, float] = {}  # on-demand output set -> last use
        self._warm: dict[tuple, jax.stages.Compiled] = {}
        self._warm_outputs: set[OutputRequest] = set()  # their output sets: a look-up per call
        # Every call resolves its outputs; the same few sets, so remembered (bounded: a caller
        # may spell many).
        self._resolved = functools.lru_cache(maxsize=256)(lambda o: o.resolve(self.cfg))
        self._positions: dict[tuple[Grid, int], jax.Array | None] = {}  # (grid, rows) -> table
        self._lock = threading.Lock()
        self._pending: dict[tuple, Future] = {}
        self._failed: dict[tuple, Exception] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="vit22b-compile")
        self.compilations = 0  # on-demand compilations after warm-up (for metrics and tests)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        model: str | None = None,
        checkpoint_dir: str | None = None,
        mesh: str | Mesh = "auto",
        seed: int = 0,
        compute_dtype: str | None = None,
        verify: bool = True,
        **kwargs,
    ) -> Engine:
        """A checkpoint restored onto the mesh, or a preset with seeded random weights.

        With both, ``model`` is what the checkpoint must hold (refused if its architecture
        differs); the checkpoint's metadata names its source and fingerprint, which ``verify``
        checks against the weights read (the fingerprint every answer carries must be theirs).
        ``compute_dtype`` overrides the config's (float32: exact features); ``"auto"`` keeps
        it except on a CPU without bf16 instructions (``plan.auto_compute_dtype``).
        """
        from vit22b.model import checkpoint  # orbax: only when serving

        stored = stored_config(model, checkpoint_dir)
        dtype = chosen_dtype(stored.compute_dtype, compute_dtype, _platform(mesh))  # once

        def with_dtype(cfg: ViTConfig) -> ViTConfig:
            return cfg.replace(compute_dtype=dtype)

        if mesh == "auto":
            mesh = auto_mesh(with_dtype(stored))
        mesh = make_mesh(mesh) if isinstance(mesh, str) else mesh
        if checkpoint_dir:
            expect = get_config(model) if model else None
            cfg, params, meta = checkpoint.restore(checkpoint_dir, mesh, expect=expect,
                                                   verify=verify)
            return cls(with_dtype(cfg), params, mesh, fingerprint=meta.fingerprint,
                       source=meta.source, **kwargs)
        return cls.seeded(with_dtype(stored), mesh, seed, **kwargs)

    @classmethod
    def seeded(cls, cfg: ViTConfig, mesh: Mesh, seed: int, **kwargs) -> Engine:
        """``cfg`` with random weights from ``seed``: the same weights, and fingerprint, in
        every process and run."""
        from vit22b.model import checkpoint

        params = init_sharded(cfg, mesh, seed)
        return cls(cfg, params, mesh, fingerprint=checkpoint.fingerprint(params),
                   source=seeded_source(seed), **kwargs)

    @property
    def mesh_spec(self) -> str:
        return mesh_spec(self.mesh)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.plan.buckets

    @property
    def max_batch_images(self) -> int:
        return self.plan.max_batch_images

    def bucket(self, n: int) -> int:
        return self.plan.bucket(n)

    @property
    def grid(self) -> Grid:
        """The model's own grid (its square input)."""
        return self.cfg.grid, self.cfg.grid

    def max_images(self, grid: Grid) -> int:
        """Images of ``grid`` one batch may hold (``Plan.max_images``; 0: none fit)."""
        return self.plan.max_images(grid)

    def resolve(self, outputs: OutputRequest) -> OutputRequest:
        """The canonical output set for this model (see ``OutputRequest.resolve``)."""
        return self._resolved(outputs)

    # ---- compiled forwards -----------------------------------------------------------------
    def is_compiled(self, bucket: int, outputs: OutputRequest, grid: Grid | None = None,
                    pixels: np.dtype = LEVELS) -> bool:
        key = (bucket, outputs, tuple(grid or self.grid), pixel_dtype(pixels))
        with self._lock:
            return key in self._warm or key in self._compiled

    def has_forwards(self, outputs: OutputRequest, grid: Grid) -> bool:
        """Whether any bucket's forward for ``outputs`` at ``grid`` is compiled (or warm)."""
        grid = tuple(grid)
        with self._lock:
            return any(k[1] == outputs and k[2] == grid for k in (*self._warm, *self._compiled))

    def admit_outputs(self, outputs: OutputRequest, reserve: bool = True) -> None:
        """Refuse a new on-demand output set the cache cannot take without thrashing; with
        ``reserve`` False only check (a call checks before its images are decoded, and takes
        its place once one of them is: a call of undecodable images takes none)."""
        now = time.monotonic()
        with self._lock:
            if outputs in self._warm_outputs:
                return
            if outputs in self._used:
                if reserve:
                    self._used[outputs] = now
                return
            queued = {key[1] for key in self._pending}
            if len(queued) >= MAX_PENDING_COMPILES:
                raise CompileLimit(
                    f"{len(queued)} output sets are waiting to be compiled (the limit); retry "
                    "later, or ask for an output set the server has compiled already"
                )
            idle = [o for o, last in self._used.items() if now - last > CACHE_IDLE_S]
            if not reserve and (len(self._used) < self._max_output_sets or idle):
                return
            if len(self._used) >= self._max_output_sets and idle:  # make room: the stalest
                stalest = min(idle, key=self._used.__getitem__)
                del self._used[stalest]
                for key in [k for k in self._compiled if k[1] == stalest]:
                    del self._compiled[key]
            elif len(self._used) >= self._max_output_sets:
                free_in = CACHE_IDLE_S - (now - min(self._used.values()))
                raise CompileLimit(
                    f"the server holds compiled forwards for {len(self._used)} on-demand output "
                    f"sets, its limit (--max-compiled {self._max_compiled} forwards over "
                    f"{len(self.plan.buckets)} batch buckets), all used within "
                    f"{CACHE_IDLE_S:.0f}s; this request needs another (other patch layers or "
                    f"outputs): reuse a set, or retry in {math.ceil(free_in)}s, when the least "
                    "recently used one may make room",
                    retry_after_s=free_in,
                )
            self._used[outputs] = now

    @property
    def _max_output_sets(self) -> int:
        return max(1, self._max_compiled // len(self.plan.buckets))

    def compile_async(
        self,
        bucket: int,
        outputs: OutputRequest,
        grid: Grid | None = None,
        done: Callable[[], None] | None = None,
        pixels: np.dtype = LEVELS,
    ) -> Future:
        """Compile on the compile thread (at most one compile at a time); ``done`` after."""
        key = (bucket, outputs, tuple(grid or self.grid), pixel_dtype(pixels))
        with self._lock:
            future = self._pending.get(key)
            failed = self._failed.pop(key, None)
            if failed is not None:  # reported once to the jobs that waited; a later one retries
                future = Future()
                future.set_exception(failed)
            elif future is None:
                future = self._compiler.submit(self._compile_pending, key)
                self._pending[key] = future
        if done is not None:
            future.add_done_callback(lambda _: done())
        return future

    def _compile_pending(self, key: tuple) -> None:
        try:
            self.compiled(*key)
        except Exception as err:
            with self._lock:
                self._failed[key] = err
            raise
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def compiled(
        self, bucket: int, outputs: OutputRequest, grid: Grid | None = None,
        pixels: np.dtype = LEVELS, warm: bool = False,
    ):
        """The compiled forward for ``pixels`` images of ``grid`` (default: the model's own),
        compiled here, in this thread, when it is not cached yet; it takes (params, position
        table at the grid, images, active steps)."""
        grid, pixels = tuple(grid or self.grid), pixel_dtype(pixels)
        key = (bucket, outputs, grid, pixels)
        with self._lock:
            fn = self._warm.get(key) or self._compiled.get(key)
            if fn is not None:
                if key in self._compiled:
                    self._compiled.move_to_end(key)
                return fn
        start = time.perf_counter()
        fn = self._compile(bucket, outputs, grid, pixels)
        with self._lock:
            if warm:
                self._warm[key] = fn
                self._warm_outputs.add(outputs)
            else:
                self.compilations += 1
                self._compiled[key] = fn
                self._used.setdefault(outputs, time.monotonic())
                while len(self._compiled) > self._max_compiled:
                    (_, evicted, *_), _ = self._compiled.popitem(last=False)
                    if not any(k[1] == evicted for k in self._compiled):
                        self._used.pop(evicted, None)
        log.info(
            "compiled forward for bucket %d of %s at grid %dx%d (chunks of %d per shard), %s "
            "in %.2fs%s", bucket, pixels, *grid, self.plan.chunk_images(bucket, grid), outputs,
            time.perf_counter() - start,
            "" if warm else " (on demand)",
        )
        return fn

    def placement(self, bucket: int, grid: Grid | None = None) -> Placement:
        """Where a bucket of ``grid`` images runs: the mesh, or its first data rows
        (``Plan.rows``: small buckets, little work).

        A row's devices already hold the parameters (they are replicated over data): the
        smaller mesh's arrays are views of those buffers, not copies.
        """
        rows = self.plan.rows(bucket, grid)
        with self._lock:
            if rows not in self._placements:
                mesh = Mesh(self.mesh.devices[:rows], self.mesh.axis_names)
                shardings = jax.tree.map(
                    lambda s: NamedSharding(mesh, s.spec), self.param_shardings
                )
                params = jax.tree.map(_restrict, self.params, shardings)
                self._placements[rows] = Placement(mesh, params, shardings, batch_sharding(mesh))
            return self._placements[rows]

    def position(self, grid: Grid, place: Placement) -> jax.Array | None:
        """The learned position table at ``grid`` on ``place``'s mesh, resampled once per grid
        (``position_table``) and kept; None for sin-cos and RoPE (computed in the forward)."""
        rows = place.mesh.shape["data"]
        with self._lock:
            if (grid, rows) in self._positions:
                return self._positions[(grid, rows)]
        table = None
        if self.cfg.posemb == "learn":
            sharding = place.param_shardings["pos_embedding"]
            table = jax.jit(
                lambda t: position_table(self.cfg, {"pos_embedding": t}, grid),
                out_shardings=sharding,
            )(place.params["pos_embedding"])
        with self._lock:
            return self._positions.setdefault((grid, rows), table)

    def call(self, bucket: int, outputs: OutputRequest, place: Placement, batch: jax.Array,
             active: int | None = None):
        """The compiled forward on a placed batch (its grid from its shape); ``active``: run
        only the first that many chunk steps (``layout``; None: all of them)."""
        grid = self.cfg.grid_at(batch.shape[1], batch.shape[2])
        active = np.int32(self.steps(bucket, grid) if active is None else active)
        fn = self.compiled(bucket, outputs, grid, batch.dtype)
        return fn(place.params, self.position(grid, place), batch, active)

    def execution(self, bucket: int, grid: Grid | None = None) -> Execution:
        """How the plan runs this bucket's forward at ``grid`` (``vit.Execution``)."""
        plan = self.plan
        return Execution(plan.fold_heads, plan.transposed_kernels, plan.mlp_slices(bucket, grid))

    def steps(self, bucket: int, grid: Grid | None = None) -> int:
        """Sequential chunk steps in a forward of ``bucket`` at ``grid``."""
        grid = grid or self.grid
        return bucket // (self.plan.rows(bucket, grid) * self.plan.chunk_images(bucket, grid))

    def layout(self, n: int, bucket: int, grid: Grid | None = None) -> tuple[np.ndarray, int]:
        """Where ``n`` images go in a batch of ``bucket`` rows, and the chunk steps they need.

        Each data row (shard) holds a contiguous block of the batch and runs it in steps of
        ``chunk`` images. The images fill every shard's leading rows evenly, so the steps that
        hold padding alone run on no shard and are skipped: 17 images in ViT-B/16's bucket of
        32 (2 shards of 16, steps of 4) take 3 steps instead of 4. Returns the rows (the i-th
        image's row) and the steps to run."""
        grid = grid or self.grid
        steps = self.steps(bucket, grid)
        if not self.skip_padding or steps == 1:
            return np.arange(n), steps
        shards = self.plan.rows(bucket, grid)
        local, per = bucket // shards, -(-n // shards)
        rows = np.concatenate([k * local + np.arange(min(per, n - k * per))
                               for k in range(shards) if k * per < n])
        return rows, self.plan.active_steps(n, bucket, grid)

    def _compile(self, bucket: int, outputs: OutputRequest, grid: Grid, pixels: np.dtype):
        options = self.plan.compiler_options or None
        return self.lowered(bucket, outputs, grid, pixels).compile(compiler_options=options)

    def lowered(self, bucket: int, outputs: OutputRequest, grid: Grid,
                pixels: np.dtype = LEVELS):
        """The forward for a bucket of ``pixels`` images at ``grid``, lowered and not yet
        compiled (what ``compiled`` compiles; benchmarks compile it under other XLA options)."""
        cfg, place, pixels = self.cfg, self.placement(bucket, grid), pixel_dtype(pixels)
        levels = level_table(cfg.preprocess) if pixels == LEVELS else None
        chunk, shards = self.plan.chunk_images(bucket, grid), place.mesh.shape["data"]
        pos = self.position(grid, place)
        execution = self.execution(bucket, grid)
        fn = jax.jit(
            lambda params, pos, images, active: chunked_apply(
                cfg, params, images, outputs, chunk, shards, pos, execution, active, levels
            ),
            in_shardings=(
                place.param_shardings,
                None if pos is None else place.param_shardings["pos_embedding"],
                place.batch_sharding,
                None,
            ),
        )
        shape = (bucket, grid[0] * cfg.patch, grid[1] * cfg.patch, cfg.channels)
        images = jax.ShapeDtypeStruct(shape, pixels, sharding=place.batch_sharding)
        return fn.lower(place.params, pos, images, jax.ShapeDtypeStruct((), np.int32))

    def warm_up(
        self, output_sets: Sequence[OutputRequest] = (POOLED,), grids: Sequence[Grid] = (),
        pixels: np.dtype = LEVELS,
    ) -> float:
        """Compile every bucket a grid allows for each output set at each grid (default: the
        model's own), for ``pixels`` images (default: the serving path's levels); returns the
        seconds it took."""
        start = time.perf_counter()
        for grid in grids or (self.grid,):
            for outputs in output_sets:
                resolved = self.resolve(outputs)
                for size in self.plan.buckets_for(grid):
                    self.compiled(size, resolved, grid, pixels, warm=True)
        return time.perf_counter() - start

    # ---- running ---------------------------------------------------------------------------
    def forward(self, images: np.ndarray, outputs: OutputRequest) -> Features:
        """uint8 pixel levels or normalised float32 pixels [n, H, W, 3] (H, W multiples of the
        patch; n <= the grid's ``max_images``) -> host float32 outputs for n rows.

        ``outputs`` must be resolved (see ``resolve``).
        """
        n = images.shape[0]
        size = self.plan.bucket(n)
        rows, active = self.layout(n, size, self.cfg.grid_at(*images.shape[1:3]))
        pixels = aligned_empty((size, *images.shape[1:]), pixel_dtype(images.dtype))
        if n == 0 or rows[-1] == n - 1:  # the images in the leading rows, in order
            pixels[:n] = images
            pixels[n:] = 0
            rows = slice(0, n)
        else:
            pixels[:] = 0
            pixels[rows] = images
        tree = self.executor.run(self, size, outputs, pixels, active)
        return Features.from_tree(tree).take(rows)

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype = NORMALISED,
                  align: int = HOST_ALIGN) -> np.ndarray:
    """An uninitialised host array whose data starts on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


def _restrict(leaf: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``leaf`` on a sub-mesh of its own: the buffers its devices already hold."""
    devices = sharding.mesh.devices.flat
    shards = {s.device: s.data for s in leaf.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        leaf.shape, sharding, [shards[d] for d in devices]
    )
