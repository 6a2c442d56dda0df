"""Checkpoints: orbax arrays plus a small metadata file, restored straight into a mesh's shardings.

A checkpoint is a directory::

    metadata.json   config, preprocessing contract and its hash, weights fingerprint, source,
                    and every parameter's shape and dtype
    params/         the orbax PyTree checkpoint of the parameter tree
    head.npz        the classifier (kernel [d, C], bias [C]) when the model has one, for the probes

``metadata.json`` is written last, so a save that died half-way is refused as incomplete.
Restoring builds an abstract tree (shape, dtype and target sharding per parameter) and lets orbax
read each device's slice straight into place: no parameter is ever whole on the host or on one
device unless its sharding says so. Every mismatch is reported by parameter path with both shapes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import stat
import sys
import threading
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import Mesh

from .config import ConfigError, ViTConfig
from .errors import file_kind, odd_entry
from .sharding import check_host_memory, check_mesh_fits, param_shardings
from .vit import abstract_params

FORMAT_VERSION = 1
# Bytes being read at once during a restore. Orbax's default lets every read start together, and
# the transient buffers then add about half the checkpoint to the peak resident memory; a quarter
# of a gigabyte keeps the peak near the weights' own size and was no slower here
# (benchmarks/restore.py).
RESTORE_CONCURRENT_GB = 0.25
METADATA_FILE = "metadata.json"
PARAMS_DIR = "params"
HEAD_FILE = "head.npz"
ORBAX_TMP = PARAMS_DIR + ".orbax-checkpoint-tmp"  # where orbax writes the params folder first
MAX_METADATA_BYTES = 64 << 20  # a 22B model's is about 40 KB
# Architecture fields that may differ between an expected config and a checkpoint's.
_NOT_ARCHITECTURE = ("name", "compute_dtype", "preprocess", "posemb_resample")

Shapes = dict[str, tuple[tuple[int, ...], str]]  # parameter path -> (shape, dtype name)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the expected model."""


@dataclass(frozen=True)
class CheckpointMeta:
    config: ViTConfig
    fingerprint: str  # of the weights: sha256 prefix, the same on every mesh and after restore
    source: str  # "init:seed=0", "timm:vit_base_patch16_224", "hf:...", "big_vision:..."
    format_version: int = FORMAT_VERSION
    created: str = ""  # UTC, ISO 8601
    param_count: int = 0
    param_bytes: int = 0
    shapes: Shapes = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what an import did beyond renaming (folded, zero-filled, dropped)

    @property
    def preprocess_hash(self) -> str:
        return self.config.preprocess_hash()

    @property
    def has_classifier(self) -> bool:
        return self.config.num_classes > 0

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "source": self.source,
            "fingerprint": self.fingerprint,
            "created": self.created,
            "config": self.config.to_dict(),
            "preprocess_hash": self.preprocess_hash,
            "param_count": self.param_count,
            "param_bytes": self.param_bytes,
            "classifier": {"num_classes": self.config.num_classes, "file": HEAD_FILE}
            if self.has_classifier
            else None,
            "notes": list(self.notes),
            "parameters": {
                path: {"shape": list(shape), "dtype": dtype}
                for path, (shape, dtype) in self.shapes.items()
            },
        }

    @classmethod
    def from_dict(cls, d: dict) -> CheckpointMeta:
        return cls(
            config=ViTConfig.from_dict(d["config"]),
            fingerprint=str(d["fingerprint"]),
            source=str(d["source"]),
            format_version=int(d["format_version"]),
            created=str(d.get("created", "")),
            param_count=int(d.get("param_count", 0)),
            param_bytes=int(d.get("param_bytes", 0)),
            shapes={
                path: (tuple(int(n) for n in p["shape"]), str(p["dtype"]))
                for path, p in d.get("parameters", {}).items()
            },
            notes=tuple(d.get("notes", ())),
        )


