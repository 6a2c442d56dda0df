"""Every ``vit22b serve`` setting, declared once (name, type, default, help, check); the flag
and its ``VIT22B_<NAME>`` environment variable are generated from it (clients/settings.py).
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from vit22b.clients.settings import (
    COMPUTE_DTYPE_HELP,
    at_most,
    check,
    compute_dtype,
    non_negative,
    one_of,
    positive,
    setting,
)
from vit22b.model.compile_cache import COMPILE_CACHE_HELP, default_compile_cache
from vit22b.model.config import parse_seed
from vit22b.model.errors import InvalidRequest
from vit22b.model.outputs import POOLED, OutputRequest
from vit22b.model.pixels import DEFAULT_MAX_IMAGE_PIXELS
from vit22b.model.schema import whole_number

from .logs import LOG_FORMATS, parse_log_level
from .tracing import check_otlp_endpoint


def parse_outputs(spec: str) -> OutputRequest:
    """``pooled``, ``pooled+class_token``, ``patch:-1,-4+pooled``, ``register_tokens`` ... -> an
    OutputRequest: any output kind, ``patch:LAYERS``, and ``norm_patches``."""
    kinds, layers, norm = [], [], False
    for part in spec.split("+"):
        if not part:  # "", "a++b": a typo, not the default set
            raise argparse.ArgumentTypeError(f"an empty output in {spec!r}")
        if part.startswith("patch:"):
            numbers = part[len("patch:") :].split(",")
            if not all(re.fullmatch(r"-?[0-9]+", v) for v in numbers):  # not int's "1_0", "１"
                raise argparse.ArgumentTypeError(f"bad layer list in {part!r}")
            layers += [int(v) for v in numbers]
        elif part == "norm_patches":
            norm = True
        else:
            kinds.append(part)
    try:
        return OutputRequest.of(kinds, layers, norm)
    except InvalidRequest as err:
        raise argparse.ArgumentTypeError(f"{spec!r}: {err}") from None


# Upper bounds of the time settings: past them a value is a mistake, not a policy (and the
# clocks and waits it reaches overflow long before infinity).
HOUR, DAY = 3600, 86400
HOLD = "an hour: what a client may hold a connection for"

BATCH_WAITS = ("decoding", "delay")  # the batcher's wait policies (server/batcher.py)


check_batch_wait = one_of(BATCH_WAITS)  # the setting's check and the batcher's


def _port_or_off(text: str) -> int | None:
    port = whole_number(text)
    return None if port < 0 else port


def _port(value: int | None) -> str | None:
    return None if value is None or 0 <= value <= 65535 else f"must be 0..65535, got {value}"


def parse_origin(text: str) -> str:
    """A CORS origin as browsers send it (``scheme://host[:port]``), or ``*``: one with a path
    or a trailing slash would never match, and the browser would refuse every call silently."""
    origin = text.strip()
    scheme, sep, host = origin.partition("://")
    if origin != "*" and (not sep or scheme not in ("http", "https") or not host
                          or any(c in host for c in "/?#*")):
        raise argparse.ArgumentTypeError(
            f"an origin is scheme://host[:port] with no path (e.g. https://app.example.com) or "
            f"'*', got {text!r}")
    return origin


def _optional_int(text: str) -> int | None:
    return None if text in ("", "none", "None") else whole_number(text)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``224,448,518`` -> (224, 448, 518); empty: none."""
    try:
        sizes = tuple(whole_number(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list of sizes {text!r} (e.g. 224,448)") from None
    if any(v <= 0 for v in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def default_http_connections() -> int:
    """Half the process's open-file limit, at most 4096: the other half stays for the gRPC
    door, the metrics port, model files and threads however many HTTP clients connect; 4096
    is far more than a batching server serves usefully at once (every call waits in one queue),
    and cheap in memory."""
    try:
        import resource
    except ImportError:  # Windows has no such limit to share
        return 4096
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 4096 if soft == resource.RLIM_INFINITY else max(1, min(4096, soft // 2))


@dataclass
class ServeConfig:
    model: str | None = setting(None, "preset name (default: the embedded default, or the "
                                "checkpoint's own)")
    checkpoint: str | None = setting(None, "checkpoint directory (vit22b init / convert)")
    verify_checkpoint: bool = setting(
        True, "recompute the checkpoint's weight fingerprint at start-up and refuse weights that "
        "are not the ones its metadata names (a corrupted or altered file); reads every "
        "parameter back once, about a second per GB")
    seed: int = setting(0, "seed of the random weights when no checkpoint is given",
                        parse=parse_seed)
    mesh: str = setting("auto", "device mesh, e.g. data=2,model=4 (auto: all devices on data; "
                        "on a CPU host two emulated devices)")
    compute_dtype: str | None = setting("auto", COMPUTE_DTYPE_HELP, parse=compute_dtype)
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50051, "gRPC port; 0 picks a free one", check=_port)
    metrics_port: int | None = setting(
        9464, "Prometheus /metrics port; 0 picks a free one, -1 turns it off",
        parse=_port_or_off, check=_port)
    http_port: int | None = setting(
        None, "HTTP/JSON port (OpenAI-compatible /v1/embeddings, /v1/features, /health, /ready, "
        "/v1/models), sharing the token file, TLS and limits; 0 picks a free one; -1 (the "
        "default) turns it off", parse=_port_or_off, check=_port)
    http_cors_allow_origin: tuple[str, ...] = setting(
        (), "an origin whose browser pages may call the HTTP door (CORS), e.g. "
        "https://app.example.com (repeatable), or '*' for any; default: none, no CORS headers "
        "(TEI's --cors-allow-origin)", parse=parse_origin, repeat=True)
    # A request's headers are a few hundred bytes that clients write at once: 10 s covers a
    # lossy link's retransmissions (1 + 2 + 4 s of TCP backoff) with room, and bounds how long
    # a connection that sends nothing, or trickles (slowloris), holds a --http-max-connections
    # place. nginx's client_header_timeout (60 s) is for browsers on any network.
    http_header_timeout_s: float = setting(
        10.0, "seconds from an HTTP connection's start, or the end of its previous response, "
        "until a request's headers are complete; then 408 (or, if nothing was sent, a close)",
        flag="--http-header-timeout", check=at_most(HOUR, HOLD))
    # Bodies run to --max-message-mb and may be produced while they are sent (a client
    # streaming images from storage): a stall of 30 s is not a busy client but a gone one.
    http_body_timeout_s: float = setting(
        30.0, "seconds a request body may go without a byte arriving (then 408), and a "
        "response without the client reading any (then the connection is cut): nginx's "
        "client_body_timeout and send_timeout", flag="--http-body-timeout",
        check=at_most(HOUR, HOLD))
    # The stall timeout alone lets a client drip a byte every 29 s and hold its connection for
    # days: a floor on the average rate bounds a body's time by its size (Kestrel's
    # MinRequestBodyDataRate). 16 KiB/s is 128 kbit/s, under any uplink that sends photos: a
    # --max-message-mb body arrives within its size / rate.
    http_min_body_rate: int = setting(
        16384, "bytes per second a request body must average once it has had "
        "--http-body-timeout to start (then 408); 0 turns the floor off",
        check=non_negative)
    http_max_connections: int = setting(
        help="open HTTP connections; one more is answered 503 and closed at once, so idle "
        "clients cannot take every file descriptor (default: half of `ulimit -n`, at most "
        "4096)", factory=default_http_connections, check=positive)
    # Each open call holds a handler on the loop (an idle stream 40-55 KB of the server's memory:
    # benchmarks/idle_streams.py): without a bound, idle streams grow the server's memory.
    max_concurrent_rpcs: int = setting(
        4096, "gRPC calls open at once (sessions' streams included); one more gets "
        "RESOURCE_EXHAUSTED, which the SDK retries", check=positive)
    max_streams_per_connection: int = setting(
        256, "gRPC calls open at once on one connection (HTTP/2 MAX_CONCURRENT_STREAMS): the "
        "client's further calls wait for a free stream, so no one connection takes every "
        "--max-concurrent-rpcs place", check=positive)
    # A handler reads its call's request messages itself (server/parsing.py); a call whose
    # message never comes, or never comes whole, held its handler and a --max-concurrent-rpcs
    # place for ever. gRPC shows no progress within a message, so the bound is on the wait:
    # 300 s is a --max-message-mb message at 220 KB/s, and an idle session costs the SDK one
    # new stream (grpc's own idle bound on connections is also 5 minutes: app.py).
    grpc_message_timeout_s: float = setting(
        300.0, "seconds a gRPC call waits for a request message (checked every quarter of it, "
        "50 ms to 1 s): a unary call's, then DEADLINE_EXCEEDED; a stream's next, once it owes "
        "no answer, then UNAVAILABLE (a request sent as it ended is to be sent again: the SDK's "
        "sessions do, on a new stream)", flag="--grpc-message-timeout",
        check=at_most(HOUR, HOLD))
    otlp_endpoint: str | None = setting(
        None, "OpenTelemetry collector (OTLP/gRPC), e.g. http://127.0.0.1:4317 (https:// for "
        "TLS): a trace span per call with its admission, preprocessing, queueing and compute "
        "(default: off)", check=check_otlp_endpoint)
    token_file: str | None = setting(
        None, "bearer tokens, one per line (health and reflection stay open)")
    tls_cert: str | None = setting(None, "PEM certificate chain (with --tls-key)")
    tls_key: str | None = setting(None, "PEM private key")
    max_batch_images: int = setting(32, "largest batch (rounded up to the data axis)",
                                    check=positive)
    max_batch_patches: int = setting(
        0, "largest batch in patches, padding included (TEI's --max-batch-tokens): images of "
        "larger grids run in smaller batches; 0: --max-batch-images alone", check=non_negative)
    resolutions: tuple[int, ...] = setting(
        (), "square input sizes requests may choose besides the model's own (always served), "
        "e.g. 224,448,518; each must be a multiple of the patch and fit --max-batch-patches",
        parse=parse_sizes)
    max_dense_patches: int = setting(
        0, "patches of one dense-mode image (aspect ratio kept, no crop); 0: dense mode off",
        check=non_negative)
    warm_resolutions: tuple[int, ...] = setting(
        (), "resolutions (of --resolutions) whose forwards compile before SERVING for every "
        "--warm-outputs set, besides the model's own size", parse=parse_sizes)
    max_delay_ms: float = setting(5.0, "longest wait for a fuller batch", check=at_most(
        60_000, "a minute: longer waits outlast any call", non_negative))
    batch_wait: str = setting(
        "decoding", "when a batch that is not full waits for company: 'decoding' only while "
        "admitted images are still being decoded (else it runs as soon as the model is free), "
        "'delay' always until its oldest job waited --max-delay-ms", check=check_batch_wait)
    max_queue_images: int = setting(
        1024, "admitted images not yet computed; beyond: RESOURCE_EXHAUSTED (streams wait)",
        check=positive)
    max_request_images: int = setting(256, "images in one request", check=positive)
    max_message_mb: float = setting(64.0, "largest request or response message, MiB",
                                    check=at_most(2047, "gRPC's sizes are 32-bit: under 2 GiB"))
    # A client that never reads its answers holds them in the server's memory (gRPC's flow
    # control) with no deadline: their total is bounded (server/unread.py).
    max_unread_mb: float = setting(
        1024.0, "MiB of gRPC answers admitted and not yet read by their clients (the process "
        "holds about 3x that); beyond, new calls get RESOURCE_EXHAUSTED (which the SDK "
        "retries) until answers are read or their calls end; one connection holds at most "
        "half of it",
        check=at_most(1e9, "about a pebibyte: larger is no bound"))
    max_image_pixels: int = setting(DEFAULT_MAX_IMAGE_PIXELS,
                                    "largest decoded image, in pixels (decompression bombs)",
                                    check=positive)
    preprocess_threads: int = setting(help="decoding threads (default: the CPU count)",
                                      factory=lambda: os.cpu_count() or 2, check=positive)
    chunk_images: int | None = setting(
        None, "at most this many images per device in one sequential step of a batch (0: whole "
        "batches); default: the execution plan's", parse=_optional_int, check=non_negative)
    max_compiled: int = setting(
        64, "compiled forwards kept besides the warm ones; a new output set beyond them is "
        "refused while all are in recent use", check=positive)
    compile_cache: str = setting(default_compile_cache(), COMPILE_CACHE_HELP)
    warm_outputs: tuple[OutputRequest, ...] = setting(
        (POOLED,), "output set compiled before SERVING (repeatable): output kinds joined by "
        "'+', patch:LAYERS for patch tokens, norm_patches, e.g. 'pooled', "
        "'pooled+patch:-1,-4', 'pooled+register_tokens'", parse=parse_outputs, repeat=True,
        shown="pooled")
    drain_timeout_s: float = setting(60.0, "seconds accepted calls get to finish after SIGTERM",
                                     flag="--drain-timeout", check=at_most(DAY, "a day"))
    log_level: str = setting("INFO", "log level: DEBUG, INFO, WARNING, ERROR or CRITICAL",
                             parse=parse_log_level)
    log_format: str = setting(
        "text", "log lines as text, or json: one object per line (time, level, logger, message, "
        "exception) for log pipelines", check=one_of(LOG_FORMATS))
    # After the drain, keep answering UNAVAILABLE this long before closing the port: callers
    # that were already on their way get a status they retry elsewhere, not a cut connection.
    drain_linger_s: float = setting(0.5, cli=False)

    def check(self) -> None:
        check(self)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.max_request_images > self.max_queue_images:
            raise ValueError(
                f"--max-request-images ({self.max_request_images}) cannot exceed "
                f"--max-queue-images ({self.max_queue_images})"
            )
