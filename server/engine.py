"""The engine: parameters on a mesh and one compiled forward per (batch bucket, output set).

Batch buckets are the mesh's data-axis size times powers of two, up to ``max_batch_images``
(rounded up to a multiple of the data axis), and on a single-process CPU host also the powers of
two below the data axis (run on that many of its rows); a batch is padded with zeros to the
smallest bucket that holds it. The warm output sets (by default: pooled features) are compiled for
every bucket before the server reports SERVING. Any other output set (patch tokens at chosen
layers, attention statistics, ...) is compiled on its first use for the bucket it needs, in the
batcher's thread, and kept (an LRU of ``max_compiled`` entries besides the warm ones, which stay):
compiling every combination of layers up front is impossible, and one superset forward returning
every layer would hold batch x depth x tokens x width activations per device (about 10 GB for
ViT-22B at batch 32). ``vit22b serve --warm-outputs`` compiles more sets up front.

``forward`` is the model's own ``apply``; ``embed`` is the in-process path (decode, preprocess,
forward, finish) that the server's results are checked against.

Execution plan (chosen from the backend, the compute dtype and the bucket; never changes a row's
arithmetic; measured in benchmarks/NOTES.md):
- matmul kernels are cast to the compute dtype once, at construction (``precast``), instead of
  on every forward;
- on CPU, a bucket runs in sequential chunks whose activations stay within ``CPU_CHUNK_BYTES``
  per data shard (``chunk_images`` overrides: 0 = never);
- ``mesh="auto"`` on a CPU host puts ``CPU_DATA_PARALLEL[dtype]`` devices on the data axis (the
  server's CLI asks XLA for that many emulated CPU devices, see ``cpu_devices``);
- on such a host a batch smaller than the data axis runs on fewer devices (``small_buckets``):
  emulated devices share the cores, so one image on one device gets them all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from vit22b.model import DEFAULT_MODEL, OutputRequest, ViTConfig, get_config
from vit22b.model.errors import InvalidRequest
from vit22b.model.forward import cast_matmul_kernels, chunked_apply
from vit22b.model.info import count
from vit22b.model.pixels import DEFAULT_MAX_IMAGE_PIXELS, Preprocessor
from vit22b.model.sharding import (
    batch_sharding,
    check_mesh_fits,
    init_sharded,
    make_mesh,
    mesh_spec,
    param_shardings,
)

log = logging.getLogger(__name__)

POOLED = OutputRequest()  # the default output set
Features = dict  # output name -> np.ndarray; "patch_tokens" -> {layer: np.ndarray}


@dataclass(frozen=True)
class Identity:
    """What made a feature: the model, its parameters and its preprocessing."""

    name: str
    fingerprint: str
    preprocess_hash: str
    source: str


def batch_buckets(max_batch_images: int, data_size: int) -> tuple[int, ...]:
    """data_size * 2^k below the maximum, then the maximum rounded up to a multiple of data."""
    if max_batch_images < 1:
        raise ValueError(f"max_batch_images must be positive, got {max_batch_images}")
    top = -(-max_batch_images // data_size) * data_size
    buckets, size = [], data_size
    while size < top:
        buckets.append(size)
        size *= 2
    return (*buckets, top)


def seeded_source(seed: int) -> str:
    return f"init:seed={seed}"


# CPU plan, measured on a 2-core host with a 32 MB L3 (benchmarks/NOTES.md). A step's widest
# activation (f32, tokens x the MLP hidden, plus q/k/v in a parallel block) is kept to about a
# third of the L3: ViT-B/16 runs 4 images per device and step (f32: 10.7 img/s against 8.3 for
# the whole batch of 32; bf16: YNNPACK's GEMM also loses a third of its speed at 6304 rows).
CPU_CHUNK_BYTES = 10 << 20
# Emulated CPU devices on the data axis that ``mesh="auto"`` uses (cpu_devices asks for them).
CPU_DATA_PARALLEL = {"bfloat16": 2, "float32": 2}


def step_bytes_per_image(cfg: ViTConfig) -> int:
    """Bytes of the widest f32 activation of one image in a block (what a chunk bounds)."""
    width = cfg.mlp_dim + (3 * cfg.width if cfg.block == "parallel" else 0)
    return 4 * cfg.num_tokens * width


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` not above ``limit`` (at least 1)."""
    return max(d for d in range(1, max(min(n, limit), 1) + 1) if n % d == 0)


