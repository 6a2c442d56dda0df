"""What the SDK accepts as an image, and how it travels.

Paths, bytes (bytes, bytearray, a memoryview) and files opened for binary reading (read from
where they stand when the image's request is built) travel as the file's encoded bytes (the
server decodes them); PIL images and numpy arrays travel as raw uint8 [H, W, 3] pixels (no
lossy re-encoding).
"""

from __future__ import annotations

import io
import numbers
import os
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np
from PIL import Image
from vit22b.model.errors import InvalidImage
from vit22b.model.pixels import to_rgb
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

from .files import MAX_IMAGE_BYTES, as_text, read_local

ImageInput = str | os.PathLike | bytes | bytearray | memoryview | Image.Image | np.ndarray
ENCODED = (bytes, bytearray, memoryview)  # a file's bytes, sent as they are


class Item(NamedTuple):  # a tuple: made once per image on every call, a third of a dataclass's cost
    index: int  # position in the caller's input
    image: ImageInput | InvalidImage  # or why it is not sent (with skip_invalid)
    id: str
    size: int  # bytes it will take on the wire (estimate)


def as_images(images) -> Iterable[ImageInput]:
    """A single image (path, bytes, PIL image, [H, W, C] array) or many (a list, an iterable,
    an [N, H, W, C] array)."""
    if type(images) is list:  # the usual case, first: os.PathLike's ABC check costs more
        return images
    if isinstance(images, (str, os.PathLike, *ENCODED, Image.Image)) or _opened(images):
        return [images]  # an open file iterates over lines, not images
    if isinstance(images, np.ndarray):
        return [images] if images.ndim in (0, 2, 3) else list(images)  # 0-d: refused as one
    try:
        iter(images)
    except TypeError:
        raise TypeError(f"images must be an image (a path, encoded bytes, a PIL image, an "
                        f"array) or an iterable of them, not {type(images).__name__}") from None
    return images


def _opened(image) -> bool:
    """A file object (``open(path, "rb")``, ``io.BytesIO``): it has ``read``, and is no image
    of another kind (a PIL image has no ``read``; numpy arrays neither)."""
    return hasattr(image, "read") and not isinstance(image, Image.Image)


def read_opened(item: Item) -> Item:
    """An open file's item as its bytes, read now (their size is the wire's), or as why not."""
    if isinstance(item.image, io.TextIOBase):
        return item._replace(image=InvalidImage(
            "an open file in text mode: open an image file with 'rb'", item.index, item.id))
    try:
        data = item.image.read(MAX_IMAGE_BYTES + 1)  # /dev/zero would never end
    except (OSError, ValueError) as err:  # closed, unreadable, not seekable...
        return item._replace(image=InvalidImage(f"cannot read the open file: {err}", item.index,
                                                item.id))
    if not isinstance(data, ENCODED):
        return item._replace(image=InvalidImage(
            f"an open file must give bytes, got {type(data).__name__} (open it with 'rb')",
            item.index, item.id))
    if len(data) > MAX_IMAGE_BYTES:
        return item._replace(image=InvalidImage(
            f"the open file holds over {MAX_IMAGE_BYTES} bytes, the limit per image file",
            item.index, item.id))
    return item._replace(image=bytes(data), size=len(data))


def default_id(image: ImageInput, index: int) -> str:
    """A path's id is the path (its bytes that are not UTF-8 written ``\\xNN``, as the wire
    carries text only), an open file's its name, any other image's its position."""
    if type(image) is bytes:  # the usual case, before os.PathLike's (costlier) ABC check
        return str(index)
    if isinstance(image, (str, os.PathLike)):
        return as_text(os.fspath(image)) or str(index)
    name = getattr(image, "name", None) if _opened(image) else None
    return as_text(name) if isinstance(name, str) and name else str(index)  # open(path)


