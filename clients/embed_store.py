"""Writing the outputs of `vit22b embed` (layout: see clients/outputs.py): shards, manifest, errors.

Crash safety: every file is written whole (storage.py: temp file + fsync + rename locally, one
PUT per object on object stores), a shard's files before the manifest names it; a kill in
between leaves files the manifest does not list, and the resumed job recomputes and overwrites
them. Shard contents depend only on their slice of the sorted inputs, and the manifest holds no
timestamps, so an interrupted-and-resumed job ends byte-identical to an uninterrupted one.

``ShardWriter`` writes one shard's files and returns its manifest entry; it is picklable, so a
shard can be written where it was computed (a Ray worker). ``OutputStore`` is the one writer of
the manifest and errors.jsonl: the job's driver.

The manifest is rewritten whole, so its cost grows with the job: after a shard it is written
only when the time since its last write is at least ``MANIFEST_SHARE`` times that write's
duration (written after every shard, what the manifests put on an object store grows with the
square of the job's shards: benchmarks/NOTES.md), and always at the end; a kill loses the
records of the shards since the last write, which a resume recomputes. While a job runs, its
manifest names it (``writer``: host, pid, a token); object stores have no lock, so before each
write the driver reads the manifest back and stops when another job has written there since
(two jobs started on one output both wrote every shard, and their files mixed). A finished
manifest names no writer.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from .embed_formats import exact, get_format
from .outputs import (
    ERRORS,
    FORMAT,
    IDS,
    LOCK,
    MANIFEST,
    SHARDS_DIR,
    OutputsError,
    read_ids,
    read_manifest,
    shard_file,
)
from .storage import Location, atomic_write  # noqa: F401 - atomic_write: part of this API

MANIFEST_SHARE = 9  # seconds between manifest writes per second a write takes


class JobMismatch(ValueError):
    """The output directory holds a job with other settings; mixing would corrupt it."""


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


@dataclass(frozen=True)
class ShardWriter:
    """Writes one shard's files (arrays in the job's format, then ids.json); no manifest."""

    where: Location
    identity: dict
    arrays: dict  # name -> {"dtype": str, "shape": [per-image shape]}
    format: str = "npy"

    def empty(self, name: str) -> np.ndarray:
        spec = self.arrays[name]
        return exact(np.empty((0, *spec["shape"]), np.float32), spec["dtype"])

    def write(self, index: int, inputs_sha256: str, ids: list[str], paths: list[str],
              arrays: dict[str, np.ndarray], failed: list[dict]) -> dict:
        """Write shard ``index``; returns its manifest entry."""
        if set(arrays) != set(self.arrays):
            raise ValueError(f"shard {index}: arrays {sorted(arrays)} != {sorted(self.arrays)}")
        stored = {}
        for name, spec in self.arrays.items():  # the manifest's order
            expected = (len(ids), *spec["shape"])
            if arrays[name].shape != expected:
                raise ValueError(f"shard {index}: {name} has shape {arrays[name].shape}, "
                                 f"not {expected}")
            stored[name] = exact(arrays[name], spec["dtype"])
        metadata = {"identity": self.identity, "arrays": self.arrays, "shard": index}
        files = get_format(self.format).write(self.where, index, ids, paths, stored, metadata)
        rel = shard_file(index, IDS, "json")
        rows = {"ids": ids, "paths": paths, "failed": failed}
        files[IDS] = {"file": rel, "sha256": self.where.write_bytes(rel, json_bytes(rows))}
        return {
            "index": index,
            "count": len(ids),
            "failed": len(failed),
            "inputs_sha256": inputs_sha256,
            "files": files,
        }


log = logging.getLogger(__name__)


def _recorded_places(recorded: dict, now: dict, directory: str) -> dict:
    """``recorded`` as this version writes it: a manifest of a version before the inputs
    recorded where they are read from (``places_sha256``) holds their names and count alone,
    and is taken to be of these places when those match (said once), so that a job begun
    before an upgrade resumes after it."""
    old, new = recorded.get("inputs"), now.get("inputs")
    if not (isinstance(old, dict) and isinstance(new, dict)) or "places_sha256" in old:
        return recorded
    if old != {k: v for k, v in new.items() if k != "places_sha256"}:
        return recorded
    log.warning("%s: its manifest (an earlier vit22b's) does not record where its inputs were "
                "read from; the same %d names are taken to be these files", directory,
                new.get("count", 0))
    return {**recorded, "inputs": new}


def _recorded_display(recorded: dict, now: dict, directory: str) -> tuple[dict, bool]:
    """``recorded`` as this version writes it, and whether it is of a video job written before
    frames were shown by ``video.DISPLAY`` (its identity's video lacks the rule): such a job is
    taken to be of this rule, said once, and its shards are rechecked (``OutputStore.open``)."""
    old, new = recorded.get("video"), now.get("video")
    if not (isinstance(old, dict) and isinstance(new, dict)) or "display" in old:
        return recorded, False
    if old != {k: v for k, v in new.items() if k != "display"}:
        return recorded, False
    log.warning("%s: its manifest (an earlier vit22b's) was written before frames were shown "
                "square and upright; its shards holding videos that rule shows otherwise are "
                "recomputed", directory)
    return {**recorded, "video": new}, True


def _other_display(recorded: dict, now: dict) -> str | None:
    """The manifest's rule for showing frames where it names one other than ``now``'s."""
    old, new = recorded.get("video"), now.get("video")
    if isinstance(old, dict) and isinstance(new, dict) and "display" in old:
        return old["display"] if old["display"] != new.get("display") else None
    return None


_GEOMETRY = ("resolution", "num_patches")


def _recorded_geometry(recorded: dict, now: dict) -> dict:
    """``now`` where the two differ only in how they name one geometry: a ``--resolution``
    equal to the model's own computes what none does (square or dense), and the contract's
    hash, which holds the geometry, is the same in both; a dense job's patch bound (its rows'
    shape) must be the same too."""
    rest = [{k: v for k, v in identity.items() if k not in _GEOMETRY}
            for identity in (recorded, now)]
    bounds = [identity.get("num_patches") for identity in (recorded, now)]
    same_rows = None in bounds or bounds[0] == bounds[1]
    return now if rest[0] == rest[1] and same_rows else recorded


def _identity_diff(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"  {k}: {old.get(k)!r} in the manifest, {new.get(k)!r} now" for k in keys
            if old.get(k) != new.get(k)]


def _make_levels(path: str, made: list[str]) -> None:
    """Make folder ``path`` one level at a time as spelled (through links and '..', as the
    kernel resolves them), appending each level it made to ``made``."""
    level = ""
    for part in path.split(os.sep):
        level = os.path.join(level, part) if level else (part or os.sep)
        if part and not os.path.lexists(level):
            os.mkdir(level)
            made.append(level)
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)


class OutputStore:
    """The output directory of one job: knows which shards are done and records the others."""

    def __init__(self, directory: str, identity: dict, arrays: dict, num_shards: int,
                 about: dict | None = None, retry=None, recheck=None):
        self.directory = directory
        self.where = Location(directory)
        self.identity = identity
        self.about = about or {}  # informative only (e.g. where the weights came from)
        self.arrays = arrays  # name -> {"dtype": str, "shape": [per-image shape]}
        self.num_shards = num_shards
        self.writer = ShardWriter(self.where, identity, arrays, identity.get("format", "npy"))
        self.done: dict[int, dict] = {}  # shard index -> manifest entry
        self._failed: dict[int, list[dict]] = {}
        self._lock = threading.Lock()
        self._retry = retry
        self._recheck = recheck
        self._writer = {"host": socket.gethostname(), "pid": os.getpid(),
                        "token": uuid.uuid4().hex}
        self._next_write = 0.0  # monotonic time from which the manifest may be written again
        self._unwritten = False  # shards recorded since the last write
        self._errors_unwritten = False  # ... with failures

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str, identity: dict, arrays: dict, num_shards: int,
             about: dict | None = None, retry=None, recheck=None) -> OutputStore:
        """Create or resume ``directory``; JobMismatch if it holds a job with other settings.
        ``retry(failure)``: whether a done shard's recorded failure (``errors.jsonl``'s row)
        should be tried again, which makes its shard one to recompute. ``recheck(index)``:
        for a video job written before ``video.DISPLAY``, whether done shard ``index`` holds a
        video that rule shows otherwise (recomputed too)."""
        store = cls(directory, identity, arrays, num_shards, about, retry, recheck)
        cls.prepare(directory)
        try:
            locked = store.where.lock(LOCK)
        except OSError as err:
            raise _not_a_folder(directory, err) from None
        if not locked:
            raise JobMismatch(f"another vit22b embed is writing to {directory} (its lock is held)")
        try:
            store.where.remove_temp_files("", SHARDS_DIR)
            if store.where.exists(MANIFEST):
                store._resume(read_manifest(store.where))
            store._write_manifest()
        except BaseException:
            store.close()
            raise
        return store

    @staticmethod
    def prepare(directory: str) -> list[str]:
        """Make ``directory`` a folder of outputs, or OutputsError: a job checks this before it
        loads a model, so a wrong ``--output`` is said at once. Returns the local folders it
        made, deepest first (``unprepare`` removes them if the job then writes nothing)."""
        where = Location(directory)
        made: list[str] = []
        try:
            if where.remote:
                where.makedirs(SHARDS_DIR)  # a no-op on object stores
            else:
                _make_levels(os.path.join(where.root, SHARDS_DIR), made)
        except TimeoutError:  # the store's failure (no answer), not the output's
            raise
        except OSError as err:  # e.g. the output is a file, or under one; no permission
            OutputStore.unprepare(made[::-1])
            raise _not_a_folder(directory, err) from None
        return made[::-1]

    @staticmethod
    def unprepare(made: list[str]) -> None:
        """Remove the folders ``prepare`` made if nothing but each other was written in them (a
        job refused or failed before its first write leaves no empty output behind)."""
        ours = {os.path.realpath(path) for path in made}
        for path in made:
            try:
                inside = {os.path.realpath(os.path.join(path, e)) for e in os.listdir(path)}
            except OSError:
                return
            if not inside <= ours:
                return
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)

    def close(self) -> None:
        """Write what was recorded and not yet written (a job ending early), and unlock."""
        try:
            with self._lock:
                if self._unwritten:
                    self._write(final=False)
        finally:
            self.where.unlock()

    def _resume(self, manifest: dict) -> None:
        recorded = _recorded_places(manifest["identity"], self.identity, self.directory)
        recorded, earlier_display = _recorded_display(recorded, self.identity, self.directory)
        recorded = _recorded_geometry(recorded, self.identity)
        recheck = self._recheck if earlier_display else None
        diff = _identity_diff(recorded, self.identity)
        if recorded.get("inputs") != self.identity.get("inputs"):
            diff.append("  (the input list changed: files added, removed or renamed, or read "
                        "from another folder; shards are positions in the sorted list, so a "
                        "changed list needs a new --output)")
        if diff:
            advice = "rerun with the manifest's settings to resume it, or choose another --output"
            shown = _other_display(recorded, self.identity)
            if shown is not None:
                advice = (f"its frames were shown by another rule ({shown!r}) than this "
                          "vit22b's: no setting chooses the rule, so choose another --output")
            raise JobMismatch(
                f"refusing to mix into {self.directory}: it holds a job with different settings\n"
                + "\n".join(diff) + "\n" + advice
            )
        present = {f"{SHARDS_DIR}/{name}" for name in self.where.files(SHARDS_DIR)}
        retried = False
        for k, entry in enumerate(manifest["shards"]):
            if entry["index"] >= self.num_shards:  # the same inputs give the same shards
                raise OutputsError(f"{self.where.path(MANIFEST)}: shards.{k}.index is "
                                   f"{entry['index']}, beyond this job's {self.num_shards} "
                                   "shards (a damaged or edited manifest)")
            files = entry["files"]
            # a shard whose files were deleted by hand is simply recomputed
            if all(f["file"] in present for f in files.values()):
                failed = read_ids(self.where, files[IDS]["file"])["failed"] if (
                    entry["failed"]) else []
                if (self._retry is not None and any(map(self._retry, failed))
                        or recheck is not None and recheck(entry["index"])):
                    retried = True  # recomputed, its files rewritten
                    continue
                self.done[entry["index"]] = entry
                if failed:
                    self._failed[entry["index"]] = failed
        if retried:
            self._write_errors()

    # -- writing -------------------------------------------------------------------------
    def write_shard(self, index: int, inputs_sha256: str, ids: list[str], paths: list[str],
                    arrays: dict[str, np.ndarray], failed: list[dict]) -> dict:
        """Write shard ``index`` (arrays, then ids), then name it in the manifest."""
        entry = self.writer.write(index, inputs_sha256, ids, paths, arrays, failed)
        self.record(entry, failed)
        return entry

    def record(self, entry: dict, failed: list[dict]) -> None:
        """Name a written shard in the manifest (and its failures in errors.jsonl), now or at
        the next write (see the module's docstring)."""
        with self._lock:
            self.done[entry["index"]] = entry
            if failed:
                self._failed[entry["index"]] = failed
                self._errors_unwritten = True
            self._unwritten = True
            if time.monotonic() >= self._next_write:
                self._write(final=False)

    def _write(self, final: bool) -> None:
        start = time.monotonic()
        if self.where.remote:
            self._check_writer()
        if self._errors_unwritten or final:
            self._write_errors()
        self._write_manifest(final)
        self._unwritten = self._errors_unwritten = False
        end = time.monotonic()
        self._next_write = end + MANIFEST_SHARE * (end - start)

    def _check_writer(self) -> None:
        """JobMismatch when another job has written the manifest since this one did."""
        writer = read_manifest(self.where).get("writer")
        if writer is not None and writer != self._writer:
            who = writer if isinstance(writer, dict) else {}
            raise JobMismatch(
                f"another vit22b embed (host {who.get('host')}, pid {who.get('pid')}) "
                f"has written to {self.directory} since this job did: an object store has no "
                "lock, run one job per output; this one stops (rerun it once the other ends)")

    def _write_errors(self) -> None:
        rows = [{**row, "shard": index} for index in sorted(self._failed)
                for row in self._failed[index]]
        blob = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows).encode()
        self.where.write_bytes(ERRORS, blob)

    def _write_manifest(self, final: bool = False) -> None:
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
        } | ({} if final else {"writer": self._writer})
        self.where.write_bytes(MANIFEST, json_bytes(manifest))

    def finish(self) -> None:
        """Write errors.jsonl (possibly empty) so a finished job always has one, and the
        manifest without a writer."""
        with self._lock:
            self._write(final=True)
        self.close()


def _not_a_folder(directory: str, err: OSError) -> OutputsError:
    return OutputsError(f"output {directory}: cannot be a folder of outputs: "
                        f"{err.strerror or err} ({err.filename or directory})")