# ------------------------------------------------------------------------------------------
# parameter trees as flat {path: leaf}
# ------------------------------------------------------------------------------------------


def flatten(tree, prefix: str = "") -> dict:
    """``{'block_0/w_in': leaf, ...}`` for a nested dict of parameters, sorted by path."""
    flat = {}
    for key in sorted(tree):
        path = f"{prefix}{key}"
        value = tree[key]
        if isinstance(value, dict):
            flat.update(flatten(value, path + "/"))
        else:
            flat[path] = value
    return flat


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, leaf in flat.items():
        *scopes, name = path.split("/")
        node = tree
        for scope in scopes:
            node = node.setdefault(scope, {})
        node[name] = leaf
    return tree


def shapes_of(tree) -> Shapes:
    return {
        path: (tuple(int(n) for n in leaf.shape), np.dtype(leaf.dtype).name)
        for path, leaf in flatten(tree).items()
    }


def shape_problems(
    expected: Shapes, actual: Shapes, expected_name: str, actual_name: str, dtypes: bool = True
) -> list[str]:
    """One line per parameter that is missing, unexpected, mis-shaped (or of another dtype)."""
    problems = []
    for path in sorted(set(expected) | set(actual)):
        want, got = expected.get(path), actual.get(path)
        if got is None:
            problems.append(
                f"parameter {path}: missing from {actual_name} ({expected_name} expects shape "
                f"{want[0]})"
            )
        elif want is None:
            problems.append(
                f"parameter {path}: {actual_name} has shape {got[0]}, {expected_name} has no "
                "such parameter"
            )
        elif want[0] != got[0]:
            problems.append(
                f"parameter {path}: {actual_name} has shape {got[0]}, {expected_name} expects "
                f"{want[0]}"
            )
        elif dtypes and want[1] != got[1]:
            problems.append(
                f"parameter {path}: {actual_name} has dtype {got[1]}, {expected_name} expects "
                f"{want[1]} (shape {want[0]})"
            )
    return problems


def format_problems(problems: list[str], context: str, limit: int = 12) -> str:
    more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"{context}:\n  " + "\n  ".join(problems[:limit]) + more


def _raise(problems: list[str], context: str) -> None:
    if problems:
        raise CheckpointError(format_problems(problems, context))


def expected_shapes(cfg: ViTConfig) -> Shapes:
    return shapes_of(abstract_params(cfg))


# ------------------------------------------------------------------------------------------
# fingerprint
# ------------------------------------------------------------------------------------------


def _host_copy(leaf) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        leaf = multihost_utils.process_allgather(leaf, tiled=True)
    return np.ascontiguousarray(jax.device_get(leaf))


def fingerprint(params) -> str:
    """sha256 (first 16 hex digits) over every parameter's path, dtype, shape and bytes.

    Independent of the mesh: each parameter is gathered to the host whole, one at a time.
    """
    digest = hashlib.sha256()
    for path, leaf in flatten(params).items():
        array = _host_copy(leaf)
        digest.update(f"{path}|{array.dtype.name}|{array.shape};".encode())
        digest.update(array.reshape(-1).view(np.uint8))
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------


def _checkpointer(restore_concurrent_gb: float | None = None) -> ocp.Checkpointer:
    # Replica-parallel saving splits each replicated array across its replicas with one jitted
    # slice per array (seconds of compiling for nothing on a few hosts): replica 0 writes instead.
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
    )
    handler = ocp.PyTreeCheckpointHandler(
        type_handler_registry=registry, restore_concurrent_gb=restore_concurrent_gb
    )
    return ocp.Checkpointer(handler)


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _staging(path: Path) -> Path:
    """Where a save is written before it takes ``path``'s place: beside it (one filesystem, so
    the move is a rename), hidden, named for it."""
    return path.with_name(f".{path.name}.saving")


