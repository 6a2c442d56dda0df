"""Reading the outputs of `vit22b embed`: the on-disk layout and a loader that memory-maps it.

Layout of an output directory (a local folder or an fsspec URL: see storage.py for how each
file is written whole)::

    DIR/manifest.json                  the job's identity and every completed shard
    DIR/errors.jsonl                   one JSON object per failed image: id, path, reason, shard
    DIR/shards/00000.ids.json          {"ids": [...], "paths": [...], "failed": [...]} of shard 0
    --format npy (the default):
    DIR/shards/00000.pooled.npy        [n, d]      rows in the order of "ids"
    DIR/shards/00000.class_token.npy   [n, d]      (models with a class token)
    DIR/shards/00000.patch_tokens.3.npy [n, N, d]  patch tokens after block 3 (index >= 0)
    DIR/shards/00000.grid.npy          [n, 2]      --dense: each image's (rows, cols), int64;
                                                   its rows*cols tokens first, zeros up to N
    --format parquet / safetensors:
    DIR/shards/00000.parquet           id, path and a column per output (see embed_formats.py)
    DIR/shards/00000.safetensors       a tensor per output
    DIR/.lock                          empty; a running job holds an flock on it (local only)

Shard ``k`` covers positions ``k*shard_size .. (k+1)*shard_size - 1`` of the sorted input list;
its arrays hold the images of that range that were embedded, its ``failed`` list the others.
``manifest.json`` names the model, its checkpoint fingerprint, the preprocessing hash, the
outputs, the storage format and, per completed shard, the image count and the sha256 of every
file. ``bfloat16`` outputs are stored as float32 (exact) in ``.npy`` and Parquet files and as
BF16 in safetensors; this loader returns them as float32.

With numpy alone::

    import json, numpy as np
    m = json.load(open("DIR/manifest.json"))
    for shard in m["shards"]:
        ids = json.load(open(f"DIR/{shard['files']['ids']['file']}"))["ids"]
        pooled = np.load(f"DIR/{shard['files']['pooled']['file']}", mmap_mode="r")

This module needs numpy only (no jax, no gRPC; Parquet shards need pyarrow):
``open_outputs(DIR)`` memory-maps every local npy or safetensors shard.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from vit22b.model.schema import COUNT, FLAG, TEXT, Each, Needed, Schema, Values, check, list_of

from .storage import Location

FORMAT = "vit22b-embeddings/2"  # /1 stored bfloat16 as uint16 bits
MANIFEST = "manifest.json"
ERRORS = "errors.jsonl"
SHARDS_DIR = "shards"
LOCK = ".lock"
IDS = "ids"  # the per-shard file naming the rows (and the failures) of that shard

# What the readers (open_outputs, a resumed job) take from the manifest and a shard's ids file:
# a folder may come from anyone, and a job killed or edited by hand leaves what it leaves.
_FILE: Schema = {"file": Needed(TEXT), "sha256": Needed(TEXT)}
MANIFEST_SCHEMA: Schema = {
    "identity": Needed({"format": TEXT, "outputs": list_of(TEXT)}),
    "arrays": Needed(Values({"dtype": Needed(TEXT), "shape": Needed(list_of(COUNT))})),
    "num_shards": Needed(COUNT),
    "shards": Needed(Each({
        "index": Needed(COUNT),
        "count": Needed(COUNT),
        "failed": Needed(COUNT),
        "files": Needed(Values(_FILE, needed=(IDS,))),
    })),
    "complete": FLAG,
}
IDS_SCHEMA: Schema = {
    "ids": Needed(list_of(TEXT)),
    "paths": Needed(list_of(TEXT)),
    "failed": Needed(Each({})),  # objects: id, path, reason
}


def array_name(output: str, layer: int | None = None) -> str:
    """The name of one stored array: 'pooled', 'class_token' or 'patch_tokens.<layer>'."""
    return output if layer is None else f"{output}.{layer}"


def shard_file(index: int, name: str | None, suffix: str) -> str:
    """Path, relative to the output directory, of file ``name`` of shard ``index`` (one file
    per shard when ``name`` is None)."""
    stem = f"{index:05d}" if name is None else f"{index:05d}.{name}"
    return f"{SHARDS_DIR}/{stem}.{suffix}"


def sha256_of(where: Location, rel: str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with where.open(rel) as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class OutputsError(ValueError):
    """An output directory that is missing, not a vit22b embed output, or damaged."""


class ShardedArray:
    """One output across all completed shards, as a sequence of rows; shards stay memory-mapped.

    Indexing with an int, a slice or an array of row indices reads only the rows asked for;
    ``np.asarray(x)`` (or ``x.numpy()``) concatenates everything into memory.
    """

    def __init__(self, name: str, parts: list[np.ndarray]):
        self.name = name
        self.parts = parts  # as stored; bfloat16 (safetensors) is widened on reading
        self._offsets = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape[1:] if self.parts else ()
        return (len(self), *inner)

    @staticmethod
    def _widen(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float32) if a.dtype.name == "bfloat16" else a

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


def read_manifest(directory: str | Location) -> dict:
    where = directory if isinstance(directory, Location) else Location(directory)
    path = where.path(MANIFEST)
    try:
        manifest = json.loads(where.read(MANIFEST))
    except FileNotFoundError:
        raise OutputsError(f"{path} not found: not a vit22b embed output directory") from None
    except OSError as err:  # a folder, a FIFO, no permission
        raise OutputsError(f"{path} cannot be read: {err.strerror or err}") from None
    except ValueError as err:  # not JSON, or not UTF-8
        raise OutputsError(f"{path} is not valid JSON: {err}") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != FORMAT:
        raise OutputsError(f"{path}: format {found!r}, expected {FORMAT!r}"
                           " (written by another version: embed into a new directory)")
    check(manifest, MANIFEST_SCHEMA, path, OutputsError)
    return manifest


def read_ids(where: Location, rel: str) -> dict:
    """A shard's ids file: its rows' ids and paths, and its failures."""
    try:
        rows = json.loads(where.read(rel))
    except (OSError, ValueError) as err:
        raise OutputsError(f"{where.path(rel)} is unreadable: {err}") from None
    check(rows, IDS_SCHEMA, where.path(rel), OutputsError)
    return rows


def verify_file(where: Location, entry: dict) -> None:
    """Raise OutputsError unless the file of a manifest entry exists with its recorded sha256."""
    path = where.path(entry["file"])
    if not where.exists(entry["file"]):
        raise OutputsError(f"{path} is listed in the manifest but missing")
    if sha256_of(where, entry["file"]) != entry["sha256"]:
        raise OutputsError(f"{path} does not match the sha256 in the manifest: damaged or "
                           "changed since its job wrote it (a damaged shard is recomputed by "
                           "deleting its files and rerunning the job)")


def open_outputs(directory: str, verify: bool = False, mmap: bool = True) -> Outputs:
    """Open the completed shards of an embed output (a folder or an fsspec URL);
    ``verify=True`` checks every checksum.

    The folder may come from anyone: the manifest names only files under its ``shards/``
    (never ``..`` or an absolute path), and each shard's arrays must hold a row per id."""
    from .embed_formats import get_format

    where = Location(directory)
    manifest = read_manifest(where)
    try:
        storage = get_format(manifest["identity"]["format"])
        storage.check()  # its library installed (pyarrow), before any shard is blamed
        names = list(manifest["identity"]["outputs"])  # the order the job was asked for
        specs = {name: manifest["arrays"][name] for name in names}
        shards: list[ShardView] = []
        parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
        for entry in manifest["shards"]:
            files = entry["files"]
            for file_entry in files.values():
                _check_inside(where, file_entry["file"])
                if verify:
                    verify_file(where, file_entry)
            rows = read_ids(where, files[IDS]["file"])
            shard = ShardView(entry["index"], rows["ids"], rows["paths"], rows["failed"])
            for name, array in _read_shard(where, storage, files, specs, mmap, shard).items():
                parts[name].append(array)
            shards.append(shard)
    except (KeyError, TypeError, AttributeError) as err:
        raise OutputsError(f"{where.path(MANIFEST)} is malformed: {type(err).__name__}: {err}"
                           ) from None
    arrays = {name: ShardedArray(name, parts[name]) for name in names}
    return Outputs(directory, manifest, shards, arrays)


