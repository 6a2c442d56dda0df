"""Reading the outputs of `vit22b embed`: the on-disk layout and a loader that memory-maps it.

Layout of an output directory (everything written atomically: temp file + rename)::

    DIR/manifest.json                  the job's identity and every completed shard
    DIR/errors.jsonl                   one JSON object per failed image: id, path, reason, shard
    DIR/shards/00000.ids.json          {"ids": [...], "paths": [...], "failed": [...]} of shard 0
    DIR/shards/00000.pooled.npy        [n, d]      rows in the order of "ids"
    DIR/shards/00000.class_token.npy   [n, d]      (models with a class token)
    DIR/shards/00000.patch_tokens.3.npy [n, N, d]  patch tokens after block 3 (index >= 0)
    DIR/.lock                          empty; a running job holds an flock on it

Shard ``k`` covers positions ``k*shard_size .. (k+1)*shard_size - 1`` of the sorted input list;
its arrays hold the images of that range that were embedded, its ``failed`` list the others.
``manifest.json`` names the model, its checkpoint fingerprint, the preprocessing hash, the
outputs and, per completed shard, the image count and the sha256 of every file. Arrays stored as
``bfloat16`` are kept as their raw 16 bits in ``uint16`` (numpy has no bfloat16);
:func:`bfloat16_to_float32` widens them exactly.

With numpy alone::

    import json, numpy as np
    m = json.load(open("DIR/manifest.json"))
    for shard in m["shards"]:
        ids = json.load(open(f"DIR/{shard['files']['ids']['file']}"))["ids"]
        pooled = np.load(f"DIR/{shard['files']['pooled']['file']}", mmap_mode="r")

This module needs numpy only (no jax, no gRPC): ``open_outputs(DIR)`` memory-maps every shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

FORMAT = "vit22b-embeddings/1"
MANIFEST = "manifest.json"
ERRORS = "errors.jsonl"
SHARDS_DIR = "shards"
IDS = "ids"  # the per-shard file naming the rows (and the failures) of that shard


def array_name(output: str, layer: int | None = None) -> str:
    """The name of one stored array: 'pooled', 'class_token' or 'patch_tokens.<layer>'."""
    return output if layer is None else f"{output}.{layer}"


def shard_file(index: int, name: str) -> str:
    """Path, relative to the output directory, of array ``name`` (or 'ids') of shard ``index``."""
    suffix = "json" if name == IDS else "npy"
    return f"{SHARDS_DIR}/{index:05d}.{name}.{suffix}"


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values stored as uint16 bits -> float32 (exact: bfloat16 is float32's top half)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class OutputsError(ValueError):
    """An output directory that is missing, not a vit22b embed output, or damaged."""


class ShardedArray:
    """One output across all completed shards, as a sequence of rows; shards stay memory-mapped.

    Indexing with an int, a slice or an array of row indices reads only the rows asked for;
    ``np.asarray(x)`` (or ``x.numpy()``) concatenates everything into memory.
    """

    def __init__(self, name: str, parts: list[np.ndarray], stored_dtype: str):
        self.name = name
        self.parts = parts
        self.stored_dtype = stored_dtype  # 'bfloat16' when parts hold uint16 bits
        self._offsets = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape[1:] if self.parts else ()
        return (len(self), *inner)

    def _widen(self, a: np.ndarray) -> np.ndarray:
        return bfloat16_to_float32(a) if self.stored_dtype == "bfloat16" else a

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            i = int(index) + len(self) if index < 0 else int(index)
            if not 0 <= i < len(self):
                raise IndexError(f"row {index} out of range for {len(self)} rows")
            shard = int(np.searchsorted(self._offsets, i, side="right")) - 1
            return self._widen(self.parts[shard][i - self._offsets[shard]])
        rows = np.arange(len(self))[index]
        shards = np.searchsorted(self._offsets, rows, side="right") - 1
        out = [self.parts[s][r - self._offsets[s]] for s, r in zip(shards, rows)]
        empty = np.empty((0, *self.shape[1:]), self.parts[0].dtype if self.parts else np.float32)
        return self._widen(np.stack(out) if out else empty)

    def numpy(self) -> np.ndarray:
        if not self.parts:
            return np.empty((0,), np.float32)
        return self._widen(np.concatenate(self.parts))

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)


@dataclass
class ShardView:
    index: int
    ids: list[str]
    paths: list[str]
    failed: list[dict]


class Outputs:
    """An embed output directory: ``ids``, ``paths``, one :class:`ShardedArray` per output name.

    >>> out = open_outputs("DIR")
    >>> out.names            # e.g. ['pooled', 'patch_tokens.3']
    >>> out["pooled"][:10]   # rows 0..9, read from the memory-mapped shards
    """

    def __init__(self, directory: str, manifest: dict, shards: list[ShardView], arrays: dict):
        self.directory = directory
        self.manifest = manifest
        self.shards = shards
        self._arrays = arrays

    @property
    def names(self) -> list[str]:
        return list(self._arrays)

    @property
    def ids(self) -> list[str]:
        return [i for s in self.shards for i in s.ids]

    @property
    def paths(self) -> list[str]:
        return [p for s in self.shards for p in s.paths]

    @property
    def failed(self) -> list[dict]:
        return [f for s in self.shards for f in s.failed]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def __len__(self) -> int:
        return sum(len(s.ids) for s in self.shards)

    def __getitem__(self, name: str) -> ShardedArray:
        try:
            return self._arrays[name]
        except KeyError:
            raise KeyError(f"no output {name!r}; this directory holds {self.names}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise OutputsError(f"{path} not found: not a vit22b embed output directory") from None
    except json.JSONDecodeError as err:
        raise OutputsError(f"{path} is not valid JSON: {err}") from None
    if manifest.get("format") != FORMAT:
        raise OutputsError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def verify_file(directory: str, entry: dict) -> None:
    """Raise OutputsError unless the file of a manifest entry exists with its recorded sha256."""
    path = os.path.join(directory, entry["file"])
    if not os.path.exists(path):
        raise OutputsError(f"{path} is listed in the manifest but missing")
    if sha256_file(path) != entry["sha256"]:
        raise OutputsError(f"{path} does not match the sha256 in the manifest")


def _load(path: str, mmap: bool) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None)
    except ValueError:  # a shard whose images all failed: zero rows cannot be memory-mapped
        return np.load(path)


def open_outputs(directory: str, verify: bool = False, mmap: bool = True) -> Outputs:
    """Open the completed shards of an embed output; ``verify=True`` checks every checksum."""
    manifest = read_manifest(directory)
    names = list(manifest["identity"]["outputs"])  # the order the job was asked for
    shards: list[ShardView] = []
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for entry in manifest["shards"]:
        files = entry["files"]
        if verify:
            for file_entry in files.values():
                verify_file(directory, file_entry)
        with open(os.path.join(directory, files[IDS]["file"])) as f:
            rows = json.load(f)
        shards.append(ShardView(entry["index"], rows["ids"], rows["paths"], rows["failed"]))
        for name in names:
            parts[name].append(_load(os.path.join(directory, files[name]["file"]), mmap))
    arrays = {
        name: ShardedArray(name, parts[name], manifest["arrays"][name]["dtype"]) for name in names
    }
    return Outputs(directory, manifest, shards, arrays)
