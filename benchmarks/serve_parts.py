"""The serving path's parts alone, one thread, no clients: what each step of a call costs.

    python benchmarks/serve_parts.py            # the tiny model, 64x64 noise JPEGs

Decoding one JPEG (``pixels.decode``, at the contract's reduced size), the resize / crop and the
normalisation on the host (the server leaves it to the compiled forward), the server's whole
load (decode + crop: uint8 levels) and the host-normalised load it replaced; a round trip from
an event loop to another thread and back (a no-op through ``run_in_executor`` and through
``server/handoff.py``, one at a time and 32 at once, on asyncio's loop and uvloop's); the
preprocessing hash; an output request spelled and resolved anew against looked up (what every
call does); ``jax.device_put`` of a batch of 16 from a 16-byte and from a 64-byte aligned host
buffer (``Engine.forward`` pads into the latter: XLA:CPU then takes it without a copy), float32
and the uint8 levels the server sends; ``Engine.forward`` (pooled, the engine's own plan) per
batch size, wall and process CPU, of uint8 levels (as served: normalised in the forward) and of
normalised float32 pixels. Medians of timed loops, in microseconds. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from benchlib import emit, log, machine
from serve import jpegs

BATCHES = (1, 2, 4, 8, 16, 32)


def per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return round((time.perf_counter() - start) / calls * 1e6, 1)


def round_trips_us(loop_factory, calls: int) -> dict:
    """A no-op's round trip from an event loop to another thread and back, per job: one at a
    time and 32 at once (a burst, as 32 sessions' messages come), through the thread pool
    (``run_in_executor``) and through the handoff worker that decodes a call's small image."""
    from vit22b.server.handoff import Handoff

    pool, handoff = ThreadPoolExecutor(2), Handoff("serve-parts")

    async def trips(submit, burst: int) -> float:
        await submit()
        rounds = max(1, calls // burst)
        start = time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*(submit() for _ in range(burst)))
        return round((time.perf_counter() - start) / (rounds * burst) * 1e6, 1)

    async def all_trips() -> dict:
        loop = asyncio.get_running_loop()
        ways = {"pool": lambda: loop.run_in_executor(pool, int),
                "handoff": lambda: handoff.submit(int)}
        return {way: {burst: await trips(submit, burst) for burst in (1, 32)}
                for way, submit in ways.items()}

    loop = loop_factory()
    try:
        return loop.run_until_complete(all_trips())
    finally:
        loop.close()
        pool.shutdown()
        handoff.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit-22b-tiny/16")
    parser.add_argument("--size", type=int, default=64, help="side of the JPEG files")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()
    from vit22b.model.outputs import POOLED, OutputRequest
    from vit22b.model.pixels import OWN_GEOMETRY, Preprocessor, decode, normalise_formula
    from vit22b.server.engine import Engine

    engine = Engine.load(args.model, mesh="auto", max_batch_images=max(BATCHES))
    engine.warm_up()
    pre = Preprocessor(engine.cfg, OWN_GEOMETRY)
    data = jpegs(1, args.size)[0]
    pixels = decode(data, min_side=pre.min_side)
    big = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    result: dict = {
        "decode_us": per_call_us(lambda: decode(data, min_side=pre.min_side), args.calls),
        "crop_us": per_call_us(lambda: pre.crop(pixels), args.calls),
        "normalise_us": per_call_us(lambda: pre.normalise(pixels), args.calls),
        "normalise_formula_us": per_call_us(
            lambda: normalise_formula(pixels, engine.cfg.preprocess), args.calls),
        "normalise_224_us": per_call_us(lambda: pre.normalise(big), args.calls // 4),
        "normalise_formula_224_us": per_call_us(
            lambda: normalise_formula(big, engine.cfg.preprocess), args.calls // 4),
        "load_us": per_call_us(lambda: pre.crop(decode(data, min_side=pre.min_side)),
                               args.calls),
        "load_normalised_us": per_call_us(lambda: pre(decode(data, min_side=pre.min_side)),
                                          args.calls),
        "spell_outputs_us": {
            "anew": per_call_us(lambda: OutputRequest._spell(("pooled",), (), False), args.calls),
            "remembered": per_call_us(lambda: OutputRequest.of(("pooled",), (), False),
                                      args.calls)},
        "resolve_outputs_us": {
            "anew": per_call_us(lambda: POOLED.resolve(engine.cfg), args.calls),
            "remembered": per_call_us(lambda: engine.resolve(POOLED), args.calls)},
        "hash_uncached_us": per_call_us(
            lambda: engine.cfg.preprocess_hash(pre.geometry.key(engine.cfg)), args.calls),
        "round_trip_us": {"asyncio": round_trips_us(asyncio.new_event_loop, args.calls)},
    }
    try:
        import uvloop

        result["round_trip_us"]["uvloop"] = round_trips_us(uvloop.new_event_loop, args.calls)
    except ImportError:
        log("uvloop not installed")
    import jax
    from vit22b.server.engine import aligned_empty

    place = engine.placement(16)
    copied = np.zeros((16, *pixels.shape), np.float32)  # as NumPy allocates it
    if copied.ctypes.data % 64 == 0:  # by chance aligned: make it not
        copied = np.zeros(copied.size + 4, np.float32)[4:].reshape(copied.shape)
    aligned = aligned_empty(copied.shape)
    aligned[:] = 0
    levels = aligned_empty(copied.shape, np.uint8)
    levels[:] = 0
    result["device_put_16_us"] = {
        name: per_call_us(lambda a=array: jax.device_put(a, place.batch_sharding)
                          .block_until_ready(), args.calls)
        for name, array in (("unaligned", copied), ("aligned", aligned),
                            ("aligned_levels", levels))}
    outputs = engine.resolve(POOLED)
    for name, dtype in (("forward", np.uint8), ("forward_normalised", np.float32)):
        result[name] = {}
        for n in BATCHES:
            images = np.random.default_rng(n).integers(0, 256, (n, *pixels.shape), np.uint8)
            images = images if dtype == np.uint8 else pre.normalise(images)
            for _ in range(10):
                engine.forward(images, outputs)
            calls = max(20, args.calls // (10 * n))
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                engine.forward(images, outputs)
            wall = (time.perf_counter() - wall) / calls * 1e6
            cpu = (time.process_time() - cpu) / calls * 1e6
            result[name][n] = {"wall_us": round(wall), "cpu_us": round(cpu),
                               "cpu_us_per_image": round(cpu / n)}
    for key, value in result.items():
        log(f"{key}: {value}")
    emit({"benchmark": "serve_parts", "model": args.model, "jpeg_side": args.size, **result,
          "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
