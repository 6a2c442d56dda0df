"""Data for the probes: a seeded procedural "shapes world", loaders for users' folders, digits.

The shapes world draws one object per image: a silhouette (the *shape* class) filled with a
pattern and palette (the *texture* class), at a depth that sets its size and how much haze covers
it, in front of a ground plane whose depth grows toward the horizon. Every image comes with its
per-pixel depth map and segmentation mask (0 = background, 1 + shape class on the object), so
one generator serves classification, depth, segmentation and cue-conflict (shape of one class,
texture of another) probes. By default shape and texture agree (each category has its silhouette
and its surface, as objects in photos do); "conflict" images pair them against each other, which
is what the shape-bias probe reads, and "independent" draws them apart.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from vit22b.clients.files import hidden, regular
from vit22b.model.pixels import REFUSED_SUFFIXES, SUFFIXES

SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond", "bar", "star")
TEXTURES = ("stripes", "checker", "dots", "waves", "grid", "noise", "solid", "diagonal")
# Two colours per texture class (RGB in [0, 1]); a texture is its pattern and its palette.
_PALETTES = np.array(
    [
        [(0.90, 0.20, 0.15), (0.95, 0.85, 0.30)],
        [(0.15, 0.35, 0.90), (0.95, 0.95, 0.95)],
        [(0.20, 0.75, 0.30), (0.10, 0.20, 0.10)],
        [(0.85, 0.40, 0.85), (0.30, 0.10, 0.40)],
        [(0.95, 0.60, 0.10), (0.20, 0.20, 0.60)],
        [(0.55, 0.55, 0.55), (0.95, 0.30, 0.50)],
        [(0.10, 0.80, 0.85), (0.10, 0.80, 0.85)],
        [(0.60, 0.30, 0.10), (0.95, 0.90, 0.70)],
    ],
    dtype=np.float32,
)
_HAZE = np.array([0.72, 0.76, 0.80], np.float32)  # colour that distance fades everything into
_FOG_DEPTH = 8.0  # depth at which 1/e of an object's own colour is left
TextureMode = Literal["independent", "matched", "conflict"]
# An accepted format's name, or a refused one's (then refused by name when read, not left out).
IMAGE_SUFFIXES = (*SUFFIXES, *REFUSED_SUFFIXES)


# The label of pixels that belong to no class (object borders, void): VOC's, Cityscapes' and
# mmsegmentation's convention. Those pixels are left out of the loss, the metrics and the
# baseline, never learnt as a class.
IGNORE_INDEX = 255


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and what is wrong."""


@dataclass
class ShapesWorld:
    """Images [N, S, S, 3] uint8 with their labels, depth [N, S, S] and masks [N, S, S]."""

    images: np.ndarray
    shape: np.ndarray  # [N] index into SHAPES
    texture: np.ndarray  # [N] index into TEXTURES
    depth: np.ndarray  # [N, S, S] float32, larger is farther
    mask: np.ndarray  # [N, S, S] uint8, 0 background, 1 + shape class on the object
    shape_names: tuple[str, ...] = SHAPES
    texture_names: tuple[str, ...] = TEXTURES

    def __len__(self) -> int:
        return len(self.images)

    @property
    def num_mask_classes(self) -> int:
        return len(self.shape_names) + 1


