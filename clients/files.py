"""Reading a local file the way every input is read: only a regular file, and within a size.

A FIFO among the inputs would block its reader for ever and a device (/dev/zero) never end: both
are refused unread, as is a file over the caller's limit (OSError, its reason said, so a job
records it as that input's failure).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

from vit22b.model.errors import file_kind

# An image file read whole (a 40-megapixel, 16-bit RGBA TIFF is 320 MB); a larger one, e.g. a
# video in a folder of photos, is a failure read no further.
MAX_IMAGE_BYTES = 1 << 30
READ_FAILURE = "cannot read file: "  # a failure to read a file, not to decode it


def os_reason(err: OSError) -> str:
    """An input's failure to be read, as a job records it (a rerun retries those)."""
    return f"{READ_FAILURE}{err.strerror or err}"


def regular(info: os.stat_result, path: str) -> os.stat_result:
    """``info`` if it is a regular file's, else OSError naming what it is."""
    if not stat.S_ISREG(info.st_mode):
        raise OSError(errno.EINVAL, f"not a regular file: {file_kind(info.st_mode)}", path)
    return info


def as_text(name: str) -> str:
    """A file name as text the outputs and the wire can hold (JSON, Parquet, protobuf want
    UTF-8): a name whose bytes are not UTF-8 reaches Python with each such byte as a lone
    surrogate; here that byte is written ``\\xNN`` instead (``bad\\xffname.jpg``)."""
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate no file system decoding made
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def hidden(name: str) -> bool:
    """A hidden file or folder name, which a folder's walk leaves out (the batch job's and the
    probes'): ``.DS_Store``, ``.thumbnails``, and macOS's ``._IMG_0001.HEIC`` copies of a
    file's metadata, named as the image and holding none."""
    return name.startswith(".")


def usable(path: str) -> str:
    """``path``, or OSError if no file can have it: a NUL byte (a list file's line, say), for
    which os functions raise ValueError, would end a job instead of failing its input."""
    if "\0" in path:
        raise OSError(errno.EINVAL, "a path with a NUL byte names no file", path)
    return path


def over_limit(size: int, max_bytes: int | None, path: str) -> None:
    if max_bytes is not None and size > max_bytes:
        raise OSError(errno.EFBIG, f"{size} bytes, over the limit of {max_bytes} bytes per file",
                      path)


def open_local(path: str, max_bytes: int | None = None) -> BinaryIO:
    """A local regular file opened for reading, of at most ``max_bytes`` (else OSError)."""
    fd = os.open(usable(path), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without a writer
    try:
        over_limit(regular(os.fstat(fd), path).st_size, max_bytes, path)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_local(path: str, max_bytes: int | None = None) -> bytes:
    """A local regular file's bytes, at most ``max_bytes`` of them (else OSError, unread)."""
    with open_local(path, max_bytes) as f:
        return f.read()
