"""`vit22b embed --server ADDR ...`: the job's batches through one or more feature servers.

One SDK client per address, ``concurrency`` workers each. Files are read here and sent as
bytes with ``skip_invalid_images``: the server decodes them and reports each bad one (with the
decoder's reason) instead of failing the request, so a bad image costs nothing to the good ones
next to it. A server that stays UNAVAILABLE (or unreachable) through the SDK's retries, or
starts serving another model, is dropped: its batch goes back to the queue for the other
servers. No jax here.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from vit22b.model.config import ViTConfig
from vit22b.model.errors import InvalidImage
from vit22b.model.identity import ModelIdentity
from vit22b.v1 import wire

from .client import FeatureClient, FeatureError, Retry
from .embed import (
    BatchResult,
    JobFailed,
    OutputSpec,
    WorkerLost,
    dense_rows,
    embed_files,
    stored_arrays,
)
from .embed_inputs import InputItem

# A server answering with these after the SDK's retries is gone (or hopeless): move off it.
LOST = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
)


class _Server:
    def __init__(self, address: str, client: FeatureClient, model: ModelIdentity,
                 max_image_pixels: int):
        self.address, self.client, self.model = address, client, model
        self.max_image_pixels = max_image_pixels  # 0 from a server that does not say
        self.lost: str | None = None  # why it was dropped
        self._lock = threading.Lock()

    def drop(self, reason: str) -> str:
        with self._lock:
            self.lost = self.lost or reason
            return self.lost


class RemoteWorker:
    def __init__(self, server: _Server, spec: OutputSpec, layers: tuple[int, ...], name: str):
        self.server, self.spec, self.layers, self.name = server, spec, layers, name
        self.options = dict(
            outputs=spec.kinds,
            layers=layers,
            dtype=spec.dtype,
            l2_normalize=spec.l2_normalize,
            normalize_patches=spec.normalize_patches,
            skip_invalid=True,
            resolution=spec.resolution,
            dense=spec.dense,
        )

    def embed(self, items: Sequence[InputItem]) -> BatchResult:
        return embed_files(self, items)

    def embed_images(self, images: Sequence[bytes | np.ndarray]) -> BatchResult:
        if not self.spec.dense:
            return self._embed(list(images), list(range(len(images))))
        # each image its own grid, so its own request; many in flight, so that the server's
        # batcher packs those of equal grids
        with ThreadPoolExecutor(max(1, len(images)), thread_name_prefix="embed-dense") as pool:
            parts = list(pool.map(lambda p: self._embed([images[p]], [p]), range(len(images))))
        return BatchResult.joined(parts)

    def _embed(self, blobs: list, positions: list[int]) -> BatchResult:
        """One request for ``blobs`` (at ``positions`` of the batch), less those the SDK
        refuses to send."""
        server = self.server
        if server.lost:
            raise WorkerLost(server.lost)
        failed = []
        while blobs:
            try:
                # no ids on the wire: file names need not be UTF-8; rows map back by index
                result = server.client.embed(blobs, batch_size=len(blobs), **self.options)
                break
            except InvalidImage as err:  # an image the SDK cannot send (e.g. over the size limit)
                failed.append((positions.pop(err.index), err.reason))
                del blobs[err.index]
            except FeatureError as err:
                if err.code in LOST:
                    raise WorkerLost(server.drop(f"{err.code.name}: {err.details}")) from None
                raise
        else:
            return BatchResult([], {}, sorted(failed))
        ref = result.model
        if result.ids and wire.identity_of_ref(ref) != server.model.key:
            changed = f"now serves another model ({ref.name}, weights {ref.fingerprint})"
            raise WorkerLost(server.drop(changed))
        failed += [(positions[e.index], e.reason) for e in result.errors]
        rows = [positions[i] for i in result.indices]
        if not rows:
            return BatchResult([], {}, sorted(failed))
        arrays = stored_arrays(result, self.spec)
        if self.spec.dense:
            arrays = dense_rows(arrays, result.grid, server.model.num_patches)
        return BatchResult(rows, arrays, sorted(failed))


class RemoteBackend:
    """Workers over every reachable server; all must serve the same model, weights and pixels."""

    def __init__(
        self,
        addresses: Sequence[str],
        spec: OutputSpec,
        *,
        token: str | None = None,
        tls: bool | str = False,
        batch_size: int = 32,
        concurrency: int = 2,
        retry: Retry | None = None,
        timeout: float = 300.0,
        quiet: bool = False,
    ):
        self.spec, self.concurrency = spec, max(1, concurrency)
        self.servers: list[_Server] = []
        unreachable = []
        for address in dict.fromkeys(addresses):
            client = FeatureClient(
                address, token=token, tls=tls, retry=retry, timeout=timeout, concurrency=1
            )
            try:
                info = client.model_info()
            except FeatureError as err:
                client.close()
                if err.code not in LOST:
                    raise ValueError(f"server {address}: {err}") from None
                unreachable.append(f"{address} ({err.code.name}: {err.details})")
                continue
            model = wire.identity_of(info)
            allowed = list(info.limits.resolutions) or [info.preprocessing.image_size]
            if spec.resolution and spec.resolution not in allowed:
                client.close()
                raise ValueError(f"server {address} does not serve --resolution "
                                 f"{spec.resolution}; it allows {', '.join(map(str, allowed))}")
            if spec.dense and not info.limits.max_dense_patches:
                client.close()
                raise ValueError(f"server {address}: its dense mode is off (it was started "
                                 "without --max-dense-patches); --dense needs it")
            if spec.resolution or spec.dense:
                cfg = ViTConfig.from_dict(json.loads(info.config_json))
                model = model.at(cfg, spec.geometry(info.limits.max_dense_patches))
            self.servers.append(_Server(address, client, model, info.limits.max_image_pixels))
        if not self.servers:  # as if every server were lost at once: exit 1, rerun later
            raise JobFailed(
                f"no server could be reached: {'; '.join(unreachable)}; rerun the same command "
                "when one is up"
            )
        if unreachable and not quiet:
            print(f"vit22b embed: skipping unreachable {', '.join(unreachable)}", file=sys.stderr)
        models = {s.model.key: s.address for s in self.servers}
        if len(models) > 1:
            listing = "; ".join(
                f"{a} serves {m[0]} (weights {m[1]}, preprocessing {m[2]}, compute {m[3]})"
                for m, a in models.items()
            )
            raise ValueError(f"the servers serve different models, refusing to mix: {listing}")
        self.model = self.servers[0].model
        self.max_image_pixels = min(s.max_image_pixels for s in self.servers) or None
        self.layers = spec.layers(self.model.depth)

    def workers(self) -> list[RemoteWorker]:
        return [
            RemoteWorker(s, self.spec, self.layers, f"{s.address}#{i}")
            for i in range(self.concurrency)
            for s in self.servers
        ]

    def close(self) -> None:
        for server in self.servers:
            server.client.close()
