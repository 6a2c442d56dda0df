"""Served geometry: a request chooses the square size or the dense mode; equal to the in-process
forward at each allowed geometry; unallowed ones refused naming what is allowed; a mixed stream
batched by grid within the patch budget (the server's metrics show it)."""

from __future__ import annotations

import functools
import json

import grpc
import numpy as np
import pytest
from serving import MESH, assert_same_rows, in_process, metric, metrics, random_images, raw_image
from serving import stub as make_stub
from vit22b.model import OutputRequest
from vit22b.model.pixels import Geometry, Preprocessor
from vit22b.server.app import BackgroundServer
from vit22b.server.engine import Engine
from vit22b.server.settings import ServeConfig
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

RESOLUTIONS = (64, 96, 128)  # the tiny default model: 16-pixel patches, its own size 64
DENSE = 24  # patches of one dense image
BUDGET = 256  # patches per batch: 8 images at 4x4, 4 at 6x6 (36) or 8x8 (64)
OUTPUTS = OutputRequest(pooled=True, patch_layers=(-1,))


@functools.cache
def engine() -> Engine:
    return Engine.load(mesh=MESH, max_batch_images=8, max_batch_patches=BUDGET)


def _server(**overrides) -> BackgroundServer:
    config = ServeConfig(mesh=MESH, port=0, metrics_port=0, max_batch_images=8,
                         max_batch_patches=BUDGET, resolutions=RESOLUTIONS,
                         max_dense_patches=DENSE, max_delay_ms=50.0)
    for key, value in overrides.items():
        setattr(config, key, value)
    return BackgroundServer(config, engine=engine())


def _request(images, resolution=0, dense=False) -> pb.EmbedRequest:
    return pb.EmbedRequest(
        images=[raw_image(im, f"im{i}") for i, im in enumerate(images)],
        outputs=[pb.OUTPUT_KIND_POOLED, pb.OUTPUT_KIND_PATCH_TOKENS],
        patch_layers=[-1], resolution=resolution, dense=dense,
    )


def test_plan_budgets_batches_in_patches():
    plan = engine().plan
    # 6 of (6, 6): a midpoint bucket (6) fits the budget where 8 does not
    assert [plan.max_images(g) for g in [(4, 4), (6, 6), (8, 8), (16, 16)]] == [8, 6, 4, 1]
    assert plan.max_images((17, 16)) == 0  # one image over the budget: refused at start


@pytest.mark.parametrize("geometry", [Geometry(64), Geometry(96), Geometry(128),
                                      Geometry(64, dense=True)])
