"""Assembling and running the server: engine, batcher, facade, gRPC door, health, reflection,
metrics, auth, tracing, and the HTTP door (``--http-port``) on the same loop and facade.

Start-up compiles every batch bucket before health reports SERVING. SIGTERM (or SIGINT): health
goes NOT_SERVING, new calls get UNAVAILABLE (HTTP 503) on both doors, accepted calls finish, then
the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from vit22b.model.compile_cache import use_compile_cache
from vit22b.model.config import ViTConfig
from vit22b.model.errors import InvalidRequest
from vit22b.v1 import features_pb2 as pb

from .auth import TokenAuth, Tokens, check_tls_pair, read_tokens, server_credentials
from .batcher import Batcher
from .engine import Engine, Executor, stored_config
from .infer import Infer, Limits, new_event_loop, served_resolutions
from .logs import quiet_grpc_call_ends
from .metrics import Metrics
from .parsing import MessageWaits, ParsingRegistrar
from .service import LIVENESS, READINESS, SERVICE_NAME, FeatureService
from .settings import ServeConfig
from .tracing import Tracing
from .unread import Unread

log = logging.getLogger(__name__)
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
IDLE_CONNECTION_MS = 5 * 60 * 1000


def _v1_reflection_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, which grpcio-reflection does not ship: v1alpha's
    file with the package renamed (v1 renamed nothing else)."""
    alpha, v1 = reflection_pb2.DESCRIPTOR.package, REFLECTION_V1.rpartition(".")[0]
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", v1
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # messages and enums only
                field.type_name = field.type_name.replace(f".{alpha}.", f".{v1}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(f".{alpha}.", f".{v1}.")
        method.output_type = method.output_type.replace(f".{alpha}.", f".{v1}.")
    return proto


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """The files reflection describes: every service it lists, v1's included (a client that
    describes each listed service, as grpcurl's ``describe`` and Postman do, must find them
    all); a pool of its own, so the process's default pool never holds a v1 file of ours."""
    pool = descriptor_pool.DescriptorPool()

    def add(file) -> None:
        for dependency in file.dependencies:
            add(dependency)
        try:
            pool.FindFileByName(file.name)
        except KeyError:
            pool.AddSerializedFile(file.serialized_pb)

    for file in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        add(file)
    pool.AddSerializedFile(_v1_reflection_file().SerializeToString())
    return pool


def _add_reflection(servicer: reflection.aio.ReflectionServicer,
                    registrar: ParsingRegistrar) -> None:
    """Server reflection under both of its names: v1alpha, the one grpcio-reflection ships, and
    v1, the one current clients (grpcurl, Postman, grpc-java's) ask first. v1 renamed the package
    only: its messages are v1alpha's field for field, so one servicer answers both."""
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, registrar)
    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )}
    registrar.add_registered_method_handlers(REFLECTION_V1, handlers)


def preflight(config: ServeConfig) -> Tokens:
    """The token file and the TLS pair, read and checked (ValueError, naming the flag): what
    a server refuses to start with, said before it loads and compiles anything."""
    if config.tls_cert:
        check_tls_pair(config.tls_cert, config.tls_key)
    return Tokens(read_tokens(config.token_file) if config.token_file else ())