def _remove_for_good(folder: Path, settle_s: float = 0.1, limit_s: float = 5.0) -> None:
    """Remove a failed save's folder and keep it removed. orbax stops awaiting a save at its
    first failed write, but the other writes run on in tensorstore's threads and can land
    during or after a first removal (recreating their parent folders); so remove until the
    folder has stayed gone for ``settle_s``, for ``limit_s`` at most."""
    end = time.monotonic() + limit_s
    while True:
        shutil.rmtree(folder, ignore_errors=True)
        time.sleep(settle_s)
        if not folder.exists() or time.monotonic() > end:
            return


def _disk_error(err: BaseException, path: Path) -> OSError | None:
    """A failed write as an OSError naming the checkpoint, not the folder it was written in:
    the disk's own, or tensorstore's (orbax raises it as a ValueError carrying the OS error,
    e.g. "RESOURCE_EXHAUSTED: ... [os_error_code='28']" on a full disk)."""
    if isinstance(err, OSError) and err.errno:
        return OSError(err.errno, err.strerror, str(path))
    found = re.search(r"os_error_code='?(\d+)", str(err)) if isinstance(err, ValueError) else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def check_writable(path, overwrite: bool = False) -> bool:
    """Whether a checkpoint is already at ``path`` (to be replaced); refuses what must not be."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a folder; a checkpoint is one")
    if not path.exists() or not any(path.iterdir()):
        return False
    if not overwrite:
        raise CheckpointError(f"{path} already exists and is not empty (overwrite to replace)")
    if not any(entry.name in (METADATA_FILE, PARAMS_DIR) or entry.name.startswith(ORBAX_TMP)
               for entry in path.iterdir()):  # orbax's: a save into it that did not finish
        raise CheckpointError(f"{path} is not a checkpoint directory; refusing to replace it")
    return True


def save(
    path,
    cfg: ViTConfig,
    params,
    source: str,
    *,
    notes: tuple[str, ...] = (),
    overwrite: bool = False,
) -> CheckpointMeta:
    """Write ``params`` (host or sharded arrays) with their metadata; returns the metadata.

    The checkpoint is written beside ``path`` (``_staging``) and renamed into place when whole:
    a save that fails leaves no partial checkpoint at ``path``, and one that replaces another
    (``overwrite``) leaves the other as it was; a failed write is an OSError naming ``path``.
    Replacing needs the disk space of both until the new one is in place."""
    path = Path(path).absolute()
    shapes = shapes_of(params)
    _raise(
        shape_problems(expected_shapes(cfg), shapes, f"config {cfg.name}", "the parameter tree"),
        f"cannot save a checkpoint of {cfg.name}: the parameters do not fit the config",
    )
    replacing = check_writable(path, overwrite)
    staging = _staging(path)
    primary = jax.process_index() == 0
    try:
        if primary:
            shutil.rmtree(staging, ignore_errors=True)  # what a save that failed left
            staging.mkdir(parents=True)
        meta = _write(staging, cfg, params, source, notes, shapes, primary)
    except BaseException as err:
        if primary:  # give its space back
            _remove_for_good(staging)
        disk = _disk_error(err, path)
        if disk is None:
            raise
        raise disk from None
    if primary:
        _take_place(staging, path, replacing)
    return meta


def _write(folder: Path, cfg: ViTConfig, params, source: str, notes: tuple[str, ...],
           shapes: dict, primary: bool) -> CheckpointMeta:
    with _quiet_orbax():  # a failed write's tracebacks: save's OSError says it
        _checkpointer().save(folder / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
    meta = CheckpointMeta(
        config=cfg,
        fingerprint=fingerprint(params),
        source=source,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        param_count=sum(int(np.prod(s)) for s, _ in shapes.values()),
        param_bytes=sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes.values()),
        shapes=shapes,
        notes=tuple(notes),
    )
    if primary:
        if cfg.num_classes:
            np.savez(
                folder / HEAD_FILE,
                kernel=_host_copy(params["classifier"]),
                bias=_host_copy(params["classifier_bias"]),
            )
        _write_json_atomic(folder / METADATA_FILE, meta.to_dict())
    return meta


def _take_place(staging: Path, path: Path, replacing: bool) -> None:
    """Move a finished save to ``path``; the checkpoint it replaces goes only once the new one
    is whole, so a save that fails (a full disk) leaves the old one as it was."""
    old = path.with_name(f".{path.name}.replaced")
    if replacing:
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(staging, path)  # over an empty folder, or none
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# read and restore
# ------------------------------------------------------------------------------------------


def read_metadata(path) -> CheckpointMeta:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: "
                              + ("not a directory" if path.exists() else "no such directory"))
    meta_file = path / METADATA_FILE
    if not meta_file.exists():
        raise CheckpointError(
            f"{path} has no {METADATA_FILE}: not a vit22b checkpoint, or a save that did not finish"
        )
    info = meta_file.stat()
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read for ever
        raise CheckpointError(f"{meta_file} is {file_kind(info.st_mode)}, not a regular file")
    size = info.st_size
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{meta_file} is unreadable: {size} bytes, over the "
                              f"{MAX_METADATA_BYTES} a checkpoint's metadata may hold")
    try:
        payload = json.loads(meta_file.read_text())
        if not isinstance(payload, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
                    float: "a number"}.get(type(payload), "null")
            raise CheckpointError(f"{meta_file} is unreadable: it holds {kind}, not a JSON "
                                  "object")
        if "format_version" not in payload:
            raise CheckpointError(f"{meta_file} is unreadable: no format_version (not a vit22b "
                                  "checkpoint's metadata)")
        version = int(payload["format_version"])
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{meta_file}: format version {version} is newer than this code's "
                f"({FORMAT_VERSION}); upgrade vit22b"
            )
        return CheckpointMeta.from_dict(payload)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, ConfigError) as err:
        raise CheckpointError(f"{meta_file} is unreadable: {type(err).__name__}: {err}") from err


def check_compatible(expect: ViTConfig, cfg: ViTConfig, where: str = "the checkpoint") -> None:
    """Refuse a checkpoint of another architecture than ``expect``: by parameter, then by field."""
    _raise(
        shape_problems(
            expected_shapes(expect), expected_shapes(cfg), f"model {expect.name}", where
        ),
        f"{where} ({cfg.name}) does not fit model {expect.name}",
    )
    differing = [
        f"{f.name}: {where} has {getattr(cfg, f.name)!r}, {expect.name} has "
        f"{getattr(expect, f.name)!r}"
        for f in dataclasses.fields(ViTConfig)
        if f.name not in _NOT_ARCHITECTURE and getattr(cfg, f.name) != getattr(expect, f.name)
    ]
    _raise(differing, f"{where} ({cfg.name}) is a different architecture from {expect.name}")


def stored_shapes(path) -> Shapes:
    """Shapes and dtypes of the arrays orbax actually stored (its own metadata)."""
    params_dir = Path(path) / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointError(f"{path} has no {PARAMS_DIR}/ directory: the weights are missing")
    _check_entries(params_dir)
    unreadable = f"{params_dir}: the weights' index is unreadable (truncated or corrupt)"
    _check_index(params_dir, unreadable)
    try:
        with _quiet_orbax():  # a damaged index is a warning and a closed loop's traceback
            item = _checkpointer().metadata(params_dir.absolute()).item_metadata
    except Exception as err:  # orbax raises many kinds; the message is what matters
        raise CheckpointError(f"{unreadable}: {_first_line(err)}") from err
    if item is None or item.tree is None:  # orbax logs the failure and returns nothing
        raise CheckpointError(f"{unreadable}: orbax read no array metadata from it")
    return shapes_of(item.tree)


def _check_index(params_dir: Path, unreadable: str) -> None:
    """Read the OCDBT index (its manifest and tree nodes carry checksums) and every array's
    metadata synchronously, before orbax does: orbax reads them in one gather, and when one read
    fails it closes its event loop under the others, whose ends then print a traceback each for
    up to a second after the refusal."""
    if not (params_dir / "manifest.ocdbt").is_file():  # not orbax's OCDBT layout: orbax decides
        return
    try:
        base = {"driver": "file", "path": f"{params_dir.absolute()}{os.sep}"}
        store = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
        for key in store.list().result():
            if key.rsplit(b"/", 1)[-1] in (b".zarray", b"zarr.json"):
                json.loads(store.read(key).result().value)
    except Exception as err:  # tensorstore's errors are ValueErrors; a bad JSON value too
        raise CheckpointError(f"{unreadable}: {_first_line(err)}") from err


def _check_entries(params_dir: Path) -> None:
    """Every entry under ``params/`` a folder or a regular file (orbax opens each it meets)."""
    problem = odd_entry(params_dir)
    if problem:
        raise CheckpointError(f"{problem}: refused unread")


def abstract_target(cfg: ViTConfig, mesh: Mesh) -> dict:
    """Shape, dtype and target sharding of every parameter: what restore fills in."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_params(cfg),
        param_shardings(cfg, mesh),
    )