def chunk_images(
    cfg: ViTConfig, platform: str, local_batch: int, override: int | None = None
) -> int:
    """Images per data shard in one sequential step of a bucket (``local_batch``: no chunks).

    ``override``: at most that many images per step (0: no chunking); None: the platform's plan.
    """
    if override is not None:
        return local_batch if override == 0 else largest_divisor(local_batch, override)
    if platform != "cpu":
        return local_batch
    return largest_divisor(local_batch, CPU_CHUNK_BYTES // step_bytes_per_image(cfg))


def auto_mesh(cfg: ViTConfig, devices: Sequence | None = None) -> Mesh:
    """``mesh="auto"``: every device on data, except on a single CPU host, where the data axis
    takes ``CPU_DATA_PARALLEL[dtype]`` of its (emulated) devices."""
    devices = list(jax.devices() if devices is None else devices)
    if devices[0].platform == "cpu" and jax.process_count() == 1:
        devices = devices[: CPU_DATA_PARALLEL.get(cfg.compute_dtype, len(devices))]
    return make_mesh("auto", devices)


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
        max_compiled: int = 64,
        chunk_images: int | None = None,
        precast: bool = True,
        small_buckets: bool | None = None,
    ):
        """``chunk_images``: at most this many images per data shard in one sequential step
        (0: whole buckets; None: the platform's plan). ``precast=False`` keeps the parameters
        as given (the kernels are then cast on every forward: for measurements only).
        ``small_buckets``: batches smaller than the data axis run on as many of its rows (one
        image each) instead of being padded to all of them; None: on a single-process CPU host,
        where emulated devices share the cores (a lone image then gets them all)."""
        check_mesh_fits(cfg, mesh)
        if chunk_images is not None and chunk_images < 0:
            raise ValueError(f"chunk_images must be >= 0, got {chunk_images}")
        self.cfg, self.mesh = cfg, mesh
        # The parameters count and fingerprint as given; the forward reads the pre-cast tree.
        self._param_shardings = param_shardings(cfg, mesh, params)
        params = cast_matmul_kernels(cfg, params) if precast else params
        self.params = jax.device_put(params, self._param_shardings)  # no copy when in place
        self._batch_sharding = batch_sharding(mesh)
        self.platform = mesh.devices.flat[0].platform
        self._chunk_override = chunk_images
        self.preprocess = Preprocessor(cfg)
        self.identity = Identity(cfg.name, fingerprint, cfg.preprocess_hash(), source)
        data = mesh.shape["data"]
        if small_buckets is None:
            small_buckets = self.platform == "cpu" and jax.process_count() == 1
        small = tuple(1 << k for k in range(data.bit_length()) if 1 << k < data)
        self.buckets = (small if small_buckets else ()) + batch_buckets(max_batch_images, data)
        self.max_batch_images = self.buckets[-1]
        self._placements: dict[int, Placement] = {
            data: Placement(mesh, self.params, self._param_shardings, self._batch_sharding)
        }
        self.parameter_count = count(params)
        self._max_compiled = max_compiled
        self._compiled: OrderedDict[tuple[int, OutputRequest], jax.stages.Compiled] = OrderedDict()
        self._warm: dict[tuple[int, OutputRequest], jax.stages.Compiled] = {}
        self._compile_lock = threading.Lock()
        self.compilations = 0  # on-demand compilations after warm-up (for metrics and tests)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        model: str | None = None,
        checkpoint_dir: str | None = None,
        mesh: str | Mesh = "auto",
        seed: int = 0,
        **kwargs,
    ) -> Engine:
        """A checkpoint restored onto the mesh, or a preset with seeded random weights.

        With both, ``model`` is what the checkpoint must hold (refused if its architecture
        differs); the checkpoint's metadata names its source and fingerprint.
        """
        from vit22b.model import checkpoint  # orbax: only when serving

        if mesh == "auto":
            config = checkpoint.read_metadata(checkpoint_dir).config if checkpoint_dir else None
            mesh = auto_mesh(config or get_config(model or DEFAULT_MODEL))
        mesh = make_mesh(mesh) if isinstance(mesh, str) else mesh
        if checkpoint_dir:
            expect = get_config(model) if model else None
            cfg, params, meta = checkpoint.restore(checkpoint_dir, mesh, expect=expect)
            return cls(cfg, params, mesh, fingerprint=meta.fingerprint, source=meta.source,
                       **kwargs)
        cfg = get_config(model or DEFAULT_MODEL)
        params = init_sharded(cfg, mesh, seed)
        fingerprint = checkpoint.fingerprint(params)
        return cls(cfg, params, mesh, fingerprint=fingerprint, source=seeded_source(seed),
                   **kwargs)

    @property
    def mesh_spec(self) -> str:
        return mesh_spec(self.mesh)

    # ---- outputs ---------------------------------------------------------------------------
    def resolve(self, outputs: OutputRequest) -> OutputRequest:
        """The canonical output set (layers non-negative, sorted): the compile-cache key.

        Raises ``InvalidRequest`` for layers out of range or outputs this model lacks.
        """
        cfg = self.cfg
        try:
            layers = outputs.layers(cfg.depth)
        except ValueError as err:
            raise InvalidRequest(str(err)) from None
        if outputs.class_token and not cfg.class_token:
            raise InvalidRequest(f"model {cfg.name} has no class token")
        if outputs.pooled and cfg.head == "none":
            raise InvalidRequest(f"model {cfg.name} has no pooling head")
        if outputs.logits and not cfg.num_classes:
            raise InvalidRequest(f"model {cfg.name} has no classifier (no logits)")
        if not (outputs.pooled or outputs.class_token or layers or outputs.attention_stats):
            if not outputs.logits:
                raise InvalidRequest("no outputs requested")
        return replace(outputs, patch_layers=layers)

    # ---- compiled forwards -----------------------------------------------------------------
    def bucket(self, n: int) -> int:
        for size in self.buckets:
            if n <= size:
                return size
        raise ValueError(f"batch of {n} images exceeds the largest bucket {self.buckets[-1]}")

    def compiled(self, bucket: int, outputs: OutputRequest, warm: bool = False):
        key = (bucket, outputs)
        with self._compile_lock:
            fn = self._warm.get(key) or self._compiled.get(key)
            if fn is not None:
                if key in self._compiled:
                    self._compiled.move_to_end(key)
                return fn
            start = time.perf_counter()
            fn = self._compile(bucket, outputs)
            if warm:
                self._warm[key] = fn
            else:
                self.compilations += 1
                self._compiled[key] = fn
                while len(self._compiled) > self._max_compiled:
                    self._compiled.popitem(last=False)
            log.info(
                "compiled forward for bucket %d (chunks of %d per shard), %s in %.2fs%s",
                bucket,
                self.chunk_images(bucket),
                outputs,
                time.perf_counter() - start,
                "" if warm else " (on demand)",
            )
            return fn

    def placement(self, bucket: int) -> Placement:
        """Where a bucket runs: the mesh, or its first ``bucket`` data rows (small buckets).

        A row's devices already hold the parameters (they are replicated over data): the
        smaller mesh's arrays are views of those buffers, not copies.
        """
        rows = min(bucket, self.mesh.shape["data"])
        if rows not in self._placements:
            mesh = Mesh(self.mesh.devices[:rows], self.mesh.axis_names)
            shardings = jax.tree.map(lambda s: NamedSharding(mesh, s.spec), self._param_shardings)
            params = jax.tree.map(_restrict, self.params, shardings)
            self._placements[rows] = Placement(mesh, params, shardings, batch_sharding(mesh))
        return self._placements[rows]

    def chunk_images(self, bucket: int) -> int:
        """Images per data shard in each sequential step of this bucket's forward."""
        local = bucket // self.placement(bucket).mesh.shape["data"]
        return chunk_images(self.cfg, self.platform, local, self._chunk_override)

    def _compile(self, bucket: int, outputs: OutputRequest):
        cfg, place, chunk = self.cfg, self.placement(bucket), self.chunk_images(bucket)
        shards = place.mesh.shape["data"]
        fn = jax.jit(
            lambda params, images: chunked_apply(cfg, params, images, outputs, chunk, shards),
            in_shardings=(place.param_shardings, place.batch_sharding),
        )
        shape = (bucket, cfg.image_size, cfg.image_size, cfg.channels)
        images = jax.ShapeDtypeStruct(shape, np.float32, sharding=place.batch_sharding)
        return fn.lower(place.params, images).compile()

    def warm_up(self, output_sets: Sequence[OutputRequest] = (POOLED,)) -> float:
        """Compile every bucket for each output set; returns the seconds it took."""
        start = time.perf_counter()
        for outputs in output_sets:
            resolved = self.resolve(outputs)
            for size in self.buckets:
                self.compiled(size, resolved, warm=True)
        return time.perf_counter() - start

    def forward(self, images: np.ndarray, outputs: OutputRequest) -> Features:
        """Normalised float32 [n, S, S, 3] (n <= max batch) -> host float32 outputs for n rows.

        ``outputs`` must be resolved (see ``resolve``).
        """
        n = images.shape[0]
        size = self.bucket(n)
        if size != n:
            pad = np.zeros((size - n, *images.shape[1:]), np.float32)
            images = np.concatenate([images, pad])
        place = self.placement(size)
        batch = jax.device_put(np.asarray(images, np.float32), place.batch_sharding)
        result = self.compiled(size, outputs)(place.params, batch)
        return _to_host(result, n)

    # ---- in-process embedding ---------------------------------------------------------------
    def embed(
        self,
        images: Sequence[bytes | np.ndarray],
        outputs: OutputRequest = POOLED,
        *,
        l2_normalize: bool = False,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> Features:
        """Encoded bytes or raw uint8 [H, W, 3] images -> float32 outputs, in order.

        The same preprocessing, forward and finishing as the server, batch by batch.
        """
        outputs = self.resolve(outputs)
        pixels = np.stack([self.preprocess.load(image, max_pixels) for image in images])
        step = self.max_batch_images
        parts = [self.forward(pixels[i : i + step], outputs) for i in range(0, len(pixels), step)]
        return finish(concat(parts), l2_normalize)


@dataclass(frozen=True)
class Placement:
    """A mesh with the engine's parameters on it, and the shardings a forward there takes."""

    mesh: Mesh
    params: dict
    param_shardings: dict
    batch_sharding: NamedSharding


def _restrict(leaf: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``leaf`` on a sub-mesh of its own: the buffers its devices already hold."""
    devices = sharding.mesh.devices.flat
    shards = {s.device: s.data for s in leaf.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        leaf.shape, sharding, [shards[d] for d in devices]
    )


def _to_host(tree, n: int):
    if isinstance(tree, dict):
        return {key: _to_host(value, n) for key, value in tree.items()}
    return np.asarray(tree)[:n]


def concat(parts: Sequence[Features]) -> Features:
    """Row-wise concatenation of several batches' outputs (same keys)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    return {
        key: concat([p[key] for p in parts])
        if isinstance(value, dict)
        else np.concatenate([p[key] for p in parts])
        for key, value in first.items()
    }


def take(features: Features, start: int, stop: int) -> Features:
    """Rows ``start:stop`` of every output."""
    return {
        key: take(value, start, stop) if isinstance(value, dict) else value[start:stop]
        for key, value in features.items()
    }


def finish(features: Features, l2_normalize: bool) -> Features:
    """Per-request finishing on the host: optional L2 normalisation of pooled features."""
    if l2_normalize and "pooled" in features:
        pooled = features["pooled"]
        norm = np.linalg.norm(pooled, axis=-1, keepdims=True)
        features = {**features, "pooled": pooled / np.maximum(norm, np.float32(1e-12))}
    return features