def build_engine(config: ServeConfig, executor: Executor | None = None) -> Engine:
    """The engine of these settings, compiled for every warm output set (``executor``: how
    batches run; default one process)."""
    check_sizes(config, stored_config(config.model, config.checkpoint))  # before any weight
    use_compile_cache(config.compile_cache)
    engine = Engine.load(
        model=config.model,
        checkpoint_dir=config.checkpoint,
        verify=config.verify_checkpoint,
        mesh=config.mesh,
        seed=config.seed,
        compute_dtype=config.compute_dtype,
        max_batch_images=config.max_batch_images,
        max_batch_patches=config.max_batch_patches,
        max_compiled=config.max_compiled,
        chunk_images=config.chunk_images,
        executor=executor,
    )
    for line in engine.plan.table().splitlines():  # a line a record: the log escapes newlines
        log.info("%s", line)
    check_geometries(config, engine)
    for outputs in config.warm_outputs:  # before any compile: named as the flag's
        try:
            engine.resolve(outputs)
        except InvalidRequest as err:
            raise ValueError(f"--warm-outputs: {err}") from None
    grids = [engine.grid] + [
        (size // engine.cfg.patch,) * 2 for size in config.warm_resolutions
        if size != engine.cfg.image_size
    ]
    seconds = engine.warm_up(config.warm_outputs, grids)
    log.info("compiled buckets %s at grids %s in %.1fs", engine.buckets, grids, seconds)
    return engine


def check_sizes(config: ServeConfig, cfg: ViTConfig) -> None:
    """Every allowed resolution is whole patches of the model, and every warmed one allowed
    (checked before it loads)."""
    served = served_resolutions(config.resolutions, cfg.image_size)
    for size in served:
        if size % cfg.patch:
            raise ValueError(f"--resolutions: {size} is not a multiple of the patch ({cfg.patch})")
    unserved = sorted(set(config.warm_resolutions) - set(served))
    if unserved:
        raise ValueError(f"--warm-resolutions {unserved} are not served: --resolutions "
                         f"{', '.join(map(str, served))} (the model's own size included)")


def check_geometries(config: ServeConfig, engine: Engine) -> None:
    """Every allowed geometry must be servable: whole patches, one image within the batch
    budget (its activations are what the budget bounds; docs/architecture.md)."""
    cfg = engine.cfg
    check_sizes(config, cfg)
    for size in served_resolutions(config.resolutions, cfg.image_size):
        if not engine.max_images((size // cfg.patch,) * 2):
            raise ValueError(
                f"--resolutions: {size} ({(size // cfg.patch) ** 2} patches) does not fit "
                f"--max-batch-patches {engine.plan.max_batch_patches} even at batch "
                f"{engine.buckets[0]}"
            )
    dense = config.max_dense_patches
    if dense and not engine.max_images((1, dense)):
        raise ValueError(
            f"--max-dense-patches {dense} does not fit --max-batch-patches "
            f"{engine.plan.max_batch_patches} even at batch {engine.buckets[0]}"
        )


def freeze_startup_heap() -> None:
    """Leave what start-up built (jax, the compiled forwards, protobuf, the libraries: some
    200,000 objects) out of the interpreter's cycle collections from now on. Serving allocates
    fast and its garbage is young, yet every few seconds a full collection walked the whole
    heap: about 150 ms on the event loop at 32 tiny-model clients, a pause for every call in
    flight (``benchmarks/profile_serve.py --unfreeze``). Reference counting still frees all of
    it."""
    gc.collect()
    gc.freeze()


class FeatureServer:
    """One server in the current event loop: ``await start()``, ``await drain_and_stop()``."""

    def __init__(
        self, config: ServeConfig, engine: Engine | None = None, tracing: Tracing | None = None
    ):
        config.check()
        self.tokens = preflight(config)  # before any model work: a bad file is said at once
        self.config = config
        self.engine = engine
        self.metrics = Metrics()
        self.tracing = tracing or Tracing.export_to(config.otlp_endpoint)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http = None  # the HTTP door, with --http-port
        self.http_port: int | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        config = self.config
        if self.engine is None:  # compile off the event loop
            self.engine = await asyncio.to_thread(build_engine, config)
        self.batcher = Batcher(
            self.engine,
            self.metrics,
            max_batch_images=config.max_batch_images,
            max_delay_s=config.max_delay_ms / 1e3,
            max_queue_images=config.max_queue_images,
            batch_wait=config.batch_wait,
        )
        limits = Limits(
            max_request_images=config.max_request_images,
            max_message_bytes=int(config.max_message_mb * (1 << 20)),
            max_image_pixels=config.max_image_pixels,
            resolutions=config.resolutions,
            max_dense_patches=config.max_dense_patches,
        )
        check_geometries(config, self.engine)
        self.infer = Infer(
            self.engine, self.batcher, self.metrics, limits, config.preprocess_threads,
            self.tracing,
        )
        # the feature service's waits for messages (the drain ends them)
        self.waits = MessageWaits(config.grpc_message_timeout_s, self.infer.draining)
        self.service = FeatureService(
            self.infer, self.metrics,
            Unread(int(config.max_unread_mb * (1 << 20)), self.metrics.unread_bytes), self.waits)
        interceptors = []
        tokens = self.tokens
        if tokens:
            reject = self.metrics.requests.labels
            interceptors.append(
                TokenAuth(
                    tokens,
                    lambda method, code: reject(method.rsplit("/", 1)[-1], code.name).inc(),
                )
            )
        options = [
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.max_send_message_length", limits.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", config.max_streams_per_connection),
            # A connection with no call for this long is closed (GOAWAY): channels reconnect on
            # their next call, and idle ones stop holding the server's sockets.
            ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
        ]
        quiet_grpc_call_ends()
        server = grpc.aio.server(interceptors=interceptors, options=options,
                                 maximum_concurrent_rpcs=config.max_concurrent_rpcs)
        server.add_generic_rpc_handlers((self.service.handler(),))
        self.health = health.aio.HealthServicer()
        # their bodies parsed by their handlers, each wait for one bounded; never drained: a
        # liveness probe must be answered through a drain
        library = ParsingRegistrar(server, MessageWaits(config.grpc_message_timeout_s))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, library)
        names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1)
        _add_reflection(reflection.aio.ReflectionServicer(names, pool=_reflection_pool()),
                        library)
        address = f"{config.host}:{config.port}"
        if config.tls_cert:
            creds = server_credentials(config.tls_cert, config.tls_key)
            self.port = server.add_secure_port(address, creds)
        else:
            self.port = server.add_insecure_port(address)
        if not self.port:
            raise OSError(f"cannot bind {address}")
        self.batcher.start()
        await server.start()
        self._server = server
        if config.http_port is not None:
            from .http import HttpDoor  # FastAPI, uvicorn: only with the door
            from .http_connections import ClientLimits

            clients = ClientLimits(config.http_header_timeout_s, config.http_body_timeout_s,
                                   config.http_max_connections, config.http_min_body_rate)
            self.http = HttpDoor(self.infer, self.metrics, self.service.info, clients, tokens,
                                 config.http_cors_allow_origin)
            self.http_port = await self.http.start(
                config.host, config.http_port, config.tls_cert, config.tls_key
            )
        if config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(config.metrics_port, config.host)
        freeze_startup_heap()
        for name in (*READINESS, LIVENESS):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.http is not None:
            self.http.serving = True

    async def drain_and_stop(self, timeout: float | None = None) -> bool:
        """NOT_SERVING, refuse new calls, finish accepted ones, stop. True if nothing was cut."""
        timeout = self.config.drain_timeout_s if timeout is None else timeout
        # readiness only (grpcio's enter_graceful_shutdown would take every name): a draining
        # server is alive, as the HTTP door's /health says, and a liveness probe must not cut
        # its drain short
        for name in READINESS:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.waits.drain()  # calls waiting for a message end now, not at their bound
        clean = await self.infer.drain(timeout)
        if not clean:
            log.warning("drain timed out after %.0fs; stopping with calls in flight", timeout)
        await asyncio.sleep(self.config.drain_linger_s)
        http = self.http.stop() if self.http is not None else asyncio.sleep(0)
        await asyncio.gather(self._server.stop(grace=1.0), http)
        await asyncio.to_thread(self.batcher.stop)
        self.infer.close()
        self.metrics.stop()
        self.tracing.shutdown()
        gc.unfreeze()  # what this server held may be collected again (tests run many in turn)
        return clean

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def http_url(self) -> str | None:
        """``http(s)://host:port`` of the HTTP door, or None without one."""
        if self.http_port is None:
            return None
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{self.config.host}:{self.http_port}"


