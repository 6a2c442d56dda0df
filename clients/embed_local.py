"""`vit22b embed --local`: the job's batches through the in-process engine (needs jax).

Decoding and preprocessing are the server's own (server/preprocess.py via the engine), so local
and remote features of one checkpoint come from the same pixels. ``concurrency`` worker threads
share one engine: while one runs a forward (XLA releases the GIL), another reads and decodes
the next batch. Forwards take turns (one lock): XLA already spreads one over every core, and
two at once only compete for them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from vit22b.model import OutputRequest
from vit22b.model.errors import InvalidImage
from vit22b.server.engine import Engine, concat, finish

from .embed import BatchResult, ModelRef, OutputSpec, os_reason, read_file, to_stored
from .embed_inputs import InputItem
from .outputs import array_name


def model_ref(engine: Engine) -> ModelRef:
    cfg, identity = engine.cfg, engine.identity
    return ModelRef(
        name=identity.name,
        fingerprint=identity.fingerprint,
        preprocess_hash=identity.preprocess_hash,
        source=identity.source,
        width=cfg.width,
        depth=cfg.depth,
        num_patches=cfg.num_patches,
        has_class_token=cfg.class_token,
        has_pooled=cfg.head != "none",
    )


def stored_arrays(features: dict, spec: OutputSpec) -> dict[str, np.ndarray]:
    """The engine's output dict -> stored array name -> array in the output dtype."""
    arrays = {name: to_stored(features[name], spec.dtype)
              for name in ("pooled", "class_token") if name in features}
    for layer, tokens in features.get("patch_tokens", {}).items():
        arrays[array_name("patch_tokens", int(layer))] = to_stored(tokens, spec.dtype)
    return arrays


class LocalWorker:
    def __init__(self, engine: Engine, request: OutputRequest, spec: OutputSpec, name: str,
                 compute: threading.Lock):
        self.engine, self.request, self.spec, self.name = engine, request, spec, name
        self.compute = compute

    def embed(self, items: Sequence[InputItem]) -> BatchResult:
        rows, pixels, failed = [], [], []
        for position, item in enumerate(items):
            try:
                pixels.append(self.engine.preprocess.load(read_file(item)))
                rows.append(position)
            except OSError as err:
                failed.append((position, os_reason(err)))
            except InvalidImage as err:
                failed.append((position, err.reason))
        if not rows:
            return BatchResult([], {}, failed)
        batch, step = np.stack(pixels), self.engine.max_batch_images
        with self.compute:
            parts = [self.engine.forward(batch[i : i + step], self.request)
                     for i in range(0, len(batch), step)]
        features = finish(concat(parts), self.spec.l2_normalize)
        return BatchResult(rows, stored_arrays(features, self.spec), failed)


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
        batch_size: int = 32,
        concurrency: int = 2,
        engine: Engine | None = None,
    ):
        self.engine = engine or Engine.load(
            model, checkpoint, mesh, seed=seed, max_batch_images=batch_size
        )
        self.model = model_ref(self.engine)
        self.spec = spec
        self.request = self.engine.resolve(
            OutputRequest(
                pooled=spec.pooled,
                class_token=spec.class_token,
                patch_layers=spec.patch_layers,
                norm_patches=spec.normalize_patches,
            )
        )
        self.concurrency = max(1, concurrency)

    def warm_up(self) -> None:
        """Compile every batch bucket before the clock (and the progress bar) starts."""
        self.engine.warm_up([self.request])

    def workers(self) -> list[LocalWorker]:
        compute = threading.Lock()
        return [LocalWorker(self.engine, self.request, self.spec, f"local-{i}", compute)
                for i in range(self.concurrency)]

    def close(self) -> None:
        pass
