"""Probe data loaders: class folders, cue-conflict stimuli, paired dense folders, digits, .npz."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vit22b.clients.demo import SAMPLE
from vit22b.probes.data import (
    DataError,
    dense_targets,
    image_files,
    load_cue_conflict,
    load_dense_folder,
    load_digits_images,
    load_image_folder,
    read_images,
    shapes_world,
)
from vit22b.probes.features import Features, features_from_outputs, load_features, save_features
from vit22b.probes.runner import ProbeData, load_probe_data, save_probe_data
from vit22b.probes.shape_bias import CATEGORIES


def _png(path: Path, array: np.ndarray, mode: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode).save(path)
    return path


def test_class_folders(tmp_path):
    world = shapes_world(6, seed=0)
    for i, image in enumerate(world.images):
        _png(tmp_path / ("zebra" if i % 2 else "apple") / f"{i}.png", image)
    (tmp_path / "apple" / "notes.txt").write_text("not an image")
    (tmp_path / "empty").mkdir()
    data = load_image_folder(tmp_path)
    assert data.class_names == ("apple", "zebra")  # folders without images are no class
    assert [p.name for p in data.images] == ["0.png", "2.png", "4.png", "1.png", "3.png", "5.png"]
    assert data.labels.tolist() == [0, 0, 0, 1, 1, 1]
    np.testing.assert_array_equal(read_images(data.images[:1])[0], world.images[0])


def test_class_folders_take_every_accepted_format_and_name_refused_ones(tmp_path):
    """GIF and TIFF (accepted by the pixel contract) were left out of a class folder without a
    word, as were files of a refused format: the probe ran on fewer images than the folder
    held."""
    from test_pixels import heic

    world = shapes_world(6, seed=1)
    names = ["a.gif", "b.TIF", "c.tiff", "d.JPEG", "e.jfif"]
    for name, image in zip(names, world.images):
        fmt = {"gif": "GIF", "tif": "TIFF", "tiff": "TIFF"}.get(name.split(".")[1].lower(),
                                                             "JPEG")
        (tmp_path / "cls").mkdir(exist_ok=True)
        Image.fromarray(image).save(tmp_path / "cls" / name, fmt)
    (tmp_path / "cls" / "f.HEIC").write_bytes(heic(Image.fromarray(world.images[5])))
    names.append("f.HEIC")
    (tmp_path / "cls" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    data = load_image_folder(tmp_path)
    assert [p.name for p in data.images] == names
    assert len(read_images(data.images)) == 6
    (tmp_path / "cls" / "g.jxl").write_bytes(b"\xff\x0a\xfa\x7f" + bytes(64))
    data = load_image_folder(tmp_path)
    assert data.images[-1].name == "g.jxl"
    with pytest.raises(DataError, match=r"g\.jxl: cannot decode image \(JPEG XL"):
        read_images(data.images)


def test_hidden_files_and_folders_are_left_out_as_the_batch_job_leaves_them(tmp_path):
    """A folder copied from a Mac holds ``._IMG_0001.HEIC`` beside each photo (AppleDouble
    metadata named as the image): the probe stopped on the first, refused as no image, where
    ``vit22b embed`` leaves hidden names out; a hidden folder of images became a class."""
    world = shapes_world(3, seed=4)
    _png(tmp_path / "cat" / "0.png", world.images[0])
    _png(tmp_path / "dog" / "1.png", world.images[1])
    (tmp_path / "cat" / "._0.png").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    _png(tmp_path / ".thumbnails" / "2.png", world.images[2])
    data = load_image_folder(tmp_path)
    assert [p.name for p in data.images] == ["0.png", "1.png"]
    assert data.class_names == ("cat", "dog")
    assert len(read_images(data.images)) == 2
    assert [p.name for p in image_files(tmp_path / "cat")] == ["0.png"]


def test_images_below_a_class_folder_are_refused_not_left_out(tmp_path):
    world = shapes_world(3, seed=2)
    _png(tmp_path / "cat" / "0.png", world.images[0])
    _png(tmp_path / "dog" / "1.png", world.images[1])
    _png(tmp_path / "dog" / ".thumbs" / "t.png", world.images[2])  # hidden: not the user's
    assert len(load_image_folder(tmp_path)) == 2
    _png(tmp_path / "dog" / "batch2" / "2.png", world.images[2])
    with pytest.raises(DataError, match=r"2\.png: an image below the class folder 'dog', in "
                       r"batch2; a class's images go directly in"):
        load_image_folder(tmp_path)


@pytest.mark.parametrize("odd", ["dangling link", "fifo", "link loop"])
def test_an_image_name_that_is_no_file_is_refused_not_left_out(tmp_path, odd):
    """A link to a photo on a drive that is gone, or a FIFO named as an image, was left out of
    a class, an images folder or a masks folder without a word (the probe scored fewer images
    than the folder showed); ``vit22b embed`` reports such a file as a failed input."""
    import os

    world = _dense_folders(tmp_path)
    _png(tmp_path / "cls" / "cat" / "0.png", world.images[0])
    _png(tmp_path / "cls" / "dog" / "1.png", world.images[1])
    assert len(load_image_folder(tmp_path / "cls")) == 2
    for folder, load in [
        (tmp_path / "cls" / "dog", lambda: load_image_folder(tmp_path / "cls")),
        (tmp_path / "images", lambda: image_files(tmp_path / "images")),
        (tmp_path / "masks", lambda: load_dense_folder(tmp_path / "images",
                                                       masks=tmp_path / "masks")),
    ]:
        bad = folder / "im9.png"
        if odd == "dangling link":
            bad.symlink_to(tmp_path / "gone" / "im9.png")
            words = r"im9\.png: a link to nothing \(.*gone/im9\.png\)"
        elif odd == "fifo":
            os.mkfifo(bad)
            words = r"im9\.png: not a regular file: a FIFO"
        else:
            bad.symlink_to(bad)
            words = r"im9\.png: cannot be read \(Too many levels of symbolic links\)"
        with pytest.raises(DataError, match=words):
            load()
        bad.unlink()
    (tmp_path / "cls" / "bird").symlink_to(tmp_path / "gone")  # a class on a drive that is gone
    with pytest.raises(DataError, match=r"bird: a link to nothing \(.*gone\), where a class"):
        load_image_folder(tmp_path / "cls")


def test_class_folder_errors_name_the_folder(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        load_image_folder(tmp_path / "missing")
    with pytest.raises(DataError, match="no class subfolders"):
        load_image_folder(tmp_path)
    (tmp_path / "cls").mkdir()
    with pytest.raises(DataError, match="hold no images"):
        load_image_folder(tmp_path)


def test_cue_conflict_sample_layout():
    data = load_cue_conflict(SAMPLE)
    assert data.class_names == CATEGORIES
    assert len(data) == 80
    texture = data.extra["texture"]
    for path, shape, tex in zip(data.images, data.labels, texture):
        shape_name, texture_name = path.stem.split("-")
        assert CATEGORIES[shape] == shape_name.rstrip("0123456789") == path.parent.name
        assert CATEGORIES[tex] == texture_name.rstrip("0123456789")
    # bear1-bear3, bicycle1-bicycle3, car1-car2, cat1-cat3, chair1-chair1, clock1-clock2
    assert int((data.labels == texture).sum()) == 6


def test_cue_conflict_names_are_checked(tmp_path):
    image = np.zeros((8, 8, 3), np.uint8)
    _png(tmp_path / "cat" / "cat1-dog2.png", image)
    _png(tmp_path / "cat" / "cat-and-dog.png", image)
    with pytest.raises(DataError, match="cat-and-dog.png: name is not"):
        load_cue_conflict(tmp_path, categories=("cat", "dog"))
    (tmp_path / "cat" / "cat-and-dog.png").unlink()
    _png(tmp_path / "cat" / "dog1-cat2.png", image)
    with pytest.raises(DataError, match="differs from folder cat"):
        load_cue_conflict(tmp_path, categories=("cat", "dog"))
    (tmp_path / "cat" / "dog1-cat2.png").unlink()
    with pytest.raises(DataError, match="'dog' is not one of"):
        load_cue_conflict(tmp_path)  # categories from the folders: only 'cat'


def _dense_folders(tmp_path: Path, n: int = 4):
    world = shapes_world(n, seed=3)
    for folder in ("depth", "masks"):
        (tmp_path / folder).mkdir()
    for i in range(n):
        _png(tmp_path / "images" / f"im{i}.png", world.images[i])
        if i % 2:  # depth as 16-bit PNG (millimetres) and as .npy
            _png(tmp_path / "depth" / f"im{i}.png", (world.depth[i] * 1000).astype(np.uint16))
        else:
            np.save(tmp_path / "depth" / f"im{i}.npy", world.depth[i])
        mask = Image.fromarray(world.mask[i], "P")
        mask.putpalette([(i * k) % 256 for i in range(256) for k in (1, 7, 13)])  # distinct
        mask.save(tmp_path / "masks" / f"im{i}.png")
    return world


def test_paired_dense_folders_match_by_stem(tmp_path):
    world = _dense_folders(tmp_path)
    (tmp_path / "depth" / "unrelated.npy").write_bytes(b"")  # extra label files are ignored
    data = load_dense_folder(tmp_path / "images", tmp_path / "depth", tmp_path / "masks")
    assert [p.stem for p in data.images] == ["im0", "im1", "im2", "im3"]
    np.testing.assert_allclose(data.depth[0], world.depth[0])
    np.testing.assert_allclose(data.depth[1], np.floor(world.depth[1] * 1000), rtol=0)
    np.testing.assert_array_equal(data.mask, world.mask)
    depth_only = load_dense_folder(tmp_path / "images", depth=tmp_path / "depth")
    assert depth_only.mask is None


def test_dense_folder_errors(tmp_path):
    _dense_folders(tmp_path)
    (tmp_path / "masks" / "im2.png").unlink()
    with pytest.raises(DataError, match=r"no mask for images \['im2'\]"):
        load_dense_folder(tmp_path / "images", masks=tmp_path / "masks")
    _png(tmp_path / "masks" / "im2.png", np.zeros((64, 64, 3), np.uint8))  # RGB, not indexed
    with pytest.raises(DataError, match="im2.png: mask must be an indexed"):
        load_dense_folder(tmp_path / "images", masks=tmp_path / "masks")
    np.save(tmp_path / "depth" / "im0.npy", np.ones((32, 32), np.float32))
    with pytest.raises(DataError, match=r"im1.png: depth of shape \(64, 64\), but .*im0.npy has"):
        load_dense_folder(tmp_path / "images", depth=tmp_path / "depth")
    with pytest.raises(DataError, match="need a depth folder, a mask folder, or both"):
        dense_targets(image_files(tmp_path / "images"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty: no images"):
        image_files(tmp_path / "empty")


@pytest.mark.parametrize("case", ["truncated mask", "pickled depth", "complex depth"])
def test_unreadable_target_files_are_named(tmp_path, case):
    """A truncated mask PNG was "error: image file is truncated" (which file?), a pickled .npy
    "Object arrays cannot be loaded", and a complex .npy lost its imaginary parts silently."""
    _dense_folders(tmp_path)
    if case == "truncated mask":
        data = (tmp_path / "masks" / "im2.png").read_bytes()
        (tmp_path / "masks" / "im2.png").write_bytes(data[: len(data) // 2])
        words = r"im2.png: cannot read the mask \(OSError: "
    elif case == "pickled depth":
        np.save(tmp_path / "depth" / "im2.npy", np.array([{"a": 1}]), allow_pickle=True)
        words = r"im2.npy: cannot read the depth map \(ValueError: Object arrays cannot be"
    else:
        np.save(tmp_path / "depth" / "im2.npy", np.ones((64, 64), np.complex64))
        words = "im2.npy: depth map must be real numbers, got dtype complex64"
    with pytest.raises(DataError, match=words):
        load_dense_folder(tmp_path / "images", tmp_path / "depth", tmp_path / "masks")


def test_digits_as_images():
    data = load_digits_images()
    assert len(data) == 1797 and data.class_names == tuple("0123456789")
    assert data.images[0].shape == (64, 64, 3) and data.images[0].dtype == np.uint8
    assert np.bincount(data.labels).min() > 170


def test_unreadable_images_are_named(tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match="broken.png: cannot decode"):
        read_images([bad])
    with pytest.raises(DataError, match="image 0: expected uint8"):
        read_images([np.zeros((4, 4), np.uint8)])


def test_features_and_targets_round_trip_through_npz(tmp_path):
    rng = np.random.default_rng(0)
    features = features_from_outputs(
        {"pooled": rng.standard_normal((5, 8)), "patch_tokens": {3: rng.random((5, 4, 8))}},
        {"model": "m"},
    )
    data = ProbeData(features, labels=np.arange(5) % 2, class_names=("a", "b"),
                     mask=np.zeros((5, 4, 4), np.uint8), num_mask_classes=3)  # fmt: skip
    save_probe_data(tmp_path / "f.npz", data)
    loaded = load_probe_data(tmp_path / "f.npz")
    np.testing.assert_array_equal(loaded.features.pooled, features.pooled)
    np.testing.assert_array_equal(loaded.features.patch_tokens[3], features.patch_tokens[3])
    assert loaded.class_names == ("a", "b") and loaded.num_mask_classes == 3
    np.testing.assert_array_equal(loaded.labels, data.labels)
    assert loaded.depth is None and loaded.mask.shape == (5, 4, 4)
    save_features(tmp_path / "g.npz", features)
    assert isinstance(load_features(tmp_path / "g.npz"), Features)
    with pytest.raises(DataError, match="not a features .npz"):
        load_features(tmp_path / "missing.npz")


def test_missing_outputs_say_what_to_request():
    features = Features(pooled=np.zeros((2, 4)), meta={"source": "here"})
    with pytest.raises(DataError, match="here has no 'patch_tokens' features"):
        features.patch_grid(0)
    with pytest.raises(DataError, match="here has no 'attention_entropy'"):
        features.require("attention_entropy")
