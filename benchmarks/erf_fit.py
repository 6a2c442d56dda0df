"""The rational erf of the exact GELU (model/vit.py ``erf``): its fit, its error, its speed.

``erf(x) ~ x P(x^2) / Q(x^2)`` for x clamped to [-4, 4] (beyond, erf is +-1 to float32's
precision), P of degree 6 and Q of degree 5 in x^2, Q(0) = 1. The coefficients come from a
linearised least-squares fit (Sanathanan-Koerner: the residual x P - erf Q weighted by 1 / Q of
the previous step) with Lawson reweighting towards the minimax error, in float64 on 20,001
points of [0, 4]. The script prints them (as model/vit.py holds them), the error of the fit in
float64 and of the model's own float32 evaluation against float64's erf, next to jax's erf, and
the time of the exact GELU on one MLP activation of ViT-B/16 (788 x 3072, the engine's chunk),
both ways, in float32 and as a bf16 matmul input (cast by XLA's convert and by ``vit.cast``,
the matmul inputs' rounding; each cast alone too).

    python benchmarks/erf_fit.py
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np
from benchlib import emit, load_average, log, median
from scipy.special import erf as erf64

DEGREES = (6, 5)


def fit(degree_p: int, degree_q: int, points: int = 20001, steps: int = 60):
    x = np.linspace(0.0, 4.0, points)
    s, y = x * x, erf64(x)
    columns = [x * s**i for i in range(degree_p + 1)] + [-y * s**j for j in range(1, degree_q + 1)]
    a = np.stack(columns, axis=1)
    q_values, weights = np.ones_like(x), np.ones_like(x)
    for step in range(steps):
        w = weights / np.abs(q_values)
        c, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
        p, q = c[: degree_p + 1], np.concatenate([[1.0], c[degree_p + 1 :]])
        q_values = np.polyval(q[::-1], s)
        error = np.abs(x * np.polyval(p[::-1], s) / q_values - y)
        if step >= 10:  # Lawson: weight up where the error is largest
            weights = weights * np.sqrt(error / error.max() + 1e-3)
            weights /= weights.max()
    return p, q, float(error.max())


def rational_error(p: np.ndarray, q: np.ndarray, points: int = 20001) -> float:
    """Max abs error of ``x P(x^2) / Q(x^2)`` against erf on the fit's points, in float64."""
    x = np.linspace(0.0, 4.0, points)
    s = x * x
    return float(np.abs(x * np.polyval(p[::-1], s) / np.polyval(q[::-1], s) - erf64(x)).max())


def main() -> int:
    p, q, fit_error = fit(*DEGREES)
    log(f"P = {tuple(float(f'{v:.9g}') for v in p)}")
    log(f"Q = {tuple(float(f'{v:.9g}') for v in q)}")
    log(f"fit: max abs error {fit_error:.2e} (float64)")

    from vit22b.server.cpu_devices import prepare_xla_cpu

    prepare_xla_cpu()  # the server's XLA:CPU settings (512-bit vectors where AVX-512 exists)
    import jax
    import jax.numpy as jnp
    from vit22b.model import vit

    # The model holds this fit's coefficients, up to the last digits that LAPACK's rounding moves
    # from host to host (OpenBLAS picks its kernels by CPU: 2.9e-7 apart, relative, on an AMX
    # host). What must hold: the same fit, within 1e-8 of erf in float64 (a sixth of float32's
    # half step at 1).
    apart = max(float(np.abs(np.asarray(held) / fitted - 1).max())
                for held, fitted in ((vit.ERF_P, p), (vit.ERF_Q, q)))
    held_error = rational_error(np.asarray(vit.ERF_P), np.asarray(vit.ERF_Q))
    log(f"model's coefficients: {apart:.1e} apart (relative), max abs error {held_error:.2e} "
        "(float64)")
    if apart > 1e-5 or held_error > 1e-8:
        raise SystemExit(f"the model's coefficients are not this fit's: {apart:.1e} apart, "
                         f"max abs error {held_error:.2e} (float64)")
    xs = np.linspace(-6.0, 6.0, 2_000_001, dtype=np.float32)
    exact = erf64(xs.astype(np.float64))
    errors = {name: float(np.abs(np.asarray(jax.jit(fn)(xs), np.float64) - exact).max())
              for name, fn in (("model", vit.erf), ("jax.lax.erf", jax.lax.erf))}
    log("float32 max abs error against float64's erf on [-6, 6]: "
        + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))

    h = jnp.asarray(np.random.default_rng(0).standard_normal((788, 3072)), jnp.float32)
    sides = {
        "jax.nn.gelu f32": lambda t: jax.nn.gelu(t, approximate=False),
        "model gelu f32": lambda t: vit.gelu(t, True),
        "jax.nn.gelu -> bf16": lambda t: jax.nn.gelu(t, approximate=False).astype(jnp.bfloat16),
        "model gelu -> bf16": lambda t: vit.gelu(t, True).astype(jnp.bfloat16),
        "model gelu -> vit.cast bf16": lambda t: vit.cast(vit.gelu(t, True), jnp.bfloat16),
        "astype bf16 alone": lambda t: t.astype(jnp.bfloat16),
        "vit.cast bf16 alone": lambda t: vit.cast(t, jnp.bfloat16),
    }
    times = {}
    for name, fn in sides.items():
        compiled = jax.jit(fn)
        compiled(h).block_until_ready()
        samples = []
        for _ in range(30):
            start = time.perf_counter()
            compiled(h).block_until_ready()
            samples.append(time.perf_counter() - start)
        times[name] = round(median(samples) * 1e3, 3)
    log("GELU on 788 x 3072 (ms): " + ", ".join(f"{k} {v}" for k, v in times.items()))
    emit({"benchmark": "erf_fit", "degrees": DEGREES, "fit_max_abs_error": fit_error,
          "float32_max_abs_error": errors, "gelu_ms": times, "load_average": load_average(),
          "sqrt_half": 1 / math.sqrt(2)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
