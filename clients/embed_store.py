"""Writing the outputs of `vit22b embed` (layout: see clients/outputs.py): shards, manifest, errors.

Crash safety: every file goes to a temp name in the same folder, is fsynced, then renamed over
its final name, so a reader (or a resumed job) sees either the old file or the new one, never a
torn one. A shard's files are written before the manifest names it; a kill in between leaves
files the manifest does not list, and the resumed job recomputes and overwrites them. Shard
contents depend only on their slice of the sorted inputs, and the manifest holds no timestamps,
so an interrupted-and-resumed job ends byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

from .outputs import (
    ERRORS,
    FORMAT,
    IDS,
    MANIFEST,
    SHARDS_DIR,
    OutputsError,
    read_manifest,
    shard_file,
)

TEMP_MARK = ".tmp-"
LOCK = ".lock"


class JobMismatch(ValueError):
    """The output directory holds a job with other settings; mixing would corrupt it."""


class _HashingWriter:
    """File wrapper that hashes what passes through (np.save writes to it in chunks)."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.f.write(data)


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> str:
    """Write ``path`` via a temp file + fsync + rename; returns the sha256 of what was written."""
    tmp = f"{path}{TEMP_MARK}{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return writer.digest.hexdigest()


def atomic_write_json(path: str, obj) -> str:
    blob = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    return atomic_write(path, lambda f: f.write(blob))


def _identity_diff(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"  {k}: {old.get(k)!r} in the manifest, {new.get(k)!r} now" for k in keys
            if old.get(k) != new.get(k)]


class OutputStore:
    """The output directory of one job: knows which shards are done and writes the others."""

    def __init__(self, directory: str, identity: dict, arrays: dict, num_shards: int,
                 about: dict | None = None):
        self.directory = directory
        self.identity = identity
        self.about = about or {}  # informative only (e.g. where the weights came from)
        self.arrays = arrays  # name -> {"dtype": str, "shape": [per-image shape]}
        self.num_shards = num_shards
        self.done: dict[int, dict] = {}  # shard index -> manifest entry
        self._failed: dict[int, list[dict]] = {}
        self._lock = threading.Lock()
        self._lock_file: BinaryIO | None = None

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str, identity: dict, arrays: dict, num_shards: int,
             about: dict | None = None) -> OutputStore:
        """Create or resume ``directory``; JobMismatch if it holds a job with other settings."""
        store = cls(directory, identity, arrays, num_shards, about)
        os.makedirs(os.path.join(directory, SHARDS_DIR), exist_ok=True)
        store._take_lock()
        try:
            store._remove_temp_files()
            if os.path.exists(os.path.join(directory, MANIFEST)):
                store._resume(read_manifest(directory))
            store._write_manifest()
        except BaseException:
            store.close()
            raise
        return store

    def _take_lock(self) -> None:
        self._lock_file = open(os.path.join(self.directory, LOCK), "ab")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobMismatch(
                f"another vit22b embed is writing to {self.directory} (its lock is held)"
            ) from None

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def _remove_temp_files(self) -> None:
        for folder in (self.directory, os.path.join(self.directory, SHARDS_DIR)):
            for name in os.listdir(folder):
                if TEMP_MARK in name:
                    os.remove(os.path.join(folder, name))

    def _resume(self, manifest: dict) -> None:
        diff = _identity_diff(manifest["identity"], self.identity)
        if manifest["identity"].get("inputs") != self.identity.get("inputs"):
            diff.append("  (the input list changed: files added, removed or renamed; shards are "
                        "positions in the sorted list, so a changed list needs a new --output)")
        if diff:
            raise JobMismatch(
                f"refusing to mix into {self.directory}: it holds a job with different settings\n"
                + "\n".join(diff)
                + "\nrerun with the manifest's settings to resume it, or choose another --output"
            )
        for entry in manifest["shards"]:
            files = entry["files"]
            present = all(os.path.exists(os.path.join(self.directory, f["file"]))
                          for f in files.values())
            if present:  # a shard whose files were deleted by hand is simply recomputed
                self.done[entry["index"]] = entry
                if entry["failed"]:
                    self._failed[entry["index"]] = self._read_failed(files[IDS]["file"])

    def _read_failed(self, rel: str) -> list[dict]:
        try:
            with open(os.path.join(self.directory, rel)) as f:
                return json.load(f)["failed"]
        except (OSError, ValueError, KeyError) as err:
            raise OutputsError(f"{rel} in {self.directory} is unreadable: {err}") from None

    # -- writing -------------------------------------------------------------------------
    def write_shard(
        self,
        index: int,
        inputs_sha256: str,
        ids: list[str],
        paths: list[str],
        arrays: dict[str, np.ndarray],
        failed: list[dict],
    ) -> dict:
        """Write shard ``index`` (arrays, then ids), then name it in the manifest."""
        if set(arrays) != set(self.arrays):
            raise ValueError(f"shard {index}: arrays {sorted(arrays)} != {sorted(self.arrays)}")
        files = {}
        for name, array in arrays.items():
            expected = (len(ids), *self.arrays[name]["shape"])
            if array.shape != expected:
                raise ValueError(f"shard {index}: {name} has shape {array.shape}, not {expected}")
            rel = shard_file(index, name)
            digest = atomic_write(os.path.join(self.directory, rel),
                                  lambda f, a=array: np.save(f, a, allow_pickle=False))
            files[name] = {"file": rel, "sha256": digest}
        rel = shard_file(index, IDS)
        rows = {"ids": ids, "paths": paths, "failed": failed}
        digest = atomic_write_json(os.path.join(self.directory, rel), rows)
        files[IDS] = {"file": rel, "sha256": digest}
        entry = {
            "index": index,
            "count": len(ids),
            "failed": len(failed),
            "inputs_sha256": inputs_sha256,
            "files": files,
        }
        with self._lock:
            self.done[index] = entry
            if failed:
                self._failed[index] = failed
                self._write_errors()
            self._write_manifest()
        return entry

    def _write_errors(self) -> None:
        rows = [{**row, "shard": index} for index in sorted(self._failed)
                for row in self._failed[index]]
        blob = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows).encode()
        atomic_write(os.path.join(self.directory, ERRORS), lambda f: f.write(blob))

    def _write_manifest(self) -> None:
        shards = [self.done[i] for i in sorted(self.done)]
        manifest = {
            "format": FORMAT,
            "identity": self.identity,
            "about": self.about,
            "arrays": self.arrays,
            "num_shards": self.num_shards,
            "shards": shards,
            "embedded": sum(s["count"] for s in shards),
            "failed": sum(s["failed"] for s in shards),
            "complete": len(shards) == self.num_shards,
        }
        atomic_write_json(os.path.join(self.directory, MANIFEST), manifest)

    def finish(self) -> None:
        """Write errors.jsonl (possibly empty) so a finished job always has one."""
        with self._lock:
            self._write_errors()
            self._write_manifest()
        self.close()
