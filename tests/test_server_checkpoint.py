"""Serving a checkpoint: restored onto the mesh, named by its metadata in every response."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serving import MAX_BATCH, MESH, in_process, random_images, shared_engine
from vit22b.clients import FeatureClient
from vit22b.model import checkpoint, get_config
from vit22b.model.sharding import init_sharded, make_mesh
from vit22b.server.app import BackgroundServer, ServeConfig, build_engine
from vit22b.server.engine import Engine

MODEL = "vit-22b-tiny/16"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-seed3"
    cfg = get_config(MODEL)
    params = init_sharded(cfg, make_mesh(MESH), seed=3)
    meta = checkpoint.save(path, cfg, params, source="init:seed=3")
    return path, meta


def test_checkpoint_round_trips_through_the_server(saved):
    path, meta = saved
    config = ServeConfig(
        checkpoint=str(path), mesh=MESH, port=0, metrics_port=None, max_batch_images=MAX_BATCH
    )
    engine = build_engine(config)
    assert engine.identity.fingerprint == meta.fingerprint
    images = random_images(4, seed=21)
    with BackgroundServer(config, engine=engine) as server:
        with FeatureClient(server.address) as client:
            info = client.model_info()
            got = client.embed(images)
    assert info.source == "init:seed=3" and info.model.fingerprint == meta.fingerprint
    assert got.model.fingerprint == meta.fingerprint
    np.testing.assert_array_equal(got.pooled, in_process(engine, images)["pooled"])
    # Other weights than the seed-0 default: other features, another fingerprint.
    default = shared_engine()
    assert default.identity.fingerprint != meta.fingerprint
    assert not np.allclose(got.pooled, in_process(default, images)["pooled"])


def test_a_checkpoint_whose_bytes_changed_is_refused_at_start_up(saved, tmp_path):
    """A byte flipped in the stored weights can still decode (no checksum in the store): the
    server recomputes the fingerprint and refuses, unless told not to verify. (A flip that
    lands on zstd's framing is refused as unreadable instead: which bytes are framing depends
    on how the save laid out its files, so the flip is the first, from the middle of the
    largest data file on, that still decodes to other weights.)"""
    import shutil

    copy = Path(shutil.copytree(saved[0], tmp_path / "flipped"))
    data = max((p for p in (copy / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    whole = data.read_bytes()
    for offset in range(len(whole) // 2, len(whole), 4099):
        blob = bytearray(whole)
        blob[offset] ^= 0xFF
        data.write_bytes(bytes(blob))
        try:
            _, params, _ = checkpoint.restore(copy, make_mesh(MESH))
        except checkpoint.CheckpointError as err:
            assert "unreadable, truncated or corrupt" in str(err)
            continue
        if checkpoint.fingerprint(params) != saved[1].fingerprint:
            break
    else:
        pytest.fail(f"no flipped byte of {data} decoded to other weights")
    config = ServeConfig(checkpoint=str(copy), mesh=MESH, port=0, metrics_port=None,
                         max_batch_images=MAX_BATCH)
    with pytest.raises(checkpoint.CheckpointError, match="modified or corrupted"):
        build_engine(config)
    unverified = Engine.load(checkpoint_dir=str(copy), mesh=MESH, verify=False)
    assert unverified.identity.fingerprint == saved[1].fingerprint  # what it would have claimed
    assert checkpoint.fingerprint(unverified.params) != saved[1].fingerprint


def test_serve_refuses_a_checkpoint_of_another_model(saved):
    path, _ = saved
    with pytest.raises(checkpoint.CheckpointError, match="vit-b/16"):
        build_engine(ServeConfig(checkpoint=str(path), model="vit-b/16", mesh=MESH))


def test_serve_cli_reports_a_missing_checkpoint_and_exits_2(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vit22b.clients.cli",
            "serve",
            "--checkpoint",
            str(tmp_path / "nothing"),
            "--port",
            "0",
            "--metrics-port",
            "-1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "vit22b serve:" in result.stderr and "nothing" in result.stderr
