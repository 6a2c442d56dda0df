"""The server's log lines: text for a terminal, or one JSON object per line for log pipelines
(Loki, Cloud Logging, Elasticsearch: TEI's ``--json-output``), set once at start-up."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import warnings

from .tracing import CLIENT_TEXT_LOGGERS

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")


def parse_log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"a log level is one of {', '.join(LOG_LEVELS)}, "
                                         f"got {text!r}")
    return level


class JsonLines(logging.Formatter):
    """``{"time", "level", "logger", "message"}``, plus ``"process"`` (a group's member) and
    ``"exception"`` (its traceback) when there is one: every record on one line, whatever
    newlines its message holds."""

    def __init__(self, process: int | None = None):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process is not None:
            line["process"] = self.process
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


# C0 and C1 controls, DEL and Unicode's line and paragraph separators, as escapes: a message
# quoting a client's text (a JSON key a refusal names) must not start a line of its own
_ONE_LINE = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))} | {
    ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"}


class TextLines(logging.Formatter):
    """The terminal's format, a record's message on one line whatever it quotes (a forged
    line read as the server's own); a traceback keeps its lines after it, each indented (an
    exception's text may quote a client's too), its other control characters escaped."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return super().formatMessage(record).translate(_ONE_LINE)

    def format(self, record: logging.LogRecord) -> str:
        first, *rest = super().format(record).split("\n")
        return "\n".join([first, *("    " + line.translate(_ONE_LINE) for line in rest)])


def configure(level: str, fmt: str, process: int | None = None) -> None:
    """The root logger's level and format (``process``: a group member's id, in every line).

    Warnings become log records (``py.warnings``), so a JSON log stays one object per line;
    Pillow's about a client's file ("Skipping tag 40001", "Corrupt EXIF data") are dropped:
    the image is decoded or refused either way, and their text, the client's to choose, would
    fill the log and Python's registry of warnings already shown (one entry per text).
    OpenTelemetry's warnings about a caller's trace context are dropped for the same reason."""
    logging.getLogger("jax").setLevel(logging.WARNING)  # backend probing is not news
    for name in CLIENT_TEXT_LOGGERS:  # a caller's bad trace context: its text, a line a call
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
    logging.captureWarnings(True)
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonLines(process))
    else:
        member = "" if process is None else f"process {process} "
        handler.setFormatter(TextLines(
            f"%(asctime)s %(levelname)s {member}%(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


GRPC_CORE_LOGGER = "grpc._cython.cygrpc"  # grpcio's aio server's own handler code


def call_gone_while_sending(record: logging.LogRecord) -> bool:
    """grpcio's traceback for a call that ended while grpcio was sending its answer or status
    (its client gone, its deadline passed, its flow control shut: an ``ExecuteBatchError`` in
    grpcio's own handler code, eight lines at ERROR per call, a log any client can fill) as one
    INFO line naming the method; under ``--log-level`` WARNING and above, nothing."""
    error = record.exc_info[1] if record.exc_info else None
    if type(error).__name__ != "ExecuteBatchError" or not str(record.msg).startswith(
            "ExecuteBatchError raised in core by servicer method"):
        return True  # grpcio's other lines about a batch (its error status's) stay whole
    method = record.getMessage().rpartition("[")[2].rstrip("]")
    record.levelno, record.levelname = logging.INFO, "INFO"
    record.msg = ("%s: the call ended (its client gone, or its deadline passed) as grpcio "
                  "finished it")
    record.args = (method,)
    record.exc_info = record.exc_text = None
    return logging.getLogger().isEnabledFor(logging.INFO)


def quiet_grpc_call_ends() -> None:
    """Install ``call_gone_while_sending`` (once: a filter is added once)."""
    logging.getLogger(GRPC_CORE_LOGGER).addFilter(call_gone_while_sending)
