"""How one shard's arrays are stored: ``npy``, ``parquet`` or ``safetensors`` (``--format``).

Each format writes a shard's arrays (rows in the order of the shard's ``ids.json``) and reads
them back; the manifest names the files and their sha256. Arrays arrive in their exact dtype
(float32, float16, or ``ml_dtypes.bfloat16``) and are never stored as integers a generic reader
would misread:

- ``npy``: one ``.npy`` per output, ``[n, *shape]``; bfloat16 is widened to float32 (exact:
  bfloat16 is float32's top half), since numpy has no bfloat16;
- ``parquet``: one table per shard with ``id``, ``path`` and one fixed-size-list column per
  output (nested once per dimension: ``pooled`` is ``fixed_size_list<float, d>``, patch tokens
  ``fixed_size_list<fixed_size_list<float, d>, N>``); bfloat16 widened to float32 as for npy,
  float16 as Parquet's FLOAT16. The schema's metadata ``vit22b`` holds the job's identity and
  each column's dtype and shape; each field's metadata names its dtype;
- ``safetensors``: one file per shard, a tensor per output in its own dtype (``BF16`` natively);
  ``__metadata__`` holds ``vit22b`` (the identity and the shapes, JSON). Written here (the
  format is a JSON header and raw little-endian bytes), read here memory-mapped; the
  ``safetensors`` package reads it too.

pyarrow is imported only by the Parquet format (``pip install 'vit22b[storage]'``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import BinaryIO, Protocol

import ml_dtypes
import numpy as np

from .outputs import OutputsError, shard_file
from .storage import Location

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
METADATA_KEY = "vit22b"


def exact(array: np.ndarray, dtype: str) -> np.ndarray:
    """Features in the output dtype, little-endian (bfloat16 as ``ml_dtypes.bfloat16``)."""
    target = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype).newbyteorder("<")
    return np.asarray(array).astype(target, copy=False)


def widened(array: np.ndarray) -> np.ndarray:
    """bfloat16 -> float32 (exact); other dtypes unchanged."""
    return array.astype(np.float32) if array.dtype == BFLOAT16 else array


class ShardFormat(Protocol):
    name: str

    def check(self) -> None:
        """Raise ValueError, naming the install, when this format cannot be written here."""
        ...

    def write(self, where: Location, index: int, ids: list[str], paths: list[str],
              arrays: dict[str, np.ndarray], metadata: dict) -> dict[str, dict]:
        """Write shard ``index``; returns manifest file entries {role: {"file", "sha256"}}."""
        ...

    def read(self, where: Location, files: dict[str, dict], specs: dict[str, dict],
             mmap: bool) -> dict[str, np.ndarray]:
        """The shard's arrays {name: [n, *shape]} as stored (bfloat16 as ml_dtypes.bfloat16)."""
        ...


def _entry(where: Location, rel: str, write: Callable[[BinaryIO], None]) -> dict:
    return {"file": rel, "sha256": where.write(rel, write)}


class Npy:
    name = "npy"

    def check(self) -> None:
        pass

    def write(self, where, index, ids, paths, arrays, metadata):
        files = {}
        for name, array in arrays.items():
            rel = shard_file(index, name, "npy")
            stored = widened(array)
            files[name] = _entry(where, rel, lambda f, a=stored: np.save(f, a, allow_pickle=False))
        return files

    def read(self, where, files, specs, mmap):
        return {name: _load_npy(where, files[name]["file"], mmap) for name in specs}


def _load_npy(where: Location, rel: str, mmap: bool) -> np.ndarray:
    path = where.local_file(rel)
    if path is None:
        with where.open(rel) as f:
            return np.load(f)
    try:
        return np.load(path, mmap_mode="r" if mmap else None)
    except ValueError:  # a shard whose images all failed: zero rows cannot be memory-mapped
        return np.load(path)


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise ValueError("--format parquet needs pyarrow: pip install 'vit22b[storage]'") from None
    return pa, pq


class Parquet:
    name = "parquet"
    ROLE = "table"

    def check(self) -> None:
        _pyarrow()

    def write(self, where, index, ids, paths, arrays, metadata):
        pa, pq = _pyarrow()
        columns = {"id": pa.array(ids, pa.string()), "path": pa.array(paths, pa.string())}
        fields = [pa.field("id", pa.string()), pa.field("path", pa.string())]
        for name, array in arrays.items():
            column = pa.array(np.ascontiguousarray(widened(array)).reshape(-1))
            for size in reversed(array.shape[1:]):
                column = pa.FixedSizeListArray.from_arrays(column, size)
            columns[name] = column
            fields.append(pa.field(name, column.type, nullable=False,
                                   metadata={"dtype": metadata["arrays"][name]["dtype"]}))
        schema = pa.schema(fields, metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True)})
        table = pa.Table.from_pydict(columns, schema=schema)
        rel = shard_file(index, None, "parquet")
        return {self.ROLE: _entry(where, rel, lambda f: pq.write_table(table, f))}

    def read(self, where, files, specs, mmap):
        pa, pq = _pyarrow()
        rel = files[self.ROLE]["file"]
        local = where.local_file(rel)
        if local is not None:
            table = pq.read_table(local, columns=list(specs), memory_map=mmap)
        else:
            with where.open(rel) as f:
                table = pq.read_table(f, columns=list(specs))
        out = {}
        for name, spec in specs.items():
            values = table.column(name).combine_chunks()
            for _ in spec["shape"]:
                values = values.flatten()
            out[name] = values.to_numpy(zero_copy_only=False).reshape(len(table), *spec["shape"])
        return out


# float64 / int64: a video job's timestamps and frame indices
_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
              "int64": "I64"}
_ST_NUMPY = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": BFLOAT16,
             "F64": np.dtype("<f8"), "I64": np.dtype("<i8")}


class Safetensors:
    name = "safetensors"
    ROLE = "tensors"

    def check(self) -> None:
        pass

    def write(self, where, index, ids, paths, arrays, metadata):
        header, offset = {}, 0
        for name, array in arrays.items():
            size = array.nbytes
            header[name] = {"dtype": _ST_DTYPES[array.dtype.name], "shape": list(array.shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {METADATA_KEY: json.dumps(metadata, sort_keys=True)}
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned

        def write(f):
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for array in arrays.values():
                f.write(np.ascontiguousarray(array).tobytes())

        rel = shard_file(index, None, "safetensors")
        return {self.ROLE: _entry(where, rel, write)}

    def read(self, where, files, specs, mmap):
        rel = files[self.ROLE]["file"]
        local = where.local_file(rel)
        if local is not None and mmap:
            data = np.memmap(local, np.uint8, mode="r")
        else:
            data = np.frombuffer(where.read(rel), np.uint8)
        (size,) = struct.unpack("<Q", data[:8].tobytes())
        header = json.loads(data[8 : 8 + size].tobytes())
        out = {}
        for name in specs:
            entry = header[name]
            begin, end = (8 + size + o for o in entry["data_offsets"])
            out[name] = data[begin:end].view(_ST_NUMPY[entry["dtype"]]).reshape(entry["shape"])
        return out


FORMATS: dict[str, ShardFormat] = {f.name: f for f in (Npy(), Parquet(), Safetensors())}


def get_format(name: str) -> ShardFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise OutputsError(f"unknown storage format {name!r}; known: {', '.join(FORMATS)}") \
            from None