def _orbax_restore(params_dir: Path, target: dict, partial: bool = False) -> dict:
    args = ocp.args.PyTreeRestore(
        target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=partial,
    )
    return _checkpointer(RESTORE_CONCURRENT_GB).restore(params_dir, args=args)


def _first_line(err: BaseException) -> str:
    """The innermost cause's first line: orbax wraps tensorstore's precise message."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


@contextlib.contextmanager
def _quiet_orbax():
    """What failed restores and saves print held back, so that the refusal is what a user reads:
    orbax's INFO lines (about twenty per restore, through absl's logger: one restore per
    parameter made hundreds), and the reads a failed restore abandons, which report as they
    finish on its closed event loop (tensorstore's threads print a traceback each, through
    ``sys.stderr`` to file descriptor 2, held back here: nothing else runs while a checkpoint is
    being restored) or when
    collected unfinished (orbax's coroutines and tasks, through ``sys.unraisablehook`` and
    asyncio's logger, at any later time: those filters stay). Unchecked, up to two thousand
    lines of tracebacks about nothing a user can act on."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    if not getattr(sys.unraisablehook, "drops_orbax_reads", False):
        sys.unraisablehook = _dropping_orbax_reads(sys.unraisablehook)
        logging.getLogger("asyncio").addFilter(_not_an_orbax_read)
        atexit.register(_close_abandoned_coroutines)
    sys.stderr.flush()
    stderr, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(devnull)
        logger.setLevel(level)


class _NativeThreadsMuted:
    """``sys.stderr`` for the length of a restore: what threads Python did not start write is
    dropped. Those are tensorstore's, and what they write there is the tracebacks of reads a
    failed restore abandoned, as each ends on orbax's closed event loop: they print as the
    first read fails, before ``_quiet_orbax`` can start (about every other refusal of a
    checkpoint whose data files were damaged printed one or two)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        if isinstance(threading.current_thread(), threading._DummyThread):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _native_threads_muted():
    stream = sys.stderr
    sys.stderr = _NativeThreadsMuted(stream)
    try:
        yield
    finally:
        sys.stderr = stream


_ORBAX = f"{os.sep}orbax{os.sep}"  # in the paths of orbax's modules


def _not_an_orbax_read(record: logging.LogRecord) -> bool:
    """asyncio's report of a task or future (of any kind: a gather's too) collected with its
    exception unread: not for a read an earlier, failed restore abandoned. Such a report names
    orbax's coroutine (a task), or tensorstore's error on the checkpoint's OCDBT database (a
    bare future), or carries a traceback through orbax's modules (a gather)."""
    message = record.getMessage()
    if not message.partition("\n")[0].endswith("exception was never retrieved"):
        return True
    error = record.exc_info[1] if record.exc_info else None
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    return not (_ORBAX in message or " in OCDBT database at " in message
                or any(_ORBAX in frame.filename for frame in frames))


