"""`vit22b probe KIND`: in-process features, saved features, a real server, embed output folders."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serving import capped_cli, self_signed, start_server
from vit22b.clients import FeatureClient
from vit22b.clients.cli import main
from vit22b.clients.demo import SAMPLE
from vit22b.model.identity import KEY_NAMES
from vit22b.probes.data import shapes_world
from vit22b.probes.features import features_from_model, features_from_server
from vit22b.probes.heads import LinearHead, save_head
from vit22b.probes.shape_bias import CATEGORIES


def test_the_probes_on_features_never_import_jax():
    """jax, flax and optax load only for the probes that train (depth, segmentation, video):
    the others, over features a server or a file gave, start in a fraction of a second (the
    CLI's `probe --help` took 3.6-6.3 s while the decoders' module was imported up front)."""
    code = (
        "import sys\n"
        "import numpy as np\n"
        "import vit22b.probes.cli\n"
        "from vit22b.probes.features import Features\n"
        "from vit22b.probes.runner import ProbeData, run_probe\n"
        "rng = np.random.default_rng(0)\n"
        "labels = np.repeat(np.arange(4), 20)\n"
        "pooled = (rng.standard_normal((80, 16)) + labels[:, None]).astype(np.float32)\n"
        "data = ProbeData(Features(pooled=pooled), labels=labels, class_names=tuple('abcd'))\n"
        "for kind in ('linear', 'knn', 'fewshot', 'calibration'):\n"
        "    run_probe(kind, data)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _report(out: Path, kind: str) -> dict:
    return json.loads((out / f"{kind}.json").read_text())


def test_linear_on_the_shapes_world_in_process(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["probe", "linear", "--shapes-world", "160", "--out", str(out),
                 "--save-features", str(tmp_path / "f.npz")]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    report = _report(out, "linear")
    assert report["num_images"] == 160 and report["num_classes"] == 8
    assert report["features"]["model"] == "vit-22b-tiny/16"
    assert f"top-1 {report['top1']:.4f}" in printed
    # The same probe on the saved features gives the same figures.
    again = tmp_path / "again"
    assert main(["probe", "linear", "--features", str(tmp_path / "f.npz"),
                 "--out", str(again)]) == 0  # fmt: skip
    assert _report(again, "linear")["top1"] == report["top1"]


def test_results_the_disk_cannot_take_fail_in_one_line_and_leave_no_part(tmp_path):
    """A full disk left a truncated features file under its final name (plain np.savez) and the
    report's temporary file, said "[Errno 28] ..." naming no file, exit 2 (a bad input's);
    `explore` ended in a traceback from the figure's write."""
    features = tmp_path / "f.npz"
    done = capped_cli(16 << 10, "probe", "linear", "--shapes-world", "160", "--out",
                   str(tmp_path / "out"), "--save-features", str(features))
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr == f"vit22b probe linear: error: {features}: File too large\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert list((tmp_path / "out").iterdir()) == []
    done = capped_cli(4 << 10, "explore", "--tokens", "16", "--out", str(tmp_path / "x"))
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (  # after matplotlib's word on its font cache
        f"vit22b explore: error: {tmp_path / 'x' / 'entropy_vs_scale.png'}: File too large")
    assert "Traceback" not in done.stderr
    assert list((tmp_path / "x").iterdir()) == []


def _write_dense_folders(root: Path, n: int) -> None:
    world = shapes_world(n, seed=2)
    for sub in ("images", "depth", "masks"):
        (root / sub).mkdir(parents=True)
    for i in range(n):
        Image.fromarray(world.images[i]).save(root / "images" / f"{i:03d}.png")
        np.save(root / "depth" / f"{i:03d}.npy", world.depth[i])
        Image.fromarray(world.mask[i], "L").save(root / "masks" / f"{i:03d}.png")


def test_depth_and_segmentation_on_paired_folders(tmp_path):
    _write_dense_folders(tmp_path / "set", 32)
    args = ["--data", str(tmp_path / "set" / "images"), "--steps", "20", "--out", str(tmp_path)]
    assert main(["probe", "depth", *args, "--depth", str(tmp_path / "set" / "depth"),
                 "--decoders", "linear"]) == 0  # fmt: skip
    depth = _report(tmp_path, "depth")
    assert depth["layers"] == [0, 1, 2, 3] and "dpt" not in depth
    assert depth["num_test"] == 8 and depth["linear"]["rmse"] > 0
    assert main(["probe", "segmentation", *args, "--masks", str(tmp_path / "set" / "masks")]) == 0
    seg = _report(tmp_path, "segmentation")
    assert seg["num_classes"] == int(shapes_world(32, seed=2).mask.max()) + 1
    assert (tmp_path / "depth.png").is_file() and (tmp_path / "segmentation.png").is_file()