def given_id(value, index: int, what: str = "image") -> str:
    """An id the caller gave: text (a str; an integer or a path as written), never the
    ``repr`` of something else: ``b'a'`` or ``None`` would label a row without a word."""
    if isinstance(value, str):
        return as_text(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    if isinstance(value, os.PathLike):
        return as_text(os.fspath(value))
    raise TypeError(f"the id of {what} {index} is a {type(value).__name__}, not text: ids are "
                    "str (or an int, or a path)")


def wire_size(image: ImageInput) -> int:
    if type(image) is bytes:  # the usual case, before os.PathLike's (costlier) ABC check
        return len(image)
    if isinstance(image, (str, os.PathLike)):
        try:
            return os.path.getsize(image)
        except (OSError, ValueError):  # ValueError: a NUL byte
            return 0  # reported when the file is read
    if isinstance(image, ENCODED):
        return memoryview(image).nbytes
    if isinstance(image, Image.Image):
        return image.width * image.height * 3
    shape = np.shape(image)
    return int(np.prod(shape[:2])) * 3 if len(shape) >= 2 else 0


def _item(index: int, image, image_id: str) -> Item:
    if type(image) is not bytes and _opened(image):  # bytes: the usual case, checked first
        return read_opened(Item(index, image, image_id, 0))
    return Item(index, image, image_id, wire_size(image))


def items(images, ids: Iterable[str] | None = None) -> Iterator[Item]:
    """Each image with its position, id and wire size (``ids``: see ``with_ids``)."""
    images = as_images(images)
    if ids is None:
        for index, image in enumerate(images):
            yield _item(index, image, default_id(image, index))
        return
    for index, image, image_id in with_ids(images, ids):
        yield _item(index, image, image_id)


def with_ids(images: Iterable, ids: Iterable) -> Iterator[tuple[int, object, str]]:
    """``(index, image, id)`` of each image, one id per image, or a ValueError (misaligned ids
    would label every row after the gap with another image's id); checked before the first
    image when both have a length, else as they run out."""
    if hasattr(images, "__len__") and hasattr(ids, "__len__") and len(ids) != len(images):
        raise ValueError(f"{len(ids)} ids for {len(images)} images: give one id per image")
    ids_iter, count, end = iter(ids), 0, object()
    for count, image in enumerate(images, 1):
        image_id = next(ids_iter, end)
        if image_id is end:
            raise ValueError(f"the ids ran out at image {count - 1}: give one id per image")
        yield count - 1, image, given_id(image_id, count - 1)
    if next(ids_iter, end) is not end:
        raise ValueError(f"more ids than the {count} images: give one id per image")


def to_proto(item: Item) -> pb.Image:
    """The wire form of one input; raises ``InvalidImage`` naming the index."""
    image = item.image
    if isinstance(image, InvalidImage):  # refused before it was read (see chunk_items)
        raise image
    try:
        if type(image) is bytes:  # the usual case, before os.PathLike's (costlier) ABC check
            return pb.Image(id=item.id, encoded=image)
        if isinstance(image, (str, os.PathLike)):
            return pb.Image(id=item.id, encoded=read_local(os.fspath(image)))
        if isinstance(image, ENCODED):
            return pb.Image(id=item.id, encoded=bytes(image))
        if isinstance(image, Image.Image):  # the server's own colour, alpha and EXIF rules
            pixels = to_rgb(image)
        else:
            pixels = _rgb(_array(image))
    except InvalidImage as err:
        raise err.at(item.index, item.id) from None
    except OSError as err:
        raise InvalidImage(f"cannot read {image}: {err}", item.index, item.id) from None
    except (TypeError, ValueError) as err:
        raise InvalidImage(str(err), item.index, item.id) from None
    return pb.Image(id=item.id, pixels=wire.to_tensor(pixels))


def _array(image) -> np.ndarray:
    """An array-like image (numpy, a torch tensor, nested lists) as an array; anything numpy
    only wraps (None, a number, a dict) is named by its type."""
    pixels = np.asarray(image)
    if pixels.ndim == 0 or pixels.dtype == object:
        raise ValueError(f"a {type(image).__name__}, not an image: pass a path, encoded bytes, a "
                         "PIL image or a uint8 [H, W, 3] array")
    return pixels


def _rgb(pixels: np.ndarray) -> np.ndarray:
    if pixels.dtype != np.uint8:  # the hint for the dtype at hand: no guess at a range
        hint = ("; for floats in [0, 1] pass (x * 255).round().astype(np.uint8)"
                if np.issubdtype(pixels.dtype, np.floating) else
                "; for 16-bit levels pass (x / 257).round().astype(np.uint8)"
                if pixels.dtype == np.uint16 else "")
        raise ValueError(f"numpy images must be uint8 RGB, got {pixels.dtype}{hint}")
    if pixels.ndim == 2:
        pixels = pixels[..., None]
    if pixels.ndim != 3 or pixels.shape[-1] not in (1, 3, 4):
        raise ValueError(f"numpy images must be [H, W], [H, W, 1|3|4]; got {list(pixels.shape)}")
    if pixels.shape[-1] == 1:
        return np.repeat(pixels, 3, axis=-1)
    if pixels.shape[-1] == 4:  # composited over the contract's background, as files are
        if not pixels[..., 3].any():  # nothing would show: the fourth channel is padding
            raise ValueError(
                "a [H, W, 4] array is RGBA, and every pixel's alpha (the fourth channel) is 0: "
                "it would be embedded as a blank white image. If the fourth channel is padding, "
                "pass the colour alone: image[..., :3] for RGBX, image[..., 2::-1] for BGRX (a "
                "screen capture's buffer)")
        return to_rgb(Image.fromarray(np.ascontiguousarray(pixels), "RGBA"))
    return pixels
