"""Where the test suite's compile time goes: a pytest plugin summing JAX's own duration events
(tracing, lowering, XLA compiles, persistent-cache hits and the compile time they saved) per test
file of this process, printed as a table at the end of the run.

    PYTHONPATH=benchmarks python -m pytest -q -p no:cacheprovider -p suite_compiles

Processes the tests start (``vit22b serve``, Ray workers, distributed groups) are not counted.
"""

from __future__ import annotations

import collections

EVENTS = {  # jax.monitoring's event -> the column
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read",
    "/jax/compilation_cache/compile_time_saved_sec": "saved_by_hits",
}
_seconds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_file = ["(collection)"]


def pytest_collection_finish(session):
    import jax.monitoring  # after the tests' conftest has set XLA_FLAGS

    def listen(event: str, seconds: float, **_):
        if event in EVENTS:
            _seconds[_file[0]][EVENTS[event]] += seconds
            _counts[_file[0]][EVENTS[event]] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)


def pytest_runtest_logstart(nodeid, location):
    _file[0] = nodeid.split("::")[0]


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    columns = list(EVENTS.values())
    write("seconds (count) per file: " + ", ".join(columns))
    total: collections.Counter = collections.Counter()
    for name in sorted(_seconds, key=lambda f: -sum(_seconds[f].values())):
        total.update(_seconds[name])
        write(f"{name}: " + ", ".join(
            f"{_seconds[name][c]:.1f} ({_counts[name][c]})" for c in columns))
    write("all: " + ", ".join(f"{total[c]:.1f}" for c in columns))
