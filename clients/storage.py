"""Where the batch job reads and writes: local paths, or URLs of any fsspec filesystem.

``s3://bucket/key``, ``gs://bucket/key``, ``memory://...`` and the other fsspec protocols go
through fsspec (``pip install 'vit22b[storage]'`` brings fsspec, s3fs and gcsfs),
with credentials from the usual environment of each (for S3: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL_S3`` ...; for GCS: application
default credentials). ``file://`` URLs and plain paths are the local disk, through ``os``.

Atomicity differs by kind, and the job relies on nothing more than this:
- local: a file is written to a temp name, fsynced and renamed over its final name, so a reader
  sees the old file or the new one; an flock on ``.lock`` keeps a second job out;
- object stores: an object is written once under its final key (a PUT replaces an object whole:
  readers see the old object or the new one, never a part), and the manifest last. There is no
  rename and no lock there: run one job per output at a time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import inspect
import io
import os
import threading
from collections.abc import Callable
from typing import BinaryIO

from .files import open_local, over_limit, read_local, regular

TEMP_MARK = ".tmp-"
FILE_SCHEME = "file://"


def is_url(path: str) -> bool:
    """A path with a protocol other than file:// (those go through fsspec)."""
    return "://" in path and not path.startswith(FILE_SCHEME)


def local_path(path: str) -> str:
    return path[len(FILE_SCHEME):] if path.startswith(FILE_SCHEME) else path


def check_url(url: str) -> str:
    """``url``, or ValueError when an empty segment ('//') is in its path: an object store
    keeps it in its keys (``s3://b//x`` is the key ``/x``), which its listings do not show, so
    an output there would never resume."""
    scheme, _, rest = url.partition("://")
    if "//" in rest.strip("/"):
        raise ValueError(f"{url}: an empty segment ('//') in the URL's path: write each "
                         "folder once")
    return url


def filesystem(url: str):
    """(fsspec filesystem, path within it) of a URL; a clear error when fsspec is missing. The
    filesystem's calls have the store's deadline (``Deadlined``)."""
    try:
        from fsspec.core import url_to_fs
    except ModuleNotFoundError:
        raise ValueError(f"{url}: remote storage needs fsspec: pip install 'vit22b[storage]'") \
            from None
    try:
        fs, inner = url_to_fs(url)
    except (ImportError, ValueError) as err:  # e.g. s3fs or gcsfs not installed: fsspec says so
        raise ValueError(f"{url}: {err}") from None
    return Deadlined(fs), inner


# A remote call's deadline: an endpoint that accepts and never answers stalls a call for many
# minutes in the storage libraries' own retries (a listing: over 5 minutes, nothing said). Within
# it: a read of 1 GiB at 1.8 MB/s; a listing of 3 million keys if a request of 1,000 takes 0.2 s.
STORE_TIMEOUT_S = 600


class Deadlined:
    """An fsspec filesystem whose calls on an asynchronous one (s3fs, gcsfs) end within
    STORE_TIMEOUT_S: missed, the call is cancelled on the filesystem's loop and raises
    TimeoutError (an OSError: that file's failure, or the listing's). A synchronous
    filesystem's calls (local, memory) go straight through, as do the files ``open`` gives (a
    shard streamed to the store: its library's own timeouts); ``open_read`` reads with it."""

    def __init__(self, fs):
        self.fs = fs
        self.asynchronous = bool(getattr(fs, "async_impl", False)) and \
            getattr(fs, "loop", None) is not None

    def __getattr__(self, name: str):
        if name == "fs":  # not set yet (a copy or an unpickling): no recursion through it
            raise AttributeError(name)
        method = getattr(self.fs, name)
        coroutine = getattr(self.fs, f"_{name}", None)
        if self.asynchronous and inspect.iscoroutinefunction(coroutine):
            return functools.partial(self.run, coroutine)
        return method

    def open_read(self, inner: str) -> BinaryIO:
        """The object opened for reading, seekable: on an asynchronous filesystem, read in
        blocks of READ_BLOCK, each within the deadline (a video's ranged reads, an output's
        arrays); else the filesystem's own file."""
        if not self.asynchronous:
            return self.fs.open(inner, "rb")
        return io.BufferedReader(_Ranges(self, inner), buffer_size=READ_BLOCK)

    def run(self, coroutine, *args, **kwargs):
        """``coroutine(*args, **kwargs)`` on the filesystem's loop within STORE_TIMEOUT_S;
        TimeoutError naming the call's path (its first text argument) when missed."""
        from fsspec.asyn import FSTimeoutError, sync

        try:
            return sync(self.fs.loop, coroutine, *args, timeout=STORE_TIMEOUT_S, **kwargs)
        except FSTimeoutError:
            path = next((self.fs.unstrip_protocol(a) for a in args if isinstance(a, str)), None)
            raise TimeoutError(errno.ETIMEDOUT, f"no answer within {STORE_TIMEOUT_S} s from "
                               "the store", path) from None


