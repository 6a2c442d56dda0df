"""`vit22b embed --local`: the job's batches through the server's own facade, in process (jax).

The one allowed edge from ``clients/`` into ``server/``: ``LocalInfer`` (server/infer.py) runs
the facade on a private event loop, so local and served features of one checkpoint come from the
same decoding, batching and finishing. ``concurrency`` worker threads read files while the
facade computes; each batch is a ``solo`` call (never packed with another worker's), so results
do not depend on which worker ran a batch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from vit22b.server.cpu_devices import prefer_wide_vectors

prefer_wide_vectors()  # the server's XLA:CPU codegen setting, before jax starts (if not already)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from vit22b.model.compile_cache import use_compile_cache  # noqa: E402
from vit22b.model.config import ViTConfig  # noqa: E402
from vit22b.model.errors import InvalidImage, InvalidRequest  # noqa: E402
from vit22b.model.features import Features  # noqa: E402
from vit22b.model.identity import ModelIdentity  # noqa: E402
from vit22b.model.outputs import OutputRequest  # noqa: E402
from vit22b.model.pixels import (  # noqa: E402
    DEFAULT_MAX_IMAGE_PIXELS,
    Geometry,
    check_pixels,
    decode,
)
from vit22b.server.engine import (  # noqa: E402
    AUTO_DTYPE,
    Engine,
    auto_mesh,
    chosen_dtype,
    stored_config,
)
from vit22b.server.infer import ImageInput, LocalInfer  # noqa: E402

from .embed import (  # noqa: E402
    BatchResult,
    OutputSpec,
    dense_bound,
    dense_rows,
    embed_files,
    stored_arrays,
)
from .embed_inputs import InputItem  # noqa: E402
from .inputs import with_ids  # noqa: E402


class LocalWorker:
    def __init__(self, local: LocalInfer, spec: OutputSpec, geometry: Geometry, name: str):
        self.local, self.spec, self.geometry, self.name = local, spec, geometry, name

    def embed(self, items: Sequence[InputItem]) -> BatchResult:
        return embed_files(self, items)

    def embed_images(self, images: Sequence[bytes | np.ndarray]) -> BatchResult:
        if self.geometry.dense:
            return self._embed_dense(images)
        return self._embed(images, list(range(len(images))))

    def _embed(self, images: Sequence[bytes | np.ndarray | ImageInput],
               positions: list[int]) -> BatchResult:
        """One solo call (its batches are its own: bit-exact resumes); rows at ``positions``."""
        result = self.local.embed(
            [im if isinstance(im, ImageInput) else ImageInput(im) for im in images],
            self.spec.request, l2_normalize=self.spec.l2_normalize, skip_invalid=True,
            solo=True, geometry=self.geometry,
        )
        arrays = stored_arrays(result.features, self.spec)
        if self.geometry.dense and result.indices:
            arrays = dense_rows(arrays, result.grid, self.geometry.max_patches)
        failed = sorted((positions[e.index], e.reason) for e in result.errors)
        return BatchResult([positions[i] for i in result.indices], arrays, failed)

    def _embed_dense(self, images: Sequence[bytes | np.ndarray]) -> BatchResult:
        """Decoded here by the contract's own decoder, grouped by patch grid, a solo call per
        grid: the facade then sees raw pixels of one grid, exactly what it would decode."""
        infer = self.local.infer
        pre, limit = infer.preprocessor(self.geometry), infer.limits.max_image_pixels
        groups, failed = defaultdict(list), []
        for position, image in enumerate(images):
            try:
                pixels = (check_pixels(image, limit) if isinstance(image, np.ndarray) else
                          decode(bytes(image), limit, pre.min_side))
            except InvalidImage as err:
                failed.append((position, err.reason))
                continue
            size = self.geometry.size(self.local.engine.cfg, *pixels.shape[:2])
            groups[size].append((position, pixels))
        parts = [self._embed([ImageInput(px) for _, px in group], [p for p, _ in group])
                 for group in groups.values()]
        return BatchResult.joined([*parts, BatchResult([], {}, failed)])


class LocalBackend:
    """One engine (a checkpoint, or a preset with seeded weights) on a mesh of local devices."""

    def __init__(
        self,
        spec: OutputSpec,
        *,
        model: str | None = None,
        checkpoint: str | None = None,
        mesh: str = "auto",
        seed: int = 0,
        compute_dtype: str | None = AUTO_DTYPE,
        batch_size: int = 32,
        concurrency: int = 2,
        engine: Engine | None = None,
        max_image_pixels: int = 0,
        compile_cache: str | None = None,
    ):
        """``compute_dtype``: as `vit22b embed --local`'s (``auto`` by default; None: the
        model's own on every host); ``max_image_pixels``: the decoded-size guard (0: the
        server's default); ``compile_cache``: JAX's persistent compilation cache folder, as
        `vit22b serve --compile-cache` ('off': none; None: as this process has JAX's cache,
        off unless turned on)."""
        if engine is None:
            use_compile_cache(compile_cache)
        self.engine = engine or Engine.load(
            model, checkpoint, mesh, seed=seed, compute_dtype=compute_dtype,
            max_batch_images=batch_size,
            max_batch_patches=in_process_patch_budget(stored_config(model, checkpoint),
                                                      batch_size),
        )
        self.model = self.engine.identity
        self.spec = spec
        self.request = self.engine.resolve(spec.request)
        self.concurrency = max(1, concurrency)
        cfg = self.engine.cfg
        size = spec.resolution or cfg.image_size
        self.geometry = spec.geometry(dense_bound(cfg, spec))
        if self.geometry.dense:
            check_fits(self.engine, (1, self.geometry.max_patches),
                       f"--max-dense-patches {spec.max_dense_patches}" if spec.max_dense_patches
                       else f"--dense at --resolution {size} (up to twice its square grid)")
        else:
            check_fits(self.engine, (size // cfg.patch,) * 2, f"--resolution {size}")
        if spec.resolution or spec.dense:
            self.model = self.model.at(cfg, self.geometry)
        self.max_image_pixels = max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS
        self.local = LocalInfer(self.engine, resolutions=(size,),
                                max_dense_patches=self.geometry.max_patches,
                                max_image_pixels=self.max_image_pixels)

    def warm_up(self) -> None:
        """Compile a full batch's forward before the clock (and the progress bar) starts; a
        shorter batch's bucket (the last, or one with refused images) compiles when it first
        comes, as each dense grid does, so a small job compiles only the buckets it uses."""
        if not self.geometry.dense:
            size = self.geometry.resolution or self.engine.cfg.image_size
            grid = self.engine.cfg.grid_at(size, size)
            full = self.engine.plan.buckets_for(grid)[-1]
            self.engine.compiled(full, self.request, grid, warm=True)

    def workers(self) -> list[LocalWorker]:
        return [LocalWorker(self.local, self.spec, self.geometry, f"local-{i}")
                for i in range(self.concurrency)]

    def close(self) -> None:
        self.local.close()


def in_process_patch_budget(cfg: ViTConfig, batch_size: int) -> int:
    """The in-process engine's batch budget in patches: a full batch at 4x the model's side;
    larger inputs run in smaller batches, and one image over the whole budget is refused (a
    caller's resolution is not an operator's allowlist, as a server's is)."""
    rows, cols = cfg.grid_at(cfg.image_size, cfg.image_size)
    return batch_size * 16 * rows * cols


def check_fits(engine: Engine, grid: tuple[int, int], what: str) -> None:
    """Refuse, before any image is resized to it, a grid one batch of the in-process engine
    cannot hold (``in_process_patch_budget``)."""
    if not engine.max_images(grid):
        budget = engine.plan.max_batch_patches
        raise InvalidRequest(
            f"{what}: {grid[0] * grid[1]} patches an image do not fit the in-process engine's "
            f"batch budget of {budget} patches (a square input of at most "
            f"{math.isqrt(budget) * engine.cfg.patch} pixels)")


def in_process_config(cfg: ViTConfig) -> ViTConfig:
    """``cfg`` computing in the dtype ``auto`` resolves to here, as `vit22b serve` and
    `vit22b embed --local` do by default (float32 in place of bfloat16 on a CPU without bf16
    instructions): in-process and served features of one model are then computed alike."""
    dtype = chosen_dtype(cfg.compute_dtype, AUTO_DTYPE, jax.devices()[0].platform)
    return cfg.replace(compute_dtype=dtype)


@functools.lru_cache(maxsize=4)
def seeded_engine(cfg: ViTConfig, seed: int, batch_size: int) -> Engine:
    """A preset or config with seeded weights on the auto mesh (kept: probes ask again)."""
    return Engine.seeded(cfg, auto_mesh(cfg), seed, max_batch_images=batch_size,
                         max_batch_patches=in_process_patch_budget(cfg, batch_size))


IN_PROCESS_CHUNK = 1024  # images read and decoded at a time: a folder's files are not all held


def features_in_process(
    cfg: ViTConfig,
    images: Iterable,
    outputs: OutputRequest,
    *,
    params: dict | None = None,
    seed: int = 0,
    batch_size: int = 32,
    resolution: int = 0,
    ids: Iterable[str] | None = None,
) -> tuple[Features, ModelIdentity]:
    """Features of uint8 images or encoded bytes through the facade, in process, and the
    identity of what made them (at the geometry): the probes' path without a server. Random
    weights from ``seed`` unless ``params`` are given; ``resolution``: the square input size
    (0: the model's own); ``ids``: one per image, named with its index when it cannot be used
    (a file's path, say). ``images`` may be an iterator (files read as they are needed): at
    most ``IN_PROCESS_CHUNK`` of them are held at once. The compute dtype is the config's as
    ``auto`` resolves it (``in_process_config``)."""
    cfg = in_process_config(cfg)
    if params is None:
        engine = seeded_engine(cfg, seed, batch_size)
    else:
        from vit22b.model import checkpoint
        from vit22b.model.sharding import shard_params

        mesh = auto_mesh(cfg)
        engine = Engine(cfg, shard_params(cfg, params, mesh), mesh,
                        fingerprint=checkpoint.fingerprint(params), source="in-process",
                        max_batch_images=batch_size,
                        max_batch_patches=in_process_patch_budget(cfg, batch_size))
    size = resolution or cfg.image_size
    check_fits(engine, (size // cfg.patch,) * 2, f"{cfg.name}: resolution {size}")
    request, parts, offset = engine.resolve(outputs), [], 0
    if ids is not None:  # one id per image, checked as they go
        images = (ImageInput(image, id=i) for _, image, i in with_ids(images, ids))
    images = iter(images)
    with LocalInfer(engine, resolutions=(size,)) as local:
        while chunk := list(itertools.islice(images, IN_PROCESS_CHUNK)):
            try:
                parts.append(local.embed(chunk, request, geometry=Geometry(size)).features)
            except InvalidImage as err:  # named by its place in the whole input
                raise err.shifted(offset) from None
            offset += len(chunk)
    if not parts:
        raise InvalidRequest("no images to embed")
    return Features.concat(parts), engine.identity.at(cfg, Geometry(size))
