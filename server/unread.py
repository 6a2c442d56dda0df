"""Answers computed and not yet read: a bound on what clients that stop reading can hold.

A gRPC answer handed to gRPC stays in the server's memory until the client's flow-control
window takes it: a client that opens its calls and never reads their answers (a zero window)
holds each one, about three times its size, for as long as it keeps the connection, with no
deadline (``benchmarks/unread_memory.py`` measures it). grpcio can
neither time out a write nor end a call whose write is stuck, so the bound is on their total:
past ``--max-unread-mb``, new calls are refused RESOURCE_EXHAUSTED (retried by the SDK) until
answers are read or their calls end. An answer counts from its call's admission (at the size
the message limit's check works out: every image answered), so answers still queued or
computing count too, until its unary call ends or, in a stream, its write completes (answers
wait in a stream's window while earlier ones are sent). The count is of serialized bytes: the
process holds about three times as much (the message, its bytes, gRPC's copy).

One connection holds at most half the bound (``SHARE``; or one answer, where one is larger): a
client that stopped reading (a stuck reader, a zero window) is refused before it takes the
whole bound, and the other clients go on. A connection is what gRPC names a peer; a client
with several can still fill the bound.
"""

from __future__ import annotations

from collections.abc import Callable

from vit22b.model.errors import QueueFull


class UnreadFull(QueueFull):
    """New calls refused: answers not yet read by their clients hold over ``--max-unread-mb``."""


SHARE = 2  # one connection holds at most 1/SHARE of the bound


class Unread:
    def __init__(self, limit_bytes: int, gauge) -> None:
        self.limit, self.bytes = limit_bytes, 0
        self._held: dict[str, int] = {}  # by connection (gRPC's peer), while it holds any
        gauge.set_function(lambda: self.bytes)  # read at a scrape: no lock taken per call

    def check(self, peer: str, size: int = 0) -> None:
        """Refuse a new call (its answer of ``size`` bytes, where known) while the answers not
        yet read are over the bound, or its connection's would be over its share (one answer
        alone is always taken: a large one could never be served otherwise)."""
        if self.bytes > self.limit:
            raise UnreadFull(
                f"the server holds {self.bytes / 2**20:.1f} MiB of answers their clients have "
                f"not read, over --max-unread-mb ({self.limit / 2**20:g}); retry later")
        held = self._held.get(peer, 0)
        if held and held + size > self.limit / SHARE:
            more = f" ({size / 2**20:.1f} MiB more with this one)" if size else ""
            raise UnreadFull(
                f"this connection holds {held / 2**20:.1f} MiB of answers it has not read"
                f"{more}, over 1/{SHARE} of --max-unread-mb ({self.limit / 2**20:g}); read "
                "them, or retry later")

    def reserve(self, size: int, peer: str) -> Callable[..., None]:
        """``check``, then count an answer of ``size`` bytes for connection ``peer`` from its
        admission (answers still queued or computing count too, so calls admitted together
        cannot pass the bound before any of their answers exists) until the returned release
        is called (once; it takes and ignores a done callback's argument)."""
        self.check(peer, size)
        self._held[peer] = self._held.get(peer, 0) + size
        self.bytes += size
        released = False

        def release(*_) -> None:
            nonlocal released
            if not released:
                released = True
                self.bytes -= size
                left = self._held.pop(peer) - size
                if left:
                    self._held[peer] = left
        return release