READ_BLOCK = 8 << 20  # bytes a seekable remote file asks for at once (S3 advises 8-16 MB ranges)


class _Ranges(io.RawIOBase):
    """An object read by byte ranges, each request within the store's deadline."""

    def __init__(self, fs: Deadlined, inner: str):
        self.fs, self.inner, self.pos = fs, inner, 0
        self.size = fs.size(inner)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self.pos = base + offset
        return self.pos

    def readinto(self, buffer) -> int:
        # at most a block a request, so that each has the deadline's worth of time (a large
        # read, an output's array, is many; the buffered reader asks until it has them all)
        end = min(self.pos + len(buffer), self.pos + READ_BLOCK, self.size)
        if end <= self.pos:
            return 0
        data = self.fs.run(self.fs.fs._cat_file, self.inner, start=self.pos, end=end)
        memoryview(buffer)[:len(data)] = data
        self.pos += len(data)
        return len(data)


# The storage libraries fsspec drives raise their own errors for what is the environment's
# fault, not a bug: missing or refused credentials, an endpoint that is not there. Each with
# where its credentials come from.
_S3 = "S3 reads AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
_GCS = "GCS reads application default credentials (GOOGLE_APPLICATION_CREDENTIALS)"
STORAGE_LIBRARIES = {"botocore": _S3, "aiobotocore": _S3, "s3fs": _S3, "gcsfs": _GCS,
                     "google": _GCS}


def storage_failure(err: BaseException) -> str | None:
    """A storage library's own failure (credentials, endpoint) as one line; None for anything
    else (a bug stays a traceback)."""
    library = type(err).__module__.split(".")[0]
    if isinstance(err, OSError) or library not in STORAGE_LIBRARIES:
        return None
    hint = f" ({STORAGE_LIBRARIES[library]})" if "redential" in f"{type(err).__name__}{err}" \
        else ""
    return f"remote storage: {type(err).__name__}: {err}{hint}"


def read_bytes(path: str, max_bytes: int | None = None) -> bytes:
    """The whole file at a local path or URL, if a regular file of at most ``max_bytes``
    (OSError, with its reason, when unreadable or over it)."""
    if not is_url(path):
        return read_local(local_path(path), max_bytes)
    fs, inner = filesystem(path)
    with _reasons(path):
        data = _within(fs, inner, None if max_bytes is None else max_bytes + 1)
    over_limit(len(data), max_bytes, path)
    return data


def _within(fs, inner: str, end: int | None) -> bytes:
    """The object's bytes up to ``end`` (None: all), within the store's deadline."""
    if end is None:
        return fs.cat_file(inner)
    if not fs.asynchronous:
        return fs.cat_file(inner, start=0, end=end)
    return fs.run(_ranged_async, fs.fs, inner, end)


def check_readable(path: str, max_bytes: int | None = None) -> None:
    """OSError, as ``read_bytes`` would raise it, unless the file at a local path or URL is a
    regular file of at most ``max_bytes`` whose first byte can be read (the rest is not read)."""
    read_head(path, 1, max_bytes)


def read_head(path: str, size: int, max_bytes: int | None = None) -> bytes:
    """The first ``size`` bytes of the file at a local path or URL (the rest is not read), if a
    regular file of at most ``max_bytes``; OSError as ``read_bytes`` would raise it."""
    if not is_url(path):
        with open_local(local_path(path), max_bytes) as f:
            return f.read(size)
    fs, inner = filesystem(path)
    with _reasons(path):
        over_limit(fs.size(inner), max_bytes, path)
        return _within(fs, inner, size)[:size]


@contextlib.contextmanager
def _reasons(path: str):
    """A remote store's FileNotFoundError / PermissionError, which carry only the path, with
    the reason a local file's would give."""
    try:
        yield
    except (FileNotFoundError, PermissionError) as err:
        if err.strerror is not None:
            raise
        code = errno.ENOENT if isinstance(err, FileNotFoundError) else errno.EACCES
        raise type(err)(code, os.strerror(code), path) from None


async def _ranged_async(fs, inner: str, end: int) -> bytes:
    """The object's first ``end`` bytes (the limit and one more: never more than one byte
    over), on the filesystem's event loop. S3 refuses any range of an empty object (416, an
    OSError), which its size then tells apart."""
    try:
        return await fs._cat_file(inner, start=0, end=end)
    except (FileNotFoundError, PermissionError):
        raise
    except OSError:
        if await fs._size(inner) == 0:
            return b""
        raise