async def serve_until_signal(config: ServeConfig) -> int:
    """The CLI's main: serve until SIGTERM / SIGINT, drain, exit code 0 when the drain was clean."""
    server = FeatureServer(config)
    await server.start()
    return await serve_started(server)


async def serve_started(server: FeatureServer, mesh_note: str = "") -> int:
    """Announce a started server, serve until SIGTERM / SIGINT, drain; 0 when the drain was clean.

    ``mesh_note`` follows the mesh in the announcement (a group names its processes there).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before SERVING is said: a supervisor's
        loop.add_signal_handler(sig, stop.set)  # SIGTERM right after it must drain, not kill
    engine = server.engine
    log.info("%s (%s) on mesh %s", engine.cfg.name, engine.identity.source, engine.mesh_spec)
    metrics = f", metrics on :{server.metrics_port}/metrics" if server.metrics_port else ""
    if server.http_url:  # its own line: the SERVING line's format is what scripts parse
        _announce(f"vit22b serve: HTTP on {server.http_url}")
    _announce(
        f"vit22b serve: SERVING {engine.cfg.name} ({engine.identity.source}) on "
        f"{server.address}, mesh {engine.mesh_spec}{mesh_note}, buckets {list(engine.buckets)}"
        f"{metrics}"
    )
    await stop.wait()
    _announce("vit22b serve: draining (NOT_SERVING, new calls UNAVAILABLE)")
    clean = await server.drain_and_stop()
    _announce(f"vit22b serve: stopped ({'clean' if clean else 'drain timed out'})")
    return 0 if clean else 1


def _announce(line: str) -> None:
    """A status line on stdout, for scripts. One that cannot be written (stdout on a full disk,
    a reader gone) goes to the log instead: it must not end the server, nor skip its drain."""
    try:
        print(line, flush=True)
    except OSError as err:
        log.warning("cannot write to stdout (%s): %s", err.strerror or err, line)


class BackgroundServer:
    """A FeatureServer on its own event-loop thread: for tests, notebooks and in-process use."""

    def __init__(
        self, config: ServeConfig, engine: Engine | None = None, tracing: Tracing | None = None,
        loop_factory=new_event_loop,
    ):
        self.server = FeatureServer(config, engine, tracing)
        self._loop = loop_factory()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="vit22b-server"
        )

    def start(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result()
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        future = asyncio.run_coroutine_threadsafe(self.server.drain_and_stop(timeout), self._loop)
        clean = future.result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        return clean

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def http_url(self) -> str | None:
        return self.server.http_url

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
