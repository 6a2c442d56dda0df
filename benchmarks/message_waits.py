"""What bounding each wait for a request message costs per message, on a bare event loop.

    python benchmarks/message_waits.py [--awaits 100000] [--rounds 2]

Each round awaits a future made ready on the next loop pass, ``--awaits`` times, three ways:
bare; inside ``asyncio.timeout`` (a timer scheduled and cancelled per wait); and through the
server's ``MessageWaits`` (``server/parsing.py``: an entry in a dict per wait, one sweep a
quarter of the bound). Prints microseconds per await and, in the closing JSON line, each
bounded way's cost over the bare await. The serving path's own figures: ``serve_against.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchlib import emit, log, machine
from vit22b.server.parsing import MessageWaits


async def _ready(loop: asyncio.AbstractEventLoop):
    message = loop.create_future()
    loop.call_soon(message.set_result, b"")
    return await message


async def _per_await_us(way: str, awaits: int) -> float:
    loop, waits = asyncio.get_running_loop(), MessageWaits(300.0)
    start = time.perf_counter()
    for _ in range(awaits):
        if way == "timer":
            async with asyncio.timeout(300.0):
                await _ready(loop)
        elif way == "message_waits":
            await waits.wait(_ready(loop))
        else:
            await _ready(loop)
    return (time.perf_counter() - start) / awaits * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--awaits", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ways = ("bare", "timer", "message_waits")
    us = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            us[way].append(asyncio.run(_per_await_us(way, args.awaits)))
            log(f"{way}: {us[way][-1]:.2f} us per await")
    best = {way: min(times) for way, times in us.items()}
    emit({"benchmark": "message_waits", "awaits": args.awaits, "rounds": args.rounds,
          "us_per_await": {w: [round(t, 2) for t in ts] for w, ts in us.items()},
          "extra_us": {w: round(best[w] - best["bare"], 2) for w in ways[1:]},
          "machine": machine()})


if __name__ == "__main__":
    main()
