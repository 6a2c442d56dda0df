"""Orbax checkpoints: save on one mesh, restore on another, refuse every broken or foreign one."""

import _thread
import functools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from peers import rel_err
from serving import capped_cli
from tiny_models import PARALLEL, images, random_params
from vit22b.clients.cli import main
from vit22b.model import OutputRequest, apply, get_config
from vit22b.model import checkpoint as ckpt
from vit22b.model.sharding import (
    MeshError,
    batch_sharding,
    make_mesh,
    param_shardings,
    shard_params,
)

REQUEST = OutputRequest(pooled=True, patch_layers=(-1,))
# A failed orbax restore leaves its read coroutines behind; they are reported when collected.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of PARALLEL written from parameters sharded on (2, 4)."""
    path = tmp_path_factory.mktemp("ckpt") / "parallel"
    params = shard_params(PARALLEL, random_params(PARALLEL, seed=5), make_mesh("data=2,model=4"))
    assert params["block_0"]["w_in"].sharding.mesh.shape == {"data": 2, "model": 4}
    meta = ckpt.save(path, PARALLEL, params, "random:seed=5")
    return path, params, meta


def _features(cfg, params, mesh):
    forward = jax.jit(
        lambda p, x: apply(cfg, p, x, REQUEST),
        in_shardings=(param_shardings(cfg, mesh), batch_sharding(mesh)),
    )
    return jax.tree.map(np.asarray, forward(params, images(cfg)))


def test_saved_on_2x4_restores_on_1x8_and_one_device_with_identical_features(saved):
    path, original, meta = saved
    one_device = make_mesh("auto", jax.devices()[:1])
    features = {}
    for mesh in (make_mesh("data=1,model=8"), one_device):
        cfg, params, restored_meta = ckpt.restore(path, mesh)
        assert cfg == PARALLEL and restored_meta == meta
        expected = param_shardings(cfg, mesh)
        for path_, leaf in ckpt.flatten(params).items():
            assert leaf.sharding == ckpt.flatten(expected)[path_], path_
            np.testing.assert_array_equal(
                np.asarray(leaf), np.asarray(ckpt.flatten(original)[path_])
            )
        assert ckpt.fingerprint(params) == meta.fingerprint
        got = _features(cfg, params, mesh)
        # the same features, bit for bit, as the saved parameters placed on the same mesh
        want = _features(cfg, shard_params(cfg, original, mesh), mesh)
        for key in ("pooled",):
            np.testing.assert_array_equal(got[key], want[key])
        np.testing.assert_array_equal(got["patch_tokens"][2], want["patch_tokens"][2])
        features[len(mesh.devices.flat)] = got
    # and across meshes they agree to rounding (the all-reduce sums in another order)
    assert rel_err(features[8]["pooled"], features[1]["pooled"]) < 1e-5


def test_metadata_beside_the_weights(saved):
    path, params, meta = saved
    assert sorted(p.name for p in path.iterdir()) == ["metadata.json", "params"]  # no classifier
    on_disk = json.loads((path / "metadata.json").read_text())
    assert on_disk["fingerprint"] == meta.fingerprint == ckpt.fingerprint(params)
    assert on_disk["source"] == "random:seed=5"
    assert on_disk["preprocess_hash"] == PARALLEL.preprocess_hash()
    assert on_disk["config"]["heads"] == 8 and on_disk["config"]["block"] == "parallel"
    assert on_disk["parameters"]["block_0/w_in"] == {"shape": [64, 8, 56], "dtype": "float32"}
    assert on_disk["param_count"] == sum(leaf.size for leaf in jax.tree.leaves(params))
    assert ckpt.read_metadata(path) == meta


def test_fingerprint_depends_on_every_byte_but_not_on_the_mesh():
    params = random_params(PARALLEL)
    base = ckpt.fingerprint(params)
    assert ckpt.fingerprint(shard_params(PARALLEL, params, make_mesh("data=1,model=8"))) == base
    params["block_1"]["b_out"][3] += 1e-6
    assert ckpt.fingerprint(params) != base


def test_a_classifier_is_kept_and_written_as_a_linear_head(tmp_path):
    cfg = PARALLEL.replace(num_classes=5)
    params = random_params(cfg, seed=1)
    ckpt.save(tmp_path / "c", cfg, params, "test")
    head = np.load(tmp_path / "c" / "head.npz")
    np.testing.assert_array_equal(head["kernel"], params["classifier"])
    np.testing.assert_array_equal(head["bias"], params["classifier_bias"])
    assert ckpt.read_metadata(tmp_path / "c").to_dict()["classifier"]["num_classes"] == 5