def test_segmentation_leaves_voc_style_border_pixels_out(tmp_path):
    """Masks whose object borders are 255 (VOC's void label): no class 255 is learnt."""
    _write_dense_folders(tmp_path / "set", 16)
    world = shapes_world(16, seed=2)
    obj = world.mask > 0
    inner = obj.copy()  # the object shrunk by one pixel; the ring around it is void
    inner[:, 1:-1, 1:-1] &= (obj[:, :-2, 1:-1] & obj[:, 2:, 1:-1]
                             & obj[:, 1:-1, :-2] & obj[:, 1:-1, 2:])
    voc = np.where(obj & ~inner, 255, world.mask).astype(np.uint8)
    masks = tmp_path / "voc"
    masks.mkdir()
    for i in range(16):
        Image.fromarray(voc[i], "L").save(masks / f"{i:03d}.png")
    args = ["probe", "segmentation", "--data", str(tmp_path / "set" / "images"), "--masks",
            str(masks), "--steps", "10"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    seg = _report(tmp_path / "a", "segmentation")
    assert seg["num_classes"] == int(world.mask.max()) + 1 < 255
    assert seg["ignore_index"] == 255 and seg["ignored_pixels"] == int((voc == 255).sum()) > 0
    assert (tmp_path / "a" / "segmentation.png").is_file()
    assert main([*args, "--ignore-index", "none", "--out", str(tmp_path / "b")]) == 0
    seg = _report(tmp_path / "b", "segmentation")  # asked for: 255 is a class
    assert seg["num_classes"] == 256 and seg["ignore_index"] is None
    with pytest.raises(SystemExit):
        main([*args, "--ignore-index", "-1", "--out", str(tmp_path / "c")])


def test_shape_bias_of_the_cue_conflict_sample_through_an_imported_imagenet_head(tmp_path):
    rng = np.random.default_rng(0)
    head = tmp_path / "imagenet_head.npz"
    save_head(head, LinearHead(rng.standard_normal((64, 1000)).astype(np.float32),
                               np.zeros(1000, np.float32)))  # fmt: skip
    assert main(["probe", "shape-bias", "--data", str(SAMPLE), "--head", str(head),
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    report = _report(tmp_path, "shape-bias")
    assert report["decisions_from"].startswith("1000-way ImageNet head mapped to 16")
    assert report["same_category_excluded"] == 6 and report["conflict_images"] == 74
    decided = report["shape_decisions"] + report["texture_decisions"] + report["other_decisions"]
    assert decided == 74
    assert set(report["per_category"]) == set(CATEGORIES)


def test_calibration_with_an_imported_head_on_digits(tmp_path):
    rng = np.random.default_rng(1)
    head = tmp_path / "digits_head.npz"
    save_head(head, LinearHead(rng.standard_normal((64, 10)).astype(np.float32),
                               np.zeros(10, np.float32), tuple("0123456789")))  # fmt: skip
    assert main(["probe", "calibration", "--digits", "--head", str(head),
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    report = _report(tmp_path, "calibration")
    assert report["logits_from"] == "imported head"
    assert abs(report["num_test"] - 0.2 * 1797) < 10  # a fifth of the digits, per class
    assert report["after"]["accuracy"] == report["before"]["accuracy"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["depth", "--data", "IMAGES"], "needs --depth DIR or --masks DIR"),
        (["shape-bias", "--data", "SAMPLE"], "needs their decisions: --head FILE"),
        (["linear", "--features", "MISSING"], "missing.npz: not a features .npz"),
        (["calibration", "--digits", "--head", "MISSING"], "missing.npz: not a readable"),
        (["depth", "--shapes-world", "16", "--layers", "9"], "layer index 9 is out of range"),
        (["segmentation", "--features", "EMPTY"], "not a vit22b embed output directory"),
        (["linear", "--shapes-world", "4"], "at least 8 images"),
        (["depth", "--features", "EMPTY", "--layers", "2"], "--layers chooses the layers"),
    ],
)
def test_bad_probe_commands_fail_with_the_reason(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    paths = {"IMAGES": tmp_path, "SAMPLE": SAMPLE, "MISSING": tmp_path / "missing.npz",
             "EMPTY": tmp_path / "empty"}  # fmt: skip
    argv = [str(paths.get(a, a)) for a in argv]
    assert main(["probe", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["knn", "--ks", "0"], ["knn", "--temperature", "0"],
                                  ["fewshot", "--shots", "5,-1"], ["calibration", "--bins", "0"],
                                  ["knn", "--temperature", "inf"], ["depth", "--steps", "-1"],
                                  ["linear", "--steps", "0"], ["linear", "--world-size", "0"],
                                  ["video", "--frames", "0"], ["video", "--frames", "1e3"],
                                  ["video", "--frames", "abc"]])
def test_counts_and_temperatures_must_be_positive(tmp_path, capsys, argv):
    """Each was taken before: a 0-NN "accuracy", a temperature of 0 replaced by 0.07, 0 bins
    by 15, an infinite temperature (uniform votes), -1 steps (an optimiser's error deep in
    the run), 0 steps (the default, silently)."""
    with pytest.raises(SystemExit) as refused:
        main(["probe", *argv, "--digits", "--out", str(tmp_path)])
    assert refused.value.code == 2 and "expected positive values" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "x"])
def test_the_world_seed_is_named_when_refused(tmp_path, capsys, value):
    """numpy's "expected non-negative integer" reached the user without the flag's name."""
    with pytest.raises(SystemExit) as refused:
        main(["probe", "video", "--moving-world", "8", "--world-seed", value, "--out",
              str(tmp_path)])  # fmt: skip
    assert refused.value.code == 2
    words = {"-1": "the shapes world's seed is numpy's: 0 or more, got -1",
             "x": "a seed is an integer, got 'x'"}[value]
    assert f"argument --world-seed: {words}" in capsys.readouterr().err


def test_image_files_are_decoded_by_the_pixel_contract_in_process(tmp_path, capsys):
    """Without a server the probes decoded files with Pillow's convert("RGB"), the server with
    the pixel contract: a 16-bit grey PNG came out clipped at 255 (white wherever its value
    passed 255 of 65535), so in-process and served features of a folder differed. The same
    picture as 16-bit and as 8-bit grey now gives the same features, and a file over the size
    limit is named."""
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (40, 48), dtype=np.uint8)
    for name in ("a", "b"):
        (tmp_path / "set" / name).mkdir(parents=True)
        for i in range(2, 5):
            Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(
                tmp_path / "set" / name / f"{i}.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "set" / "a" / "0-16bit.png")
    Image.fromarray(grey).save(tmp_path / "set" / "a" / "1-8bit.png")
    assert Image.open(tmp_path / "set" / "a" / "0-16bit.png").mode.startswith("I;16")
    saved = tmp_path / "f.npz"
    assert main(["probe", "knn", "--data", str(tmp_path / "set"), "--ks", "1",
                 "--out", str(tmp_path / "out"), "--save-features", str(saved)]) == 0
    pooled = np.load(saved)["pooled"]
    np.testing.assert_array_equal(pooled[0], pooled[1])  # rows in file order: 0-16bit, 1-8bit
    Image.new("1", (9000, 9000)).save(tmp_path / "set" / "b" / "5-big.png")  # 81 MP
    capsys.readouterr()
    assert main(["probe", "knn", "--data", str(tmp_path / "set"),
                 "--out", str(tmp_path / "out")]) == 2
    assert f"{tmp_path}/set/b/5-big.png: declared size of the PNG is 9000x9000" in (
        capsys.readouterr().err)


def test_in_process_features_come_in_chunks_and_name_a_bad_image_across_them(monkeypatch):
    """In-process features are embedded IN_PROCESS_CHUNK images at a time from an iterator (a
    folder's files read as they are needed, not all held), with the same features as one
    list, and a bad image named by its place in the whole input."""
    import io

    import vit22b.clients.embed_local as embed_local
    from vit22b.probes.data import DataError

    images = shapes_world(12, seed=3).images
    whole = features_from_model(images)
    monkeypatch.setattr(embed_local, "IN_PROCESS_CHUNK", 5)
    chunked = features_from_model(iter(list(images)))
    # batches of 5 run other programs than one of 12: equal to rounding (the README's batch
    # bounds; bit-equal on some hosts only), each row its own image's
    scale = np.abs(whole.pooled).max()
    np.testing.assert_allclose(chunked.pooled, whole.pooled, rtol=0, atol=5e-3 * scale)
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    encoded[7] = b"junk"
    with pytest.raises(DataError, match=r"^f7: not an image file"):  # ids of any iterable
        features_from_model(iter(encoded), ids=iter([f"f{i}" for i in range(12)]))
    with pytest.raises(DataError, match=r"^image 7: not an image file"):
        features_from_model(encoded)
    with pytest.raises(ValueError, match="the ids ran out at image 6: give one id per image"):
        features_from_model(iter(images), ids=iter([f"f{i}" for i in range(6)]))  # none dropped
    with pytest.raises(ValueError, match="more ids than the 12 images: give one id per image"):
        features_from_model(iter(images), ids=iter([f"f{i}" for i in range(13)]))


def test_generated_worlds_and_in_process_resolutions_are_bounded(tmp_path, capsys):
    """`--shapes-world 100000000` died in numpy's MemoryError traceback, `--moving-world 100000`
    would have taken 19.5 GiB, and `--resolution 4096` on in-process features ran past five
    minutes while 100000 was killed for memory: each is now refused before it allocates."""
    out = ["--out", str(tmp_path)]
    assert main(["probe", "linear", "--shapes-world", "100000000", *out]) == 2
    assert ("a shapes world of 100000000 images of 64x64 takes 3051.8 GiB; a generated world "
            "may take 2 GiB") in capsys.readouterr().err
    assert main(["probe", "video", "--moving-world", "100000", *out]) == 2
    assert "a moving world of 100000 videos of 17 frames of 64x64 takes 19.5 GiB" in (
        capsys.readouterr().err)
    for size in ("4096", "100000"):
        assert main(["probe", "linear", "--digits", "--resolution", size, *out]) == 2
        err = capsys.readouterr().err
        assert f"vit-22b-tiny/16: resolution {size}: " in err, err
        assert ("patches an image do not fit the in-process engine's batch budget of 16384 "
                "patches (a square input of at most 2048 pixels)") in err


def test_outputs_that_cannot_be_written_are_refused_before_the_model_runs(tmp_path, capsys):
    """--out under a file, or a --save-features folder, failed only after the embedding and the
    probe had run (an OSError's words, no flag named); now before anything is computed."""
    (tmp_path / "file").write_text("not a folder")
    cases = (
        (["--out", str(tmp_path / "file")], f"--out {tmp_path}/file: {tmp_path}/file is a file, "
         "not a folder"),
        (["--out", str(tmp_path / "file" / "x")], f"--out {tmp_path}/file/x: {tmp_path}/file/x "
         "cannot hold files (Not a directory)"),
        (["--out", str(tmp_path / "o"), "--save-features", str(tmp_path)],
         f"--save-features {tmp_path}: a folder, not a file name"),
        (["--out", str(tmp_path / "o"), "--save-features", str(tmp_path / "file" / "f.npz")],
         f"--save-features {tmp_path}/file/f.npz: {tmp_path}/file is a file, not a folder"),
    )
    for flags, message in cases:
        assert main(["probe", "knn", "--shapes-world", "100000000", *flags]) == 2  # not made
        assert message in capsys.readouterr().err


def _class_folders_with_a_bad_file(root: Path) -> Path:
    """Two classes of 20 small PNGs, and a junk file under a path past 80 characters (where a
    quoted id is cut: the name must still come out whole)."""
    rng = np.random.default_rng(1)
    deep = root / ("a-folder-whose-name-is-long-" * 3) / "set"
    for name in ("a", "b"):
        (deep / name).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                deep / name / f"{i:02d}.png")
    (deep / "b" / "zz-junk.png").write_bytes(b"not a png")
    assert len(str(deep / "b" / "zz-junk.png")) > 80
    return deep


def test_a_class_folder_probe_names_its_bad_file_whole_by_either_path(server, tmp_path, capsys):
    """The class-folder probes no longer decode every image up front to find a bad one (each
    image was decoded twice and every decoded picture held at once: for ImageNet's validation
    set, 50,000 pictures of about 500 x 375 x 3 bytes, 28 GB before a single feature). The
    embedding names a file it cannot use, by its whole path, in-process as through a server;
    and a server that is not there is one line, exit 1, not a traceback."""
    deep = _class_folders_with_a_bad_file(tmp_path)
    bad = str(deep / "b" / "zz-junk.png")
    capsys.readouterr()
    assert main(["probe", "knn", "--data", str(deep), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: not an image file of a known format" in err, err
    assert main(["probe", "knn", "--data", str(deep), "--server", server,
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"1 of 41 images cannot be embedded: {bad}: not an image file" in err, err
    (deep / "b" / "zz-junk.png").unlink()
    assert main(["probe", "knn", "--data", str(deep), "--server", server, "--ks", "3",
                 "--out", str(tmp_path / "o")]) == 0
    assert _report(tmp_path / "o", "knn")["num_images"] == 40
    assert main(["probe", "knn", "--data", str(deep), "--server", "127.0.0.1:1",
                 "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vit22b probe knn: error: the server at 127.0.0.1:1: UNAVAILABLE")
    assert "Traceback" not in err and err.count("\n") == 1


def test_in_process_features_compute_in_the_dtype_auto_resolves_to(monkeypatch):
    """On a CPU without bf16 instructions `vit22b serve` and `vit22b embed --local` compute the
    bfloat16 default model in float32 (`--compute-dtype auto`); the probes' in-process features
    computed it in bfloat16, so a probe gave other features without a server than with one."""
    from vit22b.model import DEFAULT_MODEL, get_config
    from vit22b.server import engine

    monkeypatch.setattr(engine, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    images = shapes_world(4, seed=5).images
    as_served = get_config(DEFAULT_MODEL).replace(compute_dtype="float32")
    np.testing.assert_array_equal(features_from_model(images, batch_size=4).pooled,
                                  features_from_model(images, as_served, batch_size=4).pooled)


# ---- against a real server, and an embed output folder ------------------------------------


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv.address
    srv.stop()


def test_server_features_match_in_process_features(server, monkeypatch):
    from vit22b.server import engine

    # The shared test engine computes the preset's bfloat16 on every host; in process, `auto`
    # would take float32 on a CPU without bf16 instructions (as `vit22b serve` does): the
    # host's flags say bf16 here, so both sides resolve alike on any CPU.
    monkeypatch.setattr(engine, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    images = shapes_world(16, seed=4).images
    remote = features_from_server(server, list(images), patch_layers="auto", attention_stats=True)
    local = features_from_model(images, patch_layers=(3,), attention_stats=True)
    assert sorted(remote.patch_tokens) == [0, 1, 2, 3]  # "auto": 4 evenly spaced of 4 blocks
    assert remote.meta["model"] == "vit-22b-tiny/16" and remote.meta["num_tokens"] == 16
    # the whole identity, compute dtype and fingerprint included (in-process features had
    # neither): same seed, same weights, same dtype as `auto` resolves it
    assert {k: remote.meta[k] for k in KEY_NAMES} == {k: local.meta[k] for k in KEY_NAMES}
    assert remote.meta["compute_dtype"] in ("bfloat16", "float32")
    # Same seed, same preprocessing; the server shards bf16 matmuls over a 2x4 mesh.
    np.testing.assert_allclose(remote.pooled, local.pooled, atol=0.05, rtol=0.05)
    np.testing.assert_allclose(remote.patch_tokens[3], local.patch_tokens[3], atol=0.05, rtol=0.05)
    assert remote.attention_entropy.shape == (16, 4, 4)


def test_probe_with_server_features(server, tmp_path):
    assert main(["probe", "knn", "--server", server, "--shapes-world", "64", "--ks", "5,10",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    report = _report(tmp_path, "knn")
    assert report["features"]["source"] == server and set(report["by_k"]) == {"5", "10"}


def test_a_probe_reaches_a_server_behind_tls_and_a_token(tmp_path, capsys):
    """`vit22b probe` had --token but no --tls: a server with a certificate (where a token
    belongs) could not be reached by the probes at all."""
    (tmp_path / "tls").mkdir()
    certs = self_signed(tmp_path / "tls")
    (certs / "tokens").write_text("probe-token\n")
    srv = start_server(token_file=str(certs / "tokens"), tls_cert=str(certs / "cert.pem"),
                       tls_key=str(certs / "key.pem"))
    try:
        common = ["probe", "knn", "--server", srv.address, "--token", "probe-token",
                  "--shapes-world", "32", "--ks", "3"]
        assert main([*common, "--tls", str(certs / "cert.pem"), "--out", str(tmp_path / "a")]) == 0
        assert _report(tmp_path / "a", "knn")["features"]["source"] == srv.address
        capsys.readouterr()
        assert main([*common, "--out", str(tmp_path / "b")]) == 1  # plaintext: refused
        assert f"the server at {srv.address}" in capsys.readouterr().err
    finally:
        srv.stop()


def test_probes_read_an_embed_output_folder(server, tmp_path, capsys):
    world = shapes_world(40, seed=5)
    for i, image in enumerate(world.images):
        folder = tmp_path / "images" / world.shape_names[world.shape[i]]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i:03d}.png")
        (tmp_path / "masks").mkdir(exist_ok=True)
        Image.fromarray(world.mask[i], "L").save(tmp_path / "masks" / f"{i:03d}.png")
    embedded = tmp_path / "embedded"
    assert main(["embed", str(tmp_path / "images"), "--server", server, "--output", str(embedded),
                 "--layers", "-1", "--quiet"]) == 0  # fmt: skip
    assert main(["probe", "linear", "--features", str(embedded), "--out", str(tmp_path)]) == 0
    linear = _report(tmp_path, "linear")
    assert linear["num_images"] == 40 and linear["num_classes"] == len(set(world.shape))
    assert linear["features"]["model"] == "vit-22b-tiny/16"
    # a flipped bit in a stored feature reads as a plausible number: the checksums say so
    pooled = next((embedded / "shards").glob("*pooled*"))
    stored = bytearray(pooled.read_bytes())
    stored[-1] ^= 1
    pooled.write_bytes(bytes(stored))
    # flags that compute features are not read with features computed before (were ignored)
    assert main(["probe", "linear", "--features", str(embedded), "--server", server,
                 "--resolution", "32", "--out", str(tmp_path)]) == 2  # fmt: skip
    assert ("--server, --resolution: not read with --features, whose features were computed "
            "before") in capsys.readouterr().err
    capsys.readouterr()
    assert main(["probe", "linear", "--features", str(embedded), "--out", str(tmp_path)]) == 2
    assert f"{pooled} does not match the sha256 in the manifest" in capsys.readouterr().err
    stored[-1] ^= 1
    pooled.write_bytes(bytes(stored))
    with FeatureClient(server) as client:
        served = client.model_info().model  # the embed output's, as served
    assert {k: linear["features"][k] for k in KEY_NAMES} == dict(
        zip(KEY_NAMES, (served.name, served.fingerprint, served.preprocess_hash,
                        served.compute_dtype), strict=True))
    masks = str(tmp_path / "masks")
    assert main(["probe", "segmentation", "--features", str(embedded), "--masks", masks,
                 "--steps", "20", "--out", str(tmp_path)]) == 0  # fmt: skip
    assert _report(tmp_path, "segmentation")["layers"] == [3]
    flat = tmp_path / "flat"  # one folder: no classes to read (was "all 40 are of class 0")
    flat.mkdir()
    for i, path in enumerate(sorted((tmp_path / "images").rglob("*.png"))):
        (flat / f"{i:03d}.png").write_bytes(path.read_bytes())
    assert main(["embed", str(flat), "--server", server, "--output", str(tmp_path / "e2"),
                 "--quiet"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["probe", "knn", "--features", str(tmp_path / "e2"), "--out", str(tmp_path)]) == 2
    assert (f"an image's class is the name of its folder, and all 40 images are in {flat}: the "
            "knn probe needs a subfolder per class") in capsys.readouterr().err
    # one image at the top beside the class folders was a class of its own, named after the
    # embedded folder
    (tmp_path / "images" / "stray.png").write_bytes((flat / "000.png").read_bytes())
    assert main(["embed", str(tmp_path / "images"), "--server", server, "--output",
                 str(tmp_path / "e3"), "--quiet"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["probe", "knn", "--features", str(tmp_path / "e3"), "--out", str(tmp_path)]) == 2
    assert (f"stray.png: in {tmp_path / 'images'}, which also holds the class folder"
            in capsys.readouterr().err)


def test_dense_probes_at_a_resolution(tmp_path):
    """--resolution 96 on the 64-px default model: the shapes world is generated at 96 px and
    the probes read 6x6 patch grids."""
    common = ["--shapes-world", "24", "--resolution", "96", "--steps", "10", "--out", str(tmp_path)]
    for kind, extra in (("depth", ["--decoders", "linear"]), ("segmentation", [])):
        assert main(["probe", kind, *common, *extra]) == 0
        report = _report(tmp_path, kind)
        assert report["features"]["resolution"] == 96, report["features"]
        assert report["features"]["num_tokens"] == 36