def test_served_geometry_equals_the_in_process_forward(geometry):
    images = random_images(3, seed=7, size=(72, 96))  # 3:4: dense gives 4x5 patches (20 <= 24)
    want_pre = Preprocessor(engine().cfg, Geometry(geometry.resolution, geometry.dense,
                                                   DENSE if geometry.dense else 0))
    want = in_process(engine(), images, OUTPUTS, resolutions=RESOLUTIONS,
                      max_dense_patches=DENSE, geometry=geometry)
    with _server() as server:
        response = make_stub(server.address).Embed(
            _request(images, geometry.resolution, geometry.dense)
        )
    rows, cols = (4, 5) if geometry.dense else (geometry.resolution // 16,) * 2
    assert (response.grid_rows, response.grid_cols) == (rows, cols)
    tokens = wire.from_tensor(response.patch_tokens[-1])
    assert tokens.shape == (3, rows * cols, 64)
    assert want.patch_tokens[3].shape == tokens.shape
    assert_same_rows(wire.from_tensor(response.pooled), want.pooled)
    assert_same_rows(tokens.reshape(3, -1), want.patch_tokens[3].reshape(3, -1))
    assert response.model.preprocess_hash == want_pre.hash
    default = geometry == Geometry(64)
    assert (want_pre.hash == engine().cfg.preprocess_hash()) == default


def test_unallowed_geometries_are_refused_naming_what_is_allowed():
    images = random_images(2, seed=8)
    with _server(max_dense_patches=0) as server:
        stub = make_stub(server.address)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert list(info.limits.resolutions) == list(RESOLUTIONS)
        assert info.limits.max_batch_patches == BUDGET and info.limits.max_dense_patches == 0
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(_request(images, resolution=80))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "resolution 80 is not served; allowed: 64, 96, 128" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(_request(images, dense=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dense mode is off" in err.value.details()
    with _server() as server:
        # 4x16 patches at 64 px, over the 24 of the bound: both sides shrunk to 2x9 (18)
        wide = random_images(1, seed=9, size=(40, 160))[0]
        tall = random_images(1, size=(160, 40))[0]
        with pytest.raises(grpc.RpcError) as err:
            make_stub(server.address).Embed(_request([wide, tall], dense=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "different patch grids (image 0: 2x9, image 1: 9x2)" in err.value.details()


def test_the_models_own_size_is_served_whatever_resolutions_lists():
    """`vit22b serve --resolutions 128` on a 64-pixel model compiled the own grid, then exited 2:
    "resolution 64 is not served" (GetModelInfo describes the own geometry, and every request
    naming no resolution gets it). The own size is always served; the list adds to it."""
    from vit22b.server.app import check_sizes

    images = random_images(2, seed=12)
    want = in_process(engine(), images, OUTPUTS, geometry=Geometry(64))
    with _server(resolutions=(128, 96), max_dense_patches=0) as server:
        stub = make_stub(server.address)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert list(info.limits.resolutions) == [64, 96, 128]
        own = stub.Embed(_request(images))
        assert (own.grid_rows, own.grid_cols) == (4, 4)
        assert_same_rows(wire.from_tensor(own.pooled), want.pooled)
        assert stub.Embed(_request(images, resolution=128)).grid_rows == 8
        with pytest.raises(grpc.RpcError, match="resolution 80 is not served; allowed: 64, 96"):
            stub.Embed(_request(images, resolution=80))
    cfg = engine().cfg
    check_sizes(ServeConfig(resolutions=(128,), warm_resolutions=(64, 128)), cfg)
    with pytest.raises(ValueError, match=r"--warm-resolutions \[80\] are not served: "
                       "--resolutions 64, 128 .the model's own size included"):
        check_sizes(ServeConfig(resolutions=(128,), warm_resolutions=(80,)), cfg)


def test_a_mixed_stream_is_batched_by_grid_within_the_patch_budget():
    sizes = [64, 128, 96, 64, 128, 96, 128, 128]
    images = random_images(len(sizes) * 2, seed=10)
    with _server() as server:
        requests = [_request(images[2 * i : 2 * i + 2], size) for i, size in enumerate(sizes)]
        responses = list(make_stub(server.address).EmbedStream(iter(requests)))
        samples = metrics(server)
    assert [r.grid_rows for r in responses] == [s // 16 for s in sizes]
    for r, size, i in zip(responses, sizes, range(len(sizes))):
        want = in_process(engine(), images[2 * i : 2 * i + 2], resolutions=RESOLUTIONS,
                          geometry=Geometry(size))
        assert_same_rows(wire.from_tensor(r.pooled), want.pooled)
    batches = {g: metric(samples, "vit22b_batches_total", grid=g) for g in ("4x4", "6x6", "8x8")}
    assert all(batches.values()), batches
    # 8 images at 8x8 (64 patches each) cannot share one batch of 256 patches: 2 batches at least
    assert batches["8x8"] >= 2
    assert metric(samples, "vit22b_images_total", outcome="computed") == len(images)


def test_the_sdk_chooses_the_geometry():
    from vit22b.clients import FeatureClient

    images = random_images(3, seed=11, size=(72, 96))
    wide = random_images(1, seed=12, size=(40, 100))[0]
    with _server() as server, FeatureClient(server.address) as client:
        got = client.embed(images, outputs=["pooled", "patch_tokens"], resolution=96)
        dense = list(client.iter_embed([images[0], wide], outputs=["patch_tokens"], dense=True))
        with pytest.raises(ValueError, match="different patch grids"):
            client.embed([images[0], wide], outputs=["patch_tokens"], dense=True)
    want = in_process(engine(), images, OUTPUTS, resolutions=RESOLUTIONS, geometry=Geometry(96))
    assert got.grid == (6, 6) and got.patch_tokens[-1].shape == (3, 36, 64)
    assert_same_rows(got.pooled, want.pooled)
    # 40x100 at 64: 4x10 patches, over the bound of 24: both sides x sqrt(24/40) -> 3x7
    assert [d.grid for d in dense] == [(4, 5), (3, 7)]


def test_a_job_records_its_geometry_and_refuses_to_mix(tmp_path):
    from test_embed import write_images
    from vit22b.clients.embed import JobConfig, OutputSpec, run_job
    from vit22b.clients.embed_remote import RemoteBackend
    from vit22b.clients.outputs import open_outputs

    write_images(tmp_path / "data", 5)
    spec = OutputSpec(pooled=True, patch_layers=(-1,), resolution=96)
    out = str(tmp_path / "out")
    with _server() as server:
        backend = RemoteBackend([server.address], spec, quiet=True)
        try:
            summary = run_job(JobConfig([str(tmp_path / "data")], out, spec, quiet=True), backend)
        finally:
            backend.close()
        assert summary.complete and summary.embedded == 5
        stored = open_outputs(out)
        assert np.asarray(stored["patch_tokens.3"]).shape == (5, 36, 64)
        identity = json.loads((tmp_path / "out" / "manifest.json").read_text())["identity"]
        assert identity["resolution"] == 96 and identity["num_patches"] == 36
        want = Preprocessor(engine().cfg, Geometry(96)).hash
        assert identity["preprocess_hash"] == want
        other = OutputSpec(pooled=True, patch_layers=(-1,), resolution=128)
        backend = RemoteBackend([server.address], other, quiet=True)
        try:
            with pytest.raises(ValueError, match="refusing to mix"):
                run_job(JobConfig([str(tmp_path / "data")], out, other, quiet=True), backend)
        finally:
            backend.close()

        # the model's own resolution named or not is one job ("None in the manifest, 64 now"
        # was refused; dense: "0 in the manifest, 64 now"), either way round; the same rows
        own = engine().cfg.image_size

        def job(folder: str, resolution: int, dense: bool):
            spec = OutputSpec(pooled=True, patch_layers=(-1,), resolution=resolution,
                              dense=dense)
            backend = RemoteBackend([server.address], spec, quiet=True)
            try:
                return run_job(JobConfig([str(tmp_path / "data")], str(tmp_path / folder), spec,
                                         quiet=True), backend)
            finally:
                backend.close()

        for dense in (False, True):
            for first, then in ((own, 0), (0, own)):
                folder = f"own-{dense}-{first}"
                assert (job(folder, first, dense).embedded, job(folder, then, dense).embedded) \
                    == (5, 0)
            named, unnamed = (open_outputs(str(tmp_path / f"own-{dense}-{r}")) for r in (own, 0))
            assert named.ids == unnamed.ids
            assert_same_rows(np.asarray(named["pooled"]), np.asarray(unnamed["pooled"]))
        with pytest.raises(ValueError, match="refusing to mix"):  # square and dense: two jobs
            job(f"own-False-{own}", own, True)


def test_warm_resolutions_compile_before_serving_and_bad_limits_are_refused():
    from vit22b.model.outputs import POOLED
    from vit22b.server.app import build_engine, check_geometries

    config = ServeConfig(mesh=MESH, max_batch_images=2, resolutions=(64, 96),
                         warm_resolutions=(96,), compile_cache="off")
    warm = build_engine(config)
    pooled = warm.resolve(POOLED)
    assert all(warm.is_compiled(b, pooled, (6, 6)) for b in warm.plan.buckets_for((6, 6)))
    assert not warm.is_compiled(warm.buckets[-1], pooled, (8, 8)) and warm.compilations == 0
    with pytest.raises(ValueError, match="72 is not a multiple of the patch"):
        check_geometries(ServeConfig(resolutions=(64, 72)), engine())
    with pytest.raises(ValueError, match="512 .1024 patches. does not fit --max-batch-patches 256"):
        check_geometries(ServeConfig(resolutions=(512,)), engine())
    with pytest.raises(ValueError, match=r"--warm-resolutions \[96\] are not served"):
        check_geometries(ServeConfig(resolutions=(64,), warm_resolutions=(96,)), engine())
    # an output set the model lacks, named as the flag's before any compile
    from vit22b.server.settings import parse_outputs

    config = ServeConfig(mesh=MESH, warm_outputs=(parse_outputs("pooled+register_tokens"),),
                         compile_cache="off")
    with pytest.raises(ValueError, match="^--warm-outputs: model vit-22b-tiny/16 has no "
                       "register tokens"):
        build_engine(config)


def test_a_resolution_of_part_patches_is_refused_before_the_weights_load(tmp_path):
    """A typo in --resolutions was refused only after the weights had loaded (minutes for a
    large checkpoint): the patch size comes from the checkpoint's metadata, read first. A
    checkpoint whose weights are gone shows the order: the refusal names the resolution."""
    import shutil

    from vit22b.model import checkpoint
    from vit22b.model.config import get_config
    from vit22b.model.sharding import init_sharded, make_mesh
    from vit22b.server.app import build_engine

    path = tmp_path / "ckpt"
    cfg = get_config("vit-22b-tiny/16")
    checkpoint.save(path, cfg, init_sharded(cfg, make_mesh(MESH), seed=0), source="init:seed=0")
    for item in path.iterdir():  # leave the metadata alone: no weight can be read
        if item.name != checkpoint.METADATA_FILE:
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    config = ServeConfig(checkpoint=str(path), mesh=MESH, resolutions=(64, 72),
                         compile_cache="off")
    with pytest.raises(ValueError, match="--resolutions: 72 is not a multiple of the patch .16."):
        build_engine(config)


@pytest.mark.parametrize("geometry", [Geometry(96), Geometry(64, dense=True)])
def test_http_features_take_the_geometry_and_equal_grpc(geometry):
    import httpx
    from serving import png
    from test_http import b64, tensor

    images = random_images(3, seed=8, size=(72, 96))
    body = {"images": [b64(png(p)) for p in images], "outputs": ["pooled", "patch_tokens"],
            "layers": [-1], "resolution": geometry.resolution, "dense": geometry.dense}
    with _server(http_port=0) as server:
        got = httpx.post(server.http_url + "/v1/features", json=body, timeout=120).json()
        bad = httpx.post(server.http_url + "/v1/features", json={**body, "resolution": 80,
                                                                 "dense": False}, timeout=60)
        grpc_response = make_stub(server.address).Embed(pb.EmbedRequest(
            images=[pb.Image(encoded=png(p)) for p in images],
            outputs=[pb.OUTPUT_KIND_POOLED, pb.OUTPUT_KIND_PATCH_TOKENS], patch_layers=[-1],
            resolution=geometry.resolution, dense=geometry.dense))
    assert got["grid"] == [grpc_response.grid_rows, grpc_response.grid_cols]
    assert got["model"]["preprocess_hash"] == grpc_response.model.preprocess_hash
    np.testing.assert_array_equal(tensor(got["outputs"]["pooled"]),
                                  wire.from_tensor(grpc_response.pooled))
    np.testing.assert_array_equal(tensor(got["outputs"]["patch_tokens"]["-1"]),
                                  wire.from_tensor(grpc_response.patch_tokens[-1]))
    assert bad.status_code == 400 and "allowed: 64, 96, 128" in bad.text


def _dense_folder(root) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """Photos of several aspect ratios (and one corrupt file); id -> the dense grid each gets
    at the tiny model's 64 px and the bound of 24 patches."""
    from PIL import Image

    root.mkdir()
    sizes = {"a.png": (72, 96), "b.png": (96, 72), "c.jpg": (40, 100), "d.png": (64, 64),
             "e.png": (72, 96), "f.jpg": (100, 30), "g.png": (50, 51)}
    grids = {}
    for i, (name, (h, w)) in enumerate(sizes.items()):
        Image.fromarray(random_images(1, seed=20 + i, size=(h, w))[0]).save(root / name)
        grid = Geometry(64, True, DENSE).size(engine().cfg, h, w)
        grids[name] = (grid[0] // 16, grid[1] // 16)
    (root / "z.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    return sorted(sizes), grids


def test_a_dense_job_stores_each_images_grid_and_padded_tokens(tmp_path, capsys):
    from test_embed import read_dir
    from vit22b.clients.cli import main
    from vit22b.clients.embed import GRID, JobConfig, OutputSpec, run_job
    from vit22b.clients.embed_local import LocalBackend
    from vit22b.clients.embed_remote import RemoteBackend
    from vit22b.clients.outputs import open_outputs

    ids, grids = _dense_folder(tmp_path / "data")
    assert len(set(grids.values())) >= 4  # several grids in one job
    spec = OutputSpec(pooled=True, patch_layers=(-1,), dense=True)
    data = str(tmp_path / "data")

    def job(backend, out, **kw):
        try:
            return run_job(JobConfig([data], str(tmp_path / out), spec, quiet=True,
                                     **{"batch_size": 4, "shard_size": 5, **kw}), backend)
        finally:
            backend.close()

    with _server() as server:
        remote = job(RemoteBackend([server.address], spec, quiet=True), "remote")
        with _server(max_dense_patches=0) as off:
            with pytest.raises(ValueError, match="dense mode is off"):
                RemoteBackend([off.address], spec, quiet=True)
        # a size the server does not serve: refused at the start, naming what it allows
        with pytest.raises(ValueError, match="does not serve --resolution 80; it allows 64, 96"):
            RemoteBackend([server.address], OutputSpec(resolution=80), quiet=True)
    local_spec = OutputSpec(pooled=True, patch_layers=(-1,), dense=True, max_dense_patches=DENSE)
    local = job(LocalBackend(local_spec, engine=engine()), "local")
    for summary in (remote, local):
        assert (summary.embedded, summary.failed, summary.complete) == (len(ids), 1, True)

    stored = {name: open_outputs(str(tmp_path / name)) for name in ("remote", "local")}
    for result in stored.values():
        assert result.ids == ids and [f["id"] for f in result.failed] == ["z.jpg"]
        assert result.names == ["pooled", "patch_tokens.3", GRID]
        assert [tuple(g) for g in np.asarray(result[GRID])] == [grids[i] for i in ids]
        assert result["patch_tokens.3"].shape == (len(ids), DENSE, 64)
        identity = result.manifest["identity"]
        assert identity["dense"] is True and identity["num_patches"] == DENSE
        want_hash = Preprocessor(engine().cfg, Geometry(64, True, DENSE)).hash
        assert identity["preprocess_hash"] == want_hash
    # each image equals the in-process dense forward of its file; padding rows are zeros
    for row, name in enumerate(ids):
        blob = (tmp_path / "data" / name).read_bytes()
        want = in_process(engine(), [blob], OUTPUTS, resolutions=(64,), max_dense_patches=DENSE,
                          geometry=Geometry(64, dense=True))
        n = grids[name][0] * grids[name][1]
        for result in stored.values():
            tokens = np.asarray(result["patch_tokens.3"][row])
            assert_same_rows(tokens[:n], want.patch_tokens[3][0])
            assert not tokens[n:].any()
            assert_same_rows(np.asarray(result["pooled"][row])[None], want.pooled)
    # the local job computes each grid's images in solo batches: a rerun is bit-identical
    again = job(LocalBackend(local_spec, engine=engine()), "again")
    assert again.complete
    assert read_dir(tmp_path / "again") == read_dir(tmp_path / "local")

    # the CLI: --dense locally (Parquet: the grid column beside the tokens); misuse refused
    out = tmp_path / "cli"
    rc = main(["embed", data, "--output", str(out), "--local", "--mesh", MESH, "--dense",
               "--max-dense-patches", str(DENSE), "--outputs", "pooled,patch_tokens",
               "--format", "parquet", "--batch-size", "4", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    import pyarrow.parquet as pq

    table = pq.read_table(next((out / "shards").glob("*.parquet")))
    assert table.column(GRID).to_pylist()[:2] == [list(grids[i]) for i in ids[:2]]
    for flags, message in ((["--server", "127.0.0.1:1", "--max-dense-patches", "8"],
                            "--server and --max-dense-patches exclude each other"),
                           (["--frames", "2"], "--dense is for images")):
        rc = main(["embed", data, "--output", str(tmp_path / "x"), "--dense", *flags])
        assert rc == 2 and message in capsys.readouterr().err


def test_new_dense_grids_waiting_to_compile_are_bounded():
    """Each dense aspect ratio is a compile of its own (minutes for ViT-22B): a client cycling
    through them queued compiles without end (8 ratios, 7 compiles). While 4 grids wait for
    the compile thread, a fifth is RESOURCE_EXHAUSTED; a waiting grid is still taken, and the
    refused one is served once the others are compiled."""
    import threading
    import time

    from vit22b.server.engine import MAX_PENDING_COMPILES

    eng = engine()
    pooled = eng.resolve(OutputRequest())
    pre = Preprocessor(eng.cfg, Geometry(64, True, DENSE))
    grids: dict[tuple, tuple] = {}
    for size in [(64, w) for w in range(68, 200, 4)] + [(h, 64) for h in range(68, 200, 4)]:
        grid = eng.cfg.grid_at(*pre.crop(np.zeros((*size, 3), np.uint8)).shape[:2])
        if grid != tuple(eng.grid) and not eng.has_forwards(pooled, grid):
            grids.setdefault(grid, size)  # a grid no forward is compiled for yet
    assert len(grids) > MAX_PENDING_COMPILES
    (*waiting, (last_grid, last_size)) = list(grids.items())[: MAX_PENDING_COMPILES + 1]

    def dense(size) -> pb.EmbedRequest:
        return pb.EmbedRequest(images=[raw_image(random_images(1, 0, size)[0])], dense=True)

    compiling, release = threading.Event(), threading.Event()
    original = eng._compile

    def held_compile(*key):  # the compile thread busy until released
        compiling.set()
        release.wait(60)
        return original(*key)

    answers: list = []
    with _server() as server:
        stub = make_stub(server.address)

        def call(size) -> None:
            answers.append(stub.Embed(dense(size), timeout=120).grid_rows)

        eng._compile = held_compile
        sent = [size for _, size in waiting] + [waiting[0][1]]  # the first grid twice
        threads = [threading.Thread(target=call, args=(size,)) for size in sent]
        try:
            for thread in threads:
                thread.start()
            assert compiling.wait(30)
            queue, deadline = server.server.batcher._queue, time.monotonic() + 30
            while len(queue) < len(sent):
                assert time.monotonic() < deadline, len(queue)
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Embed(dense(last_size), timeout=60)
        finally:
            release.set()
            for thread in threads:
                thread.join(120)
            del eng._compile
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        rows, cols = last_grid
        assert (f"4 patch grids are waiting to be compiled (the limit); this request's images "
                f"make a {rows}x{cols} grid") in refused.value.details()
        assert sorted(answers) == sorted(grid[0] for grid, _ in [*waiting, waiting[0]])
        assert stub.Embed(dense(last_size), timeout=120).grid_rows == rows
        assert metric(metrics(server), "vit22b_queue_images") == 0