def _silhouette(kind: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Boolean mask of a unit-size shape in object coordinates (u right, v down, radius 1)."""
    rho, theta = np.hypot(u, v), np.arctan2(v, u)
    au, av = np.abs(u), np.abs(v)
    if kind == "circle":
        return rho < 0.95
    if kind == "square":
        return np.maximum(au, av) < 0.75
    if kind == "triangle":  # apex up
        return (v < 0.7) & (v > -0.9) & (au < (v + 0.9) * 0.55)
    if kind == "cross":
        return ((au < 0.28) & (av < 0.95)) | ((av < 0.28) & (au < 0.95))
    if kind == "ring":
        return (rho < 0.95) & (rho > 0.55)
    if kind == "diamond":
        return au + av < 1.0
    if kind == "bar":
        return (au < 0.98) & (av < 0.32)
    if kind == "star":
        return rho < 0.5 + 0.45 * np.cos(5 * (theta + np.pi / 2))
    raise ValueError(f"unknown shape {kind!r}; known: {SHAPES}")


def _pattern(kind: str, x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per-pixel mix weight in [0, 1] between a texture's two colours (image coordinates)."""
    period = 6.0
    if kind == "stripes":
        w = np.sin(2 * np.pi * y / period) > 0
    elif kind == "checker":
        w = (np.floor(x / 4) + np.floor(y / 4)) % 2 == 0
    elif kind == "dots":
        w = np.hypot((x % period) - period / 2, (y % period) - period / 2) < 1.6
    elif kind == "waves":
        w = np.sin(2 * np.pi * (x + 2.5 * np.sin(2 * np.pi * y / 12)) / period) > 0
    elif kind == "grid":
        w = ((x % period) < 1.5) | ((y % period) < 1.5)
    elif kind == "noise":
        w = rng.random(x.shape) < 0.5
    elif kind == "solid":
        w = np.zeros(x.shape, bool)
    elif kind == "diagonal":
        w = ((x + y) % 8) < 4
    else:
        raise ValueError(f"unknown texture {kind!r}; known: {TEXTURES}")
    return w.astype(np.float32)


def _ground_depth(size: int, tilt: float) -> np.ndarray:
    """Depth of a ground plane seen from above it: far at the top row, near at the bottom;
    ``tilt`` (camera pitch) sets how fast it nears."""
    rows = (np.arange(size, dtype=np.float32) + 0.5) / size
    return np.broadcast_to((1.0 / (0.08 + tilt * rows))[:, None], (size, size)).copy()


MAX_WORLD_BYTES = 2 << 30  # what a generated world (pixels and targets) may take in memory


def check_world_bytes(what: str, nbytes: int) -> None:
    """Refuse a generated world larger than ``MAX_WORLD_BYTES`` before allocating it."""
    if nbytes > MAX_WORLD_BYTES:
        raise ValueError(f"{what} takes {nbytes / (1 << 30):.1f} GiB; a generated world may "
                         f"take {MAX_WORLD_BYTES >> 30} GiB: ask for fewer or smaller images")


def shapes_world(
    n: int,
    seed: int = 0,
    size: int = 64,
    texture: TextureMode = "matched",
    num_classes: int = len(SHAPES),
) -> ShapesWorld:
    """``n`` seeded images of the shapes world (the same seed gives the same images).

    ``texture``: "matched" uses the texture of the shape's index (shape and texture agree),
    "conflict" always a different one (cue-conflict stimuli), "independent" draws it apart.
    ``num_classes`` uses the first shapes and textures only.
    """
    if n <= 0 or size < 16:
        raise ValueError(f"shapes_world needs n > 0 and size >= 16, got n={n}, size={size}")
    check_world_bytes(f"a shapes world of {n} images of {size}x{size}", n * size * size * 8)
    if not 2 <= num_classes <= len(SHAPES):
        raise ValueError(f"num_classes must be in 2..{len(SHAPES)}, got {num_classes}")
    rng = np.random.default_rng(seed)
    shape = rng.integers(0, num_classes, n)
    if texture == "independent":
        tex = rng.integers(0, num_classes, n)
    elif texture == "matched":
        tex = shape.copy()
    elif texture == "conflict":
        tex = (shape + rng.integers(1, num_classes, n)) % num_classes
    else:
        raise ValueError(f"texture must be independent, matched or conflict, got {texture!r}")

    y, x = np.mgrid[:size, :size].astype(np.float32)
    images = np.empty((n, size, size, 3), np.uint8)
    depth = np.empty((n, size, size), np.float32)
    mask = np.zeros((n, size, size), np.uint8)
    for i in range(n):
        ground = _ground_depth(size, rng.uniform(0.25, 0.8))
        z = rng.uniform(1.5, 4.0)  # object depth: sets its size and its haze
        radius = min(size * rng.uniform(0.9, 1.1) * 0.75 / z, size / 2 - 1)
        cx, cy = rng.uniform(radius, size - radius, 2)
        u, v = (x - cx) / radius, (y - cy) / radius
        obj = _silhouette(SHAPES[shape[i]], u, v)
        # Ground plane: two muted tones with faint noise, hazier toward the horizon.
        ground_rgb = 0.35 + 0.08 * rng.standard_normal((size, size, 1)).astype(np.float32)
        ground_rgb = ground_rgb * np.array([0.9, 1.0, 0.8], np.float32)
        fog = np.exp(-ground / _FOG_DEPTH)[..., None]
        rgb = ground_rgb * fog + _HAZE * (1 - fog)
        # Object: its texture's pattern and palette, a slight bulge in depth, hazed by its depth.
        w = _pattern(TEXTURES[tex[i]], x, y, rng)[..., None]
        fill = _PALETTES[tex[i], 0] * (1 - w) + _PALETTES[tex[i], 1] * w
        obj_fog = np.exp(-z / _FOG_DEPTH)
        fill = fill * obj_fog + _HAZE * (1 - obj_fog)
        rgb = np.where(obj[..., None], fill, rgb)
        bulge = 0.4 * np.sqrt(np.clip(1 - u**2 - v**2, 0, 1))
        depth[i] = np.where(obj, z - bulge, ground)
        mask[i][obj] = shape[i] + 1
        images[i] = np.clip(rgb * 255 + 0.5, 0, 255).astype(np.uint8)
    return ShapesWorld(
        images=images,
        shape=shape,
        texture=tex,
        depth=depth,
        mask=mask,
        shape_names=SHAPES[:num_classes],
        texture_names=TEXTURES[:num_classes],
    )


# ------------------------------------------------------------------------------------------
# users' own data
# ------------------------------------------------------------------------------------------


@dataclass
class LabelledImages:
    """Image paths (or decoded arrays) with integer labels and the names of the classes."""

    images: list  # paths, or uint8 arrays [H, W, 3]
    labels: np.ndarray
    class_names: tuple[str, ...]
    extra: dict = field(default_factory=dict)  # e.g. texture labels of cue-conflict images

    def __len__(self) -> int:
        return len(self.images)


def is_file(path: Path) -> bool:
    """Whether ``path``, a name a loader takes by its suffix, is a file to read: a folder is
    not; a link to nothing, a FIFO, device or socket is refused by name (left out, the probe
    would score fewer images than the folder shows, without a word)."""
    try:
        info = path.stat()
    except OSError as err:
        dangling = path.is_symlink() and isinstance(err, FileNotFoundError)
        reason = f"a link to nothing ({os.readlink(path)})" if dangling else \
            f"cannot be read ({err.strerror or err})"
        raise DataError(f"{path}: {reason}") from None
    if stat.S_ISDIR(info.st_mode):
        return False
    try:
        regular(info, str(path))
    except OSError as err:
        raise DataError(f"{path}: {err.strerror}") from None
    return True


def image_files(folder: str | Path) -> list[Path]:
    """The image files directly in ``folder`` (hidden ones left out), sorted by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder")
    files = sorted(
        p for p in folder.iterdir()
        if p.suffix.lower() in IMAGE_SUFFIXES and not hidden(p.name) and is_file(p)
    )
    if not files:
        raise DataError(f"{folder}: no images ({', '.join(SUFFIXES)})")
    return files


def labels_from_folders(paths) -> tuple[np.ndarray, tuple[str, ...]]:
    """Class of each image = the name of its folder; classes in sorted order. A file in a
    folder that also holds class folders (an embedded folder's top, beside its class
    subfolders) is refused: its class would be that folder's own name."""
    folders = {Path(p).parent for p in paths}
    above = folders & {a for f in folders for a in f.parents}
    if above:
        first = next(p for p in paths if Path(p).parent in above)
        inner = next(f for f in sorted(folders) if Path(first).parent in f.parents)
        raise DataError(f"{first}: in {Path(first).parent}, which also holds the class folder "
                        f"{inner.name!r}: a file's class is its folder's name (move it into a "
                        "class folder, or leave it out)")
    named: dict[str, Path] = {}
    for folder in sorted(folders):  # a class is a folder's name: two folders, one class
        if named.setdefault(folder.name, folder) != folder:
            raise DataError(f"{named[folder.name]} and {folder}: two folders named "
                            f"{folder.name!r} would be one class (a file's class is the name of "
                            "the folder holding it): give them other names, or leave one out")
    parents = [Path(p).parent.name for p in paths]
    names = tuple(sorted(set(parents)))
    index = {name: i for i, name in enumerate(names)}
    return np.asarray([index[p] for p in parents], np.int64), names


def _walk(folder: Path):
    """Every file below ``folder`` that is not hidden nor in a hidden folder, its own files
    first, by name; a folder that cannot be listed is refused (a glob skips it without a
    word, and its files would be missing from the probe)."""
    def refuse(err: OSError):
        raise DataError(f"{err.filename}: cannot be listed ({err.strerror})")

    for top, folders, files in os.walk(folder, onerror=refuse):
        folders[:] = sorted(name for name in folders if not hidden(name))
        yield from (Path(top) / name for name in sorted(files) if not hidden(name))


def class_folder_files(root: str | Path, accept, what: str) -> list[Path]:
    """The files ``accept`` takes (``what``: "image", "video") in ``root``'s class subfolders
    (``root/<class>/<file>``), by class in sorted order; hidden folders and files are left out,
    as the batch job leaves them, and such a file below its class folder is refused, not left
    out (the probes read one level)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: not a folder")
    entries = [p for p in root.iterdir() if not hidden(p.name)]
    for p in entries:  # a class folder on a drive that is gone would drop its class unsaid
        if p.is_symlink() and not p.exists():
            raise DataError(f"{p}: a link to nothing ({os.readlink(p)}), where a class folder "
                            "or a file was expected")
    classes = sorted(p.name for p in entries if p.is_dir())
    if not classes:
        raise DataError(f"{root}: no class subfolders (expected {root}/<class>/<{what}>)")
    paths = []
    for name in classes:  # one walk a class: its files, and any deeper (refused)
        folder = root / name
        for path in _walk(folder):
            if not accept(path) or not is_file(path):
                continue
            if path.parent != folder:
                raise DataError(f"{path}: {'an' if what[0] in 'aeiou' else 'a'} {what} below "
                                f"the class folder {name!r}, in "
                                f"{path.parent.relative_to(folder)}; a class's {what}s go "
                                f"directly in {folder} (the probe reads one level)")
            paths.append(path)
    return paths


def load_image_folder(root: str | Path) -> LabelledImages:
    """A folder of class subfolders (``root/<class>/<image>``), classes in sorted order
    (``class_folder_files``)."""
    paths = class_folder_files(root, lambda p: p.suffix.lower() in IMAGE_SUFFIXES, "image")
    if not paths:
        raise DataError(f"{root}: the class subfolders hold no images ({', '.join(SUFFIXES)})")
    return LabelledImages(paths, *labels_from_folders(paths))


def cue_conflict_labels(paths, categories: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Shape and texture category indices from names ``<shape>/<shape><i>-<texture><j>.png``."""
    index = {name: i for i, name in enumerate(categories)}
    shapes, textures = [], []
    for path in map(Path, paths):
        match = re.fullmatch(r"([a-z_]+)\d*-([a-z_]+)\d*", path.stem)
        if not match:
            raise DataError(f"{path}: name is not '<shape><i>-<texture><j>'")
        shape_name, texture_name = match[1], match[2]
        if shape_name != path.parent.name:
            raise DataError(f"{path}: shape {shape_name!r} differs from folder {path.parent.name}")
        for name in (shape_name, texture_name):
            if name not in index:
                raise DataError(f"{path}: category {name!r} is not one of {categories}")
        shapes.append(index[shape_name])
        textures.append(index[texture_name])
    return np.asarray(shapes, np.int64), np.asarray(textures, np.int64)


def load_cue_conflict(root: str | Path, categories: tuple[str, ...] | None = None):
    """Cue-conflict stimuli laid out as ``<shape>/<shape><i>-<texture><j>.png``.

    Labels are the shape categories; ``extra['texture']`` holds the texture labels (the file
    name's second part without its digits). ``categories`` defaults to the subfolders' names.
    """
    data = load_image_folder(root)
    names = tuple(categories) if categories else data.class_names
    shapes, textures = cue_conflict_labels(data.images, names)
    return LabelledImages(data.images, shapes, names, extra={"texture": textures})


def _read_depth(path: Path) -> np.ndarray:
    with _reading(path, "depth map"):
        if path.suffix == ".npy":
            depth = np.load(path, allow_pickle=False)
        else:
            from PIL import Image

            with Image.open(path) as im:
                if im.mode not in ("I;16", "I;16B", "I", "F", "L"):
                    raise DataError(
                        f"{path}: depth PNG must be single-channel (16-bit), not {im.mode}")
                depth = np.asarray(im)
    if not (np.issubdtype(depth.dtype, np.floating) or np.issubdtype(depth.dtype, np.integer)):
        raise DataError(f"{path}: depth map must be real numbers, got dtype {depth.dtype}")
    depth = np.asarray(depth, np.float32)
    if depth.ndim != 2:
        raise DataError(f"{path}: depth map must be 2-D [H, W], got shape {depth.shape}")
    return depth


def _read_mask(path: Path) -> np.ndarray:
    from PIL import Image

    with _reading(path, "mask"), Image.open(path) as im:
        if im.mode not in ("P", "L"):
            raise DataError(f"{path}: mask must be an indexed (P) or grey (L) PNG, not {im.mode}")
        return np.asarray(im, np.uint8)


@contextlib.contextmanager
def _reading(path: Path, what: str):
    """A target file's read failures (truncated, not an image, a decompression bomb, a pickled
    .npy) as one DataError naming the file."""
    from PIL import Image

    try:
        yield
    except DataError:
        raise
    except (OSError, ValueError, EOFError, SyntaxError, struct.error,
            Image.DecompressionBombError) as err:  # Pillow raises each for some broken file
        raise DataError(f"{path}: cannot read the {what} ({type(err).__name__}: {err})") from None


@dataclass
class DenseSet:
    """Images with depth maps and/or segmentation masks, matched by file stem."""

    images: list[Path]
    depth: np.ndarray | None  # [N, H, W] float32
    mask: np.ndarray | None  # [N, H, W] uint8

    def __len__(self) -> int:
        return len(self.images)


def _by_stem(folder: Path, suffixes: tuple[str, ...]) -> dict[str, Path]:
    files = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() in suffixes and not hidden(path.name) and is_file(path):
            if path.stem in files:
                raise DataError(f"{path}: stem {path.stem!r} also names {files[path.stem]}")
            files[path.stem] = path
    return files


def _stack(arrays: list[np.ndarray], paths: list[Path], what: str) -> np.ndarray:
    shape = arrays[0].shape
    for array, path in zip(arrays, paths):
        if array.shape != shape:
            raise DataError(
                f"{path}: {what} of shape {array.shape}, but {paths[0]} has {shape} "
                "(all must share one size)"
            )
    return np.stack(arrays)


def dense_targets(
    image_paths, depth: str | Path | None = None, masks: str | Path | None = None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Depth maps (.npy or 16-bit PNG) and indexed-PNG masks of images, matched by file stem.

    Every image needs its depth map and mask (when those folders are given); extra files in the
    label folders are ignored.
    """
    if depth is None and masks is None:
        raise DataError("dense targets need a depth folder, a mask folder, or both")
    stems = [Path(p).stem for p in image_paths]
    out: dict[str, np.ndarray | None] = {"depth": None, "mask": None}
    for key, folder, suffixes, read in (
        ("depth", depth, (".npy", ".png"), _read_depth),
        ("mask", masks, (".png",), _read_mask),
    ):
        if folder is None:
            continue
        if not Path(folder).is_dir():
            raise DataError(f"{folder}: not a folder")
        labels = _by_stem(Path(folder), suffixes)
        missing = [s for s in stems if s not in labels]
        if missing:
            raise DataError(f"{folder}: no {key} for images {missing[:5]} (matched by file stem)")
        paths = [labels[s] for s in stems]
        out[key] = _stack([read(p) for p in paths], paths, key)
    return out["depth"], out["mask"]


def load_dense_folder(
    images: str | Path, depth: str | Path | None = None, masks: str | Path | None = None
) -> DenseSet:
    """Paired folders: images, and their depth maps and / or masks (see ``dense_targets``)."""
    paths = image_files(images)
    return DenseSet(paths, *dense_targets(paths, depth, masks))


def load_digits_images(size: int = 64) -> LabelledImages:
    """scikit-learn's bundled handwritten digits (1797 8x8 images), as RGB uint8 [size, size]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    grey = (digits.images / 16.0 * 255).astype(np.uint8)  # values 0..16
    reps = -(-size // 8)
    big = np.kron(grey, np.ones((1, reps, reps), np.uint8))[:, :size, :size]
    rgb = np.repeat(big[..., None], 3, axis=-1)
    return LabelledImages(list(rgb), digits.target.astype(np.int64), tuple(map(str, range(10))))


def read_images(images) -> list[np.ndarray]:
    """Paths or arrays -> uint8 RGB arrays [H, W, 3]; sizes may differ. Files are decoded by
    the pixel contract (``model/pixels.py``: orientation, 16-bit grey, transparency, the size
    limit) at full size, so a bad file is named by its path before anything is embedded."""
    from vit22b.model.errors import InvalidImage
    from vit22b.model.pixels import decode

    out = []
    for item in images:
        if isinstance(item, np.ndarray):
            array = item
        else:
            try:
                array = decode(Path(item).read_bytes())
            except (OSError, InvalidImage) as err:
                raise DataError(f"{item}: cannot decode image ({err})") from err
        if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
            raise DataError(
                f"image {len(out)}: expected uint8 [H, W, 3], got {array.dtype} {array.shape}"
            )
        out.append(array)
    return out