def test_writes_of_a_failed_save_that_land_late_are_removed_too(tmp_path, monkeypatch):
    """orbax stops awaiting a save at its first failed write; the others run on in
    tensorstore's threads and can land after the staging folder was removed (a full run of the
    suite once found it left behind). Here one lands 30 ms after the failure."""
    writers = []

    def failing_write(folder, *args):
        def late():
            threading.Event().wait(0.03)
            (folder / "params" / "d").mkdir(parents=True, exist_ok=True)
            (folder / "params" / "d" / "chunk").write_bytes(b"late")
        writers.append(threading.Thread(target=late))
        writers[-1].start()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_write", failing_write)
    # a settle far longer than the late write's 30 ms: a loaded host may start its thread late
    monkeypatch.setattr(ckpt, "_remove_for_good",
                        functools.partial(ckpt._remove_for_good, settle_s=1.0))
    with pytest.raises(OSError, match="No space left"):
        ckpt.save(tmp_path / "c", PARALLEL, random_params(PARALLEL, seed=1), "test")
    writers[0].join()  # it landed during the save's removal, not after this check
    assert list(tmp_path.iterdir()) == []


def test_cli_init_writes_a_checkpoint_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["init", "--model", "vit-22b-tiny/16", "--seed", "2", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["model"] == "vit-22b-tiny/16" and summary["source"] == "init:seed=2"
    cfg, params, meta = ckpt.restore(out, make_mesh("data=2,model=4"), verify=True)
    assert cfg == get_config("vit-22b-tiny/16") and meta.fingerprint == summary["fingerprint"]

    assert main(["init", "--model", "vit-22b-tiny/16", "--seed", "3", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert ckpt.read_metadata(out).fingerprint == summary["fingerprint"]  # untouched
    assert main(["init", "--model", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def _init_limited(out: Path, *flags: str, max_file_bytes: int = 0):
    return capped_cli(max_file_bytes, "init", "--model", "vit-22b-tiny/16", "--out", str(out),
                      *flags)


def test_a_save_that_fails_on_the_disk_leaves_the_checkpoint_it_would_replace(tmp_path):
    """The new checkpoint is written beside the old and renamed into place when whole: a full
    disk during an --overwrite had removed the old one first and left half a new one, which a
    rerun then refused as "not a checkpoint directory"; orbax's failure also printed hundreds
    of lines of tracebacks."""
    out = tmp_path / "c"
    assert _init_limited(out, "--seed", "1").returncode == 0
    kept = ckpt.read_metadata(out).fingerprint
    failed = _init_limited(out, "--seed", "2", "--overwrite", max_file_bytes=64 << 10)
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert failed.stderr.strip() == f"vit22b init: {out}: File too large", failed.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no staging folder left
    cfg, params, meta = ckpt.restore(out, make_mesh("data=2,model=4"), verify=True)
    assert meta.fingerprint == kept
    fresh = _init_limited(tmp_path / "new", max_file_bytes=64 << 10)  # no checkpoint before
    assert fresh.returncode == 1 and not (tmp_path / "new").exists(), fresh.stderr[-2000:]
    assert _init_limited(out, "--seed", "2", "--overwrite").returncode == 0
    assert ckpt.read_metadata(out).fingerprint != kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_save_left_unfinished_by_an_earlier_version_can_be_replaced(tmp_path):
    """Before saves were staged, a failed one left orbax's temporary params folder in place."""
    out = tmp_path / "c"
    (out / (ckpt.PARAMS_DIR + ".orbax-checkpoint-tmp")).mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError, match="overwrite to replace"):
        ckpt.check_writable(out)
    assert ckpt.check_writable(out, overwrite=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint directory"):
        ckpt.check_writable(tmp_path / "mine", overwrite=True)


# ------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------

MESH = "data=2,model=4"


def _copy(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved[0], tmp_path / "copy"))


def test_missing_checkpoints_are_refused(saved, tmp_path):
    mesh = make_mesh(MESH)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint at .*nothing: no such directory"):
        ckpt.restore(tmp_path / "nothing", mesh)
    (tmp_path / "a-file").write_text("weights?")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint at .*a-file: not a directory"):
        ckpt.restore(tmp_path / "a-file", mesh)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="has no metadata.json"):
        ckpt.restore(tmp_path / "empty", mesh)
    copy = _copy(saved, tmp_path)
    shutil.rmtree(copy / "params")
    with pytest.raises(ckpt.CheckpointError, match="no params/ directory: the weights are missing"):
        ckpt.restore(copy, mesh)


def test_truncated_weights_are_refused_naming_the_parameter(saved, tmp_path, caplog):
    copy = _copy(saved, tmp_path)
    data = max(
        (p for p in (copy / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with caplog.at_level(logging.INFO, logger="absl"), pytest.raises(ckpt.CheckpointError) as err:
        ckpt.restore(copy, make_mesh(MESH))
    assert "cannot be restored" in str(err.value)
    assert err.match(r"parameter \S+ \(shape \(\d+(, \d+)*\), float32\): stored data is unreadable")
    # the search for the bad parameters (one restore each) does not bury the refusal under
    # orbax's INFO lines: those of the first, failed restore alone get through
    parameters = len(jax.tree.leaves(saved[1]))
    orbax_lines = [r for r in caplog.records if r.name == "absl"]
    assert parameters > 20 and len(orbax_lines) < parameters, len(orbax_lines)


_RESTORE_THEN_WAIT = """
import sys, time
from vit22b.model import checkpoint
from vit22b.model.sharding import make_mesh
try:
    checkpoint.restore(sys.argv[1], make_mesh(sys.argv[2]))
except checkpoint.CheckpointError as err:
    print(err, flush=True)
time.sleep(1)  # where the abandoned reads' tracebacks arrived
"""


def test_a_damaged_index_is_refused_naming_its_file_and_prints_nothing_after(saved, tmp_path):
    """The store's manifest and tree nodes carry checksums: a flipped byte or a missing node is
    refused naming the file. Found by mutating a checkpoint's files: orbax read the index in one
    gather, and the reads it abandoned printed about forty tracebacks in the second after. (In a
    new process: in this one, warm from the module's own restores, they did not show.)"""
    manifest = _copy(saved, tmp_path) / "params" / "manifest.ocdbt"
    blob = bytearray(manifest.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    manifest.write_bytes(bytes(blob))
    missing = _copy(saved, tmp_path / "2")
    shutil.rmtree(missing / "params" / "d")  # the tree nodes: the manifest points at nothing
    for copy, refusal in ((manifest.parent.parent, r"DATA_LOSS.*manifest.ocdbt.*checksum"),
                          (missing, r"NOT_FOUND.*params/d/")):
        done = subprocess.run(  # the environment's XLA_FLAGS: conftest's 8 devices
            [sys.executable, "-c", _RESTORE_THEN_WAIT, str(copy), MESH],
            capture_output=True, text=True, timeout=120)
        assert re.search(r"params: the weights' index is unreadable \(truncated or corrupt\): .*"
                         + refusal, done.stdout), done.stdout + done.stderr
        assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_what_native_threads_write_during_a_restore_is_dropped(capsys):
    """The reads a failed restore abandons end on orbax's closed event loop, and tensorstore's
    threads print a traceback for each through ``sys.stderr`` as the first read fails, before
    ``_quiet_orbax`` starts (a sweep of mutated checkpoints, each restored in a new process:
    10 of 22 refusals for damaged data printed one or two). For the restore, what threads
    Python did not start write (here one from ``_thread``, as tensorstore's appear) is dropped;
    Python's own threads still print."""
    written = threading.Event()

    def native() -> None:
        sys.stderr.write("an abandoned read's traceback\n")
        written.set()

    with ckpt._native_threads_muted():
        _thread.start_new_thread(native, ())
        assert written.wait(10)
        sys.stderr.write("a log line\n")
        thread = threading.Thread(target=lambda: sys.stderr.write("a thread's line\n"))
        thread.start()
        thread.join()
    err = capsys.readouterr().err
    assert "a log line" in err and "a thread's line" in err
    assert "abandoned read" not in err


def test_what_is_not_a_file_or_folder_under_params_is_refused_unread(saved, tmp_path):
    """A FIFO in place of one of orbax's files blocked the restore for ever (found by the same
    mutations); a dangling link is named too."""
    copy = _copy(saved, tmp_path)
    for name in ("_CHECKPOINT_METADATA", "manifest.ocdbt"):
        (copy / "params" / name).rename(copy / name)
        os.mkfifo(copy / "params" / name)
        with pytest.raises(ckpt.CheckpointError, match=f"params/{name} is a FIFO, not a regular "
                                                       "file or a folder: refused unread"):
            ckpt.restore(copy, make_mesh(MESH))
        (copy / "params" / name).unlink()
        (copy / name).rename(copy / "params" / name)
    (copy / "params" / "d" / "gone").symlink_to(tmp_path / "nothing")
    with pytest.raises(ckpt.CheckpointError, match="params/d/gone cannot be read: No such file"):
        ckpt.restore(copy, make_mesh(MESH))
    (copy / "params" / "d" / "gone").unlink()
    ckpt.restore(copy, make_mesh(MESH), verify=True)  # put back: whole again


def test_asyncio_reports_of_abandoned_reads_are_dropped_and_no_others():
    """Reads a failed restore abandoned are reported by asyncio when collected, after the
    refusal: a task names orbax's coroutine, a bare future only tensorstore's error, a gather
    neither but its traceback (the last two each got through now and then: about once in
    eight `vit22b serve` runs on a truncated checkpoint, and once in twenty)."""
    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    read = ("ValueError('OUT_OF_RANGE: Error reading \"block_0.w_out/0.0.0\" in OCDBT database "
            "at local file \"/tmp/c/params/\": Requested byte range [1, 9) is not valid')")
    task = (f"Task exception was never retrieved\nfuture: <Task finished coro=<f() done, defined"
            f" at {os.sep}site-packages{os.sep}orbax{os.sep}x.py:1> exception={read}>")
    assert not ckpt._not_an_orbax_read(record(task))
    assert not ckpt._not_an_orbax_read(record(f"Future exception was never retrieved\n"
                                              f"future: <Future finished exception={read}>"))
    others = ("Future exception was never retrieved\nfuture: <Future finished exception="
              "ValueError('a caller's own')>", "Task exception was never retrieved\nfuture: "
              "<Task finished coro=<mine() done> exception=OSError()>")
    assert all(ckpt._not_an_orbax_read(record(message)) for message in others)
    # a gather's report names neither; its error's traceback runs through orbax's modules
    orbax_module = f"{os.sep}site-packages{os.sep}orbax{os.sep}serialization.py"
    try:
        exec(compile("raise Exception('Encountered error while reading array index')",
                     orbax_module, "exec"))
    except Exception as err:  # noqa: BLE001 - the error a read raised there
        gathered = record("_GatheringFuture exception was never retrieved\nfuture: "
                          "<_GatheringFuture finished exception=Exception('Encountered error')>")
        gathered.exc_info = (type(err), err, err.__traceback__)
        assert not ckpt._not_an_orbax_read(gathered)
        gathered.exc_info = None  # the same words without orbax's frames: someone else's
        assert ckpt._not_an_orbax_read(gathered)


def test_wrong_preset_is_refused_naming_parameter_and_both_shapes(saved):
    tiny = get_config("vit-22b-tiny/16")  # 4 heads, the checkpoint has 8
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.restore(saved[0], make_mesh(MESH), expect=tiny)
    assert err.match(
        r"parameter block_0/w_in: the checkpoint has shape \(64, 8, 56\), "
        r"model vit-22b-tiny/16 expects \(64, 4, 112\)"
    )


def test_stored_parameter_of_the_wrong_shape_is_refused(saved, tmp_path):
    """Weights of another architecture under this config's metadata: caught by parameter."""
    other = PARALLEL.replace(mlp_dim=512, qkv_bias=True)
    ckpt.save(tmp_path / "other", other, random_params(other), "test")
    copy = _copy(saved, tmp_path)
    shutil.rmtree(copy / "params")
    shutil.copytree(tmp_path / "other" / "params", copy / "params")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.restore(copy, make_mesh(MESH))
    message = str(err.value)
    assert "does not match its config" in message
    assert (
        "parameter block_0/w_in: the stored checkpoint has shape (64, 8, 88), "
        "config tiny-parallel-8h expects (64, 8, 56)"
    ) in message
    assert (
        "parameter block_0/b_qkv: the stored checkpoint has shape (8, 24), "
        "config tiny-parallel-8h has no such parameter"
    ) in message


def test_metadata_that_disagrees_with_its_own_parameter_table_is_refused(saved, tmp_path):
    copy = _copy(saved, tmp_path)
    meta = json.loads((copy / "metadata.json").read_text())
    meta["config"]["mlp_dim"] = 512
    (copy / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"parameter block_0/w_in: metadata.json has "
        r"shape \(64, 8, 56\), config tiny-parallel-8h expects \(64, 8, 88\)",
    ):
        ckpt.restore(copy, make_mesh(MESH))


def test_unreadable_or_future_metadata_is_refused(saved, tmp_path):
    copy = _copy(saved, tmp_path)
    (copy / "metadata.json").rename(copy / "kept.json")
    os.mkfifo(copy / "metadata.json")  # read, it would wait for a writer for ever
    with pytest.raises(ckpt.CheckpointError, match="metadata.json is a FIFO, not a regular file"):
        ckpt.read_metadata(copy)
    (copy / "metadata.json").unlink()
    (copy / "kept.json").rename(copy / "metadata.json")
    with open(copy / "metadata.json", "wb") as f:  # sparse: a gigabyte of nothing
        f.truncate(1 << 30)
    with pytest.raises(ckpt.CheckpointError, match=r"metadata.json is unreadable: 1073741824 "
                                                    r"bytes, over the 67108864"):
        ckpt.read_metadata(copy)
    (copy / "metadata.json").write_text("{ not json")
    with pytest.raises(ckpt.CheckpointError, match="metadata.json is unreadable"):
        ckpt.read_metadata(copy)
    for text, reason in (("null", "it holds null, not a JSON object"),  # were a TypeError's
                         ("[1]", "it holds an array, not a JSON object"),  # and KeyError's
                         ('{"config": 5}', r"no format_version \(not a vit22b checkpoint's")):
        (copy / "metadata.json").write_text(text)
        with pytest.raises(ckpt.CheckpointError, match=f"metadata.json is unreadable: {reason}"):
            ckpt.read_metadata(copy)
    meta = saved[2].to_dict() | {"format_version": ckpt.FORMAT_VERSION + 1}
    (copy / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="newer than this code's"):
        ckpt.read_metadata(copy)
    # hand edits of the wrong kind: "false" was read as true, a parameter table that is not
    # an object raised AttributeError
    for key, value, message in (("gelu_exact", "false", "gelu_exact='false' is not true or false"),
                                ("norm_eps", "1e-6", "norm_eps='1e-6' is not a finite number")):
        meta = saved[2].to_dict()
        meta["config"][key] = value
        (copy / "metadata.json").write_text(json.dumps(meta))
        with pytest.raises(ckpt.CheckpointError, match=f"metadata.json is unreadable: .*{message}"):
            ckpt.read_metadata(copy)
    (copy / "metadata.json").write_text(json.dumps(saved[2].to_dict() | {"parameters": [1]}))
    with pytest.raises(ckpt.CheckpointError, match="metadata.json is unreadable: AttributeError"):
        ckpt.read_metadata(copy)


def test_verify_catches_weights_swapped_under_the_metadata(saved, tmp_path):
    ckpt.save(tmp_path / "b", PARALLEL, random_params(PARALLEL, seed=9), "test")
    copy = _copy(saved, tmp_path)
    shutil.rmtree(copy / "params")
    shutil.copytree(tmp_path / "b" / "params", copy / "params")
    ckpt.restore(copy, make_mesh(MESH))  # same shapes: only the fingerprint can tell
    with pytest.raises(ckpt.CheckpointError, match="fingerprint is .*, the metadata says"):
        ckpt.restore(copy, make_mesh(MESH), verify=True)


def test_a_mesh_that_does_not_fit_is_refused_before_reading(saved):
    with pytest.raises(MeshError, match=r"model axis \(3\) does not divide heads \(8\)"):
        ckpt.restore(saved[0], make_mesh("data=1,model=3", jax.devices()[:3]))


def test_a_checkpoint_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ckpt.CheckpointError, match="a-file exists and is not a folder"):
        ckpt.check_writable(tmp_path / "a-file")


def test_save_refuses_parameters_that_do_not_fit_and_existing_directories(saved, tmp_path):
    params = random_params(PARALLEL)
    params["block_2"]["w_out"] = np.zeros((4, 80, 64), np.float32)
    del params["map_head"]["probe"]
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.save(tmp_path / "bad", PARALLEL, params, "test")
    assert (
        "parameter block_2/w_out: the parameter tree has shape (4, 80, 64), "
        "config tiny-parallel-8h expects (8, 40, 64)"
    ) in str(err.value)
    assert "map_head/probe: missing from the parameter tree" in str(err.value)
    with pytest.raises(ckpt.CheckpointError, match="already exists and is not empty"):
        ckpt.save(saved[0], PARALLEL, random_params(PARALLEL), "test")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint directory"):
        ckpt.save(tmp_path / "notes", PARALLEL, random_params(PARALLEL), "test", overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