def _close_abandoned_coroutines() -> None:
    """Close the reads and writes a failed restore or save created and never started: collected
    at exit, each printed "RuntimeWarning: coroutine '...' was never awaited" after the refusal
    (past any warnings filter: they are said as the interpreter shuts down)."""
    for obj in gc.get_objects():  # type(), not isinstance: no object's __class__ is asked
        if type(obj) is types.CoroutineType and _ORBAX in obj.cr_code.co_filename and \
                inspect.getcoroutinestate(obj) == inspect.CORO_CREATED:
            obj.close()


def _dropping_orbax_reads(previous):
    def hook(unraisable) -> None:
        target = unraisable.object
        if inspect.iscoroutine(target) and _ORBAX in target.cr_code.co_filename:
            return  # a read an earlier, failed restore abandoned
        if target is None and isinstance(unraisable.exc_value, RuntimeError) and str(
                unraisable.exc_value) == "Event loop is closed":
            return  # tensorstore's callback of a write a failed save abandoned, on orbax's loop
        previous(unraisable)

    hook.drops_orbax_reads = True
    return hook


def _unreadable(params_dir: Path, target: dict, err: Exception) -> CheckpointError:
    """After a failed restore, find which parameters cannot be read (one at a time)."""
    flat = flatten(target)
    bad = []
    with _quiet_orbax():
        for path, leaf in flat.items():
            try:
                jax.block_until_ready(_orbax_restore(params_dir, unflatten({path: leaf}), True))
            except Exception as leaf_err:
                bad.append(
                    f"parameter {path} (shape {tuple(leaf.shape)}, "
                    f"{np.dtype(leaf.dtype).name}): stored data is unreadable, truncated or "
                    f"corrupt: {_first_line(leaf_err)}"
                )
    context = f"checkpoint {params_dir.parent} cannot be restored"
    return CheckpointError(format_problems(bad or [_first_line(err)], context))


