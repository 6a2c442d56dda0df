"""How the suite's test files fell on the xdist workers: a pytest plugin (read on the controller)
printing, per worker, each file's first start and last stop relative to the run's first test,
the seconds its tests took, and at the end each worker's idle tail before the last one finished.
The suite runs `--dist loadfile`, so the run is as long as the busiest worker: this shows
whether the files are spread well.

    PYTHONPATH=benchmarks python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
        -p suite_timeline
"""

from __future__ import annotations

import collections

# worker -> file -> [first start, last stop, seconds in its tests' phases]
_spans: dict[str, dict[str, list[float]]] = collections.defaultdict(dict)


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # set on the controller by xdist: the worker
    worker = node.gateway.id if node is not None else "main"
    name = report.nodeid.split("::")[0]
    span = _spans[worker].setdefault(name, [report.start, report.stop, 0.0])
    span[0] = min(span[0], report.start)
    span[1] = max(span[1], report.stop)
    span[2] += report.stop - report.start


def pytest_terminal_summary(terminalreporter):
    if not _spans:
        return
    write = terminalreporter.write_line
    origin = min(s[0] for files in _spans.values() for s in files.values())
    ends = {w: max(s[1] for s in files.values()) - origin for w, files in _spans.items()}
    last = max(ends.values())
    write("file timeline per worker: start - stop (s from the first test), seconds in tests")
    for worker in sorted(_spans):
        for name, (start, stop, busy) in sorted(_spans[worker].items(), key=lambda i: i[1][0]):
            write(f"  {worker} {start - origin:7.1f} - {stop - origin:7.1f}  {busy:6.1f}  {name}")
        write(f"  {worker} done at {ends[worker]:.1f} s, idle tail {last - ends[worker]:.1f} s")