class HashingWriter:
    """File wrapper that hashes what passes through (np.save and pyarrow write in chunks)."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.digest = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self.f.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> str:
    """Write local ``path`` via a temp file + fsync + rename, whole or not at all; returns the
    sha256 written. A failed write is an OSError naming ``path``."""
    tmp = f"{path}{TEMP_MARK}{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            writer = HashingWriter(f)
            write(writer)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(err, OSError) and err.errno:  # ENOSPC names no file, EROFS the temporary
            raise OSError(err.errno, err.strerror, path) from None
        raise
    return writer.digest.hexdigest()


class Location:
    """A folder on the local disk or in an fsspec filesystem; every path is relative to it.

    Picklable (Ray workers write shards through it): an fsspec filesystem pickles as its
    settings. ``memory://`` lives in one process, so it suits the in-process runner only.
    """

    def __init__(self, url: str):
        self.remote = is_url(url)
        scheme, sep, rest = url.partition("://")
        if sep and not rest.strip("/"):  # "s3://" was a local folder "s3:"
            raise ValueError(f"{url}: the URL names no bucket or folder after {scheme}://")
        if self.remote:
            check_url(url)
        self.url = url.rstrip("/") or url
        if self.remote:
            self.fs, self.root = filesystem(self.url)
        else:
            self.fs, self.root = None, local_path(self.url)
        self._lock_file: BinaryIO | None = None

    def __getstate__(self):
        return {"url": self.url}

    def __setstate__(self, state):
        self.__init__(state["url"])

    def __str__(self) -> str:
        return self.url

    def path(self, rel: str = "") -> str:
        """The full path (local) or URL (remote) of ``rel``, as messages name it."""
        if not rel:
            return self.url
        return f"{self.url}/{rel}" if self.remote else os.path.join(self.root, rel)

    def _inner(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def local_file(self, rel: str) -> str | None:
        """The file's path on the local disk (to memory-map it), or None for remote storage;
        OSError unless it is a regular file (a FIFO would block the mapping for ever)."""
        if self.remote:
            return None
        path = os.path.join(self.root, rel)
        regular(os.stat(path), path)
        return path

    def makedirs(self, rel: str = "") -> None:
        if self.remote:
            self.fs.makedirs(self._inner(rel), exist_ok=True)  # a no-op on object stores
        else:
            os.makedirs(os.path.join(self.root, rel), exist_ok=True)

    def exists(self, rel: str) -> bool:
        if self.remote:
            return self.fs.exists(self._inner(rel))
        return os.path.exists(os.path.join(self.root, rel))

    def files(self, rel: str = "") -> set[str]:
        """Names of the files directly in folder ``rel`` (one listing: cheap on object stores)."""
        if not self.remote:
            folder = os.path.join(self.root, rel)
            return set(os.listdir(folder)) if os.path.isdir(folder) else set()
        try:
            listing = self.fs.ls(self._inner(rel), detail=True, refresh=True)
        except FileNotFoundError:
            return set()
        return {os.path.basename(e["name"].rstrip("/")) for e in listing if e["type"] == "file"}

    def read(self, rel: str) -> bytes:
        if self.remote:
            return self.fs.cat_file(self._inner(rel))
        return read_local(os.path.join(self.root, rel))

    def open(self, rel: str) -> BinaryIO:
        """A binary file opened for reading (pyarrow and np.load take it)."""
        if self.remote:
            return self.fs.open_read(self._inner(rel))
        return open_local(os.path.join(self.root, rel))

    def remove(self, rel: str) -> None:
        if self.remote:
            with _reasons(self.path(rel)):
                self.fs.rm_file(self._inner(rel))
        else:
            os.remove(os.path.join(self.root, rel))

    def write(self, rel: str, write: Callable[[BinaryIO], None]) -> str:
        """Write file ``rel`` whole (see the module's note on atomicity); returns its sha256."""
        if not self.remote:
            return atomic_write(os.path.join(self.root, rel), write)
        with _reasons(self.path(rel)), self.fs.open(self._inner(rel), "wb") as f:
            writer = HashingWriter(f)
            write(writer)  # type: ignore[arg-type]
        return writer.digest.hexdigest()

    def write_bytes(self, rel: str, blob: bytes) -> str:
        """Write file ``rel`` whole from memory (the manifest, errors.jsonl): on a store, one
        call within the store's deadline; returns its sha256."""
        if not self.remote:
            return self.write(rel, lambda f: f.write(blob))
        with _reasons(self.path(rel)):  # a store's refusal names no object
            self.fs.pipe_file(self._inner(rel), blob)
        return hashlib.sha256(blob).hexdigest()

    def remove_temp_files(self, *folders: str) -> None:
        """Temp files a killed local writer left behind (object stores have none)."""
        if self.remote:
            return
        for folder in folders:
            for name in self.files(folder):
                if TEMP_MARK in name:
                    self.remove(f"{folder}/{name}" if folder else name)

    def lock(self, rel: str) -> bool:
        """Take an exclusive flock on local file ``rel``; False if another process holds it.
        Object stores have no locks: always True there."""
        if self.remote:
            return True
        path = os.path.join(self.root, rel)
        if os.path.lexists(path):  # a FIFO's open for writing waits for a reader for ever
            regular(os.stat(path), path)
        self._lock_file = open(path, "ab")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.unlock()
            return False
        return True

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None