def restore(
    path, mesh: Mesh, *, expect: ViTConfig | None = None, verify: bool = False
) -> tuple[ViTConfig, dict, CheckpointMeta]:
    """Config, parameters (in ``sharding`` rules' shardings on ``mesh``) and metadata.

    ``expect``: refuse a checkpoint of any other architecture. ``verify``: recompute the
    fingerprint (reads every parameter back to the host once) and compare it with the metadata.
    """
    path = Path(path).absolute()
    meta = read_metadata(path)
    cfg = meta.config
    if expect is not None:
        check_compatible(expect, cfg)
    want = expected_shapes(cfg)
    if meta.shapes:
        _raise(
            shape_problems(want, meta.shapes, f"config {cfg.name}", METADATA_FILE),
            f"checkpoint {path} is inconsistent",
        )
    _raise(
        shape_problems(want, stored_shapes(path), f"config {cfg.name}", "the stored checkpoint"),
        f"checkpoint {path} does not match its config",
    )
    check_mesh_fits(cfg, mesh)
    check_host_memory(cfg, mesh)
    target = abstract_target(cfg, mesh)
    params_dir = path / PARAMS_DIR
    with _native_threads_muted():
        try:
            params = jax.block_until_ready(_orbax_restore(params_dir, target))
        except Exception as err:
            raise _unreadable(params_dir, target, err) from err
    if verify:
        actual = fingerprint(params)
        if actual != meta.fingerprint:
            raise CheckpointError(
                f"checkpoint {path}: the weights' fingerprint is {actual}, the metadata says "
                f"{meta.fingerprint}: the weights were modified or corrupted"
            )
    return cfg, params, meta
