"""Every failure the service knows, as plain exceptions (no jax, no grpc).

The pixel contract, the engine, the batcher and the facade raise these; the SDK, the job and the
probes catch them in-process; only the transports turn them into status codes, through the one
table in ``server/status.py``. Anything not in that table is a bug.
"""

from __future__ import annotations

import numbers
import os
import stat


class InvalidRequest(ValueError):
    """The request as a whole is malformed (outputs, dtype, layers, sizes, image count)."""


class InvalidImage(InvalidRequest):
    """One image cannot be used; the message names its index (and client id) and the reason."""

    def __init__(self, reason: str, index: int | None = None, image_id: str = ""):
        self.reason, self.index, self.image_id = reason, index, image_id
        named = image_id and image_id != str(index)  # ids default to the position
        where = "" if index is None else f"image {index}" + (f" (id {quoted(image_id)})"
                                                              if named else "")
        super().__init__(f"{where}: {reason}" if where else reason)

    def at(self, index: int, image_id: str = "") -> InvalidImage:
        return InvalidImage(self.reason, index, image_id)

    def shifted(self, offset: int) -> InvalidImage:
        """The same refusal for a part that starts at ``offset`` of the caller's list."""
        return self if self.index is None else self.at(offset + self.index, self.image_id)


SHOWN_CHARS = 80  # a message quotes this much of the client's text (an id, a name, a kind)


def quoted(text: object) -> str:
    """The client's text as a message quotes it: repr'd, and cut with a note past
    ``SHOWN_CHARS`` (a 60 MB model name must not come back in its refusal)."""
    if not isinstance(text, str):
        return repr(text)[:SHOWN_CHARS]
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    return f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is (its ``st_mode``), for a refusal."""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a file")


def odd_entry(folder: str | os.PathLike) -> str | None:
    """The first entry under ``folder`` (any depth, links followed) that is neither a regular
    file nor a folder, said as ``PATH is a FIFO, ...`` or ``PATH cannot be read: REASON``; None
    if there is none. For folders whose reader opens every entry it meets (orbax, JAX's
    compile cache): it would wait for ever on a FIFO and read a device without end."""
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(parent, name)
            try:
                mode = os.stat(path).st_mode
            except OSError as err:  # a dangling or looping link
                return f"{path} cannot be read: {err.strerror}"
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return f"{path} is {file_kind(mode)}, not a regular file or a folder"
    return None


def is_number(value: object, kind: type = numbers.Real) -> bool:
    """Whether a client's value is a number of ``kind`` (``numbers.Integral`` / ``Real``:
    numpy's count too), and not a bool (``True`` is 1 to Python, never a size or a layer)."""
    return isinstance(value, kind) and not isinstance(value, bool)


class TooLarge(InvalidRequest):
    """A request body, or the response it asks for, over the message limit."""


class QueueFull(Exception):
    """Admission refused: the queue holds its maximum of images. ``retry_after_s``: when a
    retry may succeed, where the refusal knows (HTTP's Retry-After; else the doors' default)."""

    def __init__(self, message: str = "", retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExpired(Exception):
    """The caller's deadline passed before its images were computed; they were not computed."""


class CallerGone(Exception):
    """The caller cancelled or disconnected; its remaining images were not computed."""


class Draining(Exception):
    """The server is shutting down and takes no new work."""


class NotReady(Exception):
    """No batch can run: a serving group that lost a process (UNAVAILABLE / 503; readiness is
    NOT_SERVING from then on)."""


class Unauthenticated(Exception):
    """Missing or wrong bearer token."""


class NonFiniteOutput(Exception):
    """The forward produced NaN or Inf for some images (bad weights, float16 overflow); they
    are refused, never returned."""