def _read_shard(where: Location, storage, files: dict, specs: dict, mmap: bool,
                shard: ShardView) -> dict[str, np.ndarray]:
    """A shard's arrays, each a row per id, of the manifest's shape and of its dtype's kind."""
    try:
        arrays = storage.read(where, files, specs, mmap)
    except Exception as err:  # noqa: BLE001 - a damaged file raises what its reader raises
        names = ", ".join(sorted(e["file"] for role, e in files.items() if role != IDS))
        raise OutputsError(
            f"{where.path('')}: shard {shard.index} cannot be read ({names}: {type(err).__name__}:"
            f" {err}); a damaged shard is recomputed by deleting its files and rerunning the job"
        ) from None
    for name, array in arrays.items():
        if len(array) != len(shard.ids):  # rows would pair with the wrong ids
            raise OutputsError(f"{where.path(SHARDS_DIR)}: shard {shard.index} names "
                               f"{len(shard.ids)} images, its {name} holds {len(array)}")
        spec = specs[name]
        if array.shape[1:] != tuple(spec["shape"]) or _kind(array.dtype) != _kind(spec["dtype"]):
            raise OutputsError(
                f"{where.path(SHARDS_DIR)}: shard {shard.index}'s {name} holds {array.dtype} "
                f"rows of shape {list(array.shape[1:])}; the manifest says {spec['dtype']} "
                f"{spec['shape']}"
            )
    return arrays


def _kind(dtype) -> str:
    """numpy's kind letter, 'f' for bfloat16 too (stored as float32 in npy and Parquet)."""
    name = str(dtype)
    return "f" if name == "bfloat16" else np.dtype(name).kind


def _check_inside(where: Location, rel) -> None:
    """A manifest's file name: a plain name under ``shards/`` (what the job writes)."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if len(parts) != 2 or parts[0] != SHARDS_DIR or parts[1] in ("", ".", "..") or (
            "\\" in rel):
        raise OutputsError(f"{where.path(MANIFEST)} names a file outside {SHARDS_DIR}/: "
                           f"{rel!r}")
