"""The server's log settings: levels and formats refused by name, JSON lines parseable one per
line (a message's newlines and a traceback included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EMIT = """
import logging
from vit22b.server import logs
logs.configure("INFO", "json", process=1)
log = logging.getLogger("vit22b.server.batcher")
log.debug("not shown at INFO")
log.info("two\\nlines and \\u00e9")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("a bug")
logging.getLogger("jax").info("backend probing is not news")
import io, struct, sys, warnings
import numpy as np
from PIL import Image
from vit22b.model.pixels import decode
for tag in (40000, 40001):  # a client's TIFF: each tag's count past the file's end
    out = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(out, "TIFF", tiffinfo={tag: "abcdefgh"})
    data = bytearray(out.getvalue())
    ifd = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        if struct.unpack_from("<H", data, ifd + 2 + 12 * i)[0] == tag:
            struct.pack_into("<I", data, ifd + 6 + 12 * i, 10_000_000)
    assert decode(bytes(data), 10**6, 8).shape == (8, 8, 3)
shown = getattr(sys.modules["PIL.TiffImagePlugin"], "__warningregistry__", {})
assert [key for key in shown if key != "version"] == []  # no entry per text
warnings.warn("another library's warning")
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
TraceContextTextMapPropagator().extract({  # a caller's: OpenTelemetry warned with its text
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": "a=1,ERROR vit22b.server.app: INJECTED"})
"""


def test_json_logs_are_one_object_per_line_with_the_traceback():
    done = subprocess.run([sys.executable, "-c", EMIT], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(r["level"], r["logger"], r["message"]) for r in lines[:2]] == [
        ("INFO", "vit22b.server.batcher", "two\nlines and \u00e9"),
        ("ERROR", "vit22b.server.batcher", "a bug")]
    # a warning is a record too; Pillow's about a client's TIFF, and OpenTelemetry's about a
    # caller's trace context, are not shown at all
    assert len(lines) == 3 and (lines[2]["level"], lines[2]["logger"]) == ("WARNING",
                                                                          "py.warnings")
    assert "UserWarning: another library's warning" in lines[2]["message"]
    assert all(r["process"] == 1 and r["time"].endswith("+00:00") for r in lines)
    assert "ZeroDivisionError: division by zero" in lines[1]["exception"]
    assert "exception" not in lines[0]


def test_a_bad_log_level_or_format_is_one_line_and_exit_2():
    for args, said in ((["--log-level", "nope"], "a log level is one of DEBUG, INFO"),
                       (["--log-format", "xml"], "--log-format must be one of text, json")):
        done = subprocess.run([sys.executable, "-m", "vit22b.clients.cli", "serve", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert said in done.stderr and "Traceback" not in done.stderr


TEXT = """
import logging
from vit22b.server import logs
logs.configure("INFO", "text")
log = logging.getLogger("vit22b.server.http")
key = "x\\n2026-12-07 00:00:00,000 ERROR vit22b.server.engine: FORGED, device lost\\x1b[2J\\u2028"
log.info("%s refused: %s", "POST /v1/features", f"images.0.{key}: extra inputs are not permitted")
try:
    raise ValueError("client said x\\n2026-12-07 00:00:00,000 ERROR vit22b.server.app: FORGED")
except ValueError:
    log.exception("a bug")
"""


def test_a_text_log_line_cannot_be_forged_by_a_clients_text():
    """An unknown JSON key a refusal quotes went raw into the text log, newline and all: one
    request wrote a line that read as the server's own ERROR (an outside tester's HTTP sweep).
    A record's message is one line, its control characters escaped; a traceback keeps its
    lines, indented (an exception's text may quote a client's too)."""
    done = subprocess.run([sys.executable, "-c", TEXT], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert " INFO vit22b.server.http: POST /v1/features refused: images.0.x\\n2026-12-07 " \
        "00:00:00,000 ERROR vit22b.server.engine: FORGED, device lost\\x1b[2J\\u2028: extra " \
        "inputs are not permitted" in lines[0]
    assert " ERROR vit22b.server.http: a bug" in lines[1]
    assert lines[2] == "    Traceback (most recent call last):"
    assert lines[-2:] == ["    ValueError: client said x",
                          "    2026-12-07 00:00:00,000 ERROR vit22b.server.app: FORGED"]
    assert all(line.startswith("    ") for line in lines[2:]) and len(lines) == 6
