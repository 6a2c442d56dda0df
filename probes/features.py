"""Where the probes' features come from: arrays, a saved .npz, the model in-process, a server,
or a ``vit22b embed`` output folder. Every source ends as one :class:`Features`.

Keys follow the model's outputs (``vit22b.model.apply``): ``pooled`` [N, d], ``class_token``
[N, d], ``patch_tokens`` {layer: [N, P, d]}, ``attention_entropy`` / ``attention_max_logit``
[N, depth, heads], ``logits`` [N, C].
"""

from __future__ import annotations

import ast
import logging
import math
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from vit22b.clients.storage import atomic_write
from vit22b.model.features import ARRAYS as _ARRAY_KEYS
from vit22b.model.features import Features as FeatureArrays
from vit22b.model.host import available_memory

from .data import DataError

log = logging.getLogger(__name__)


@dataclass
class Features(FeatureArrays):
    """The feature container (``model/features.py``) with where the features came from."""

    meta: dict = field(default_factory=dict)  # model name, preprocess hash, source

    def require(self, name: str) -> np.ndarray:
        """The named output, or a clear error saying how to ask for it."""
        value = getattr(self, name)
        if value is None or (isinstance(value, dict) and not value):
            source = self.meta.get("source", "the feature source")
            raise DataError(f"{source} has no {name!r} features; request them when embedding")
        return value

    def patch_grid(self, layer: int) -> np.ndarray:
        """Patch tokens of one layer as [N, g, g, d] (square grid, row-major like the model)."""
        tokens = self.require("patch_tokens")
        if layer not in tokens:
            raise DataError(f"no patch tokens of layer {layer}; available: {sorted(tokens)}")
        n, p, d = tokens[layer].shape
        g = int(round(p**0.5))
        if g * g != p:
            raise DataError(f"layer {layer}: {p} patch tokens do not form a square grid")
        return tokens[layer].reshape(n, g, g, d)




def features_from_outputs(outputs: dict, meta: dict | None = None) -> Features:
    """The dict ``vit22b.model.apply`` (or a client) returns -> Features (as float32 numpy)."""
    arrays = {
        k: real_array(outputs[k], k) for k in _ARRAY_KEYS if outputs.get(k) is not None
    }
    patches = {
        int(k): real_array(v, f"patch_tokens[{k}]")
        for k, v in (outputs.get("patch_tokens") or {}).items()
    }
    return Features(patch_tokens=patches, meta=dict(meta or {}), **arrays)


def check_finite(array: np.ndarray, name: str) -> None:
    """NaN or infinite features would score as numbers: refused, named."""
    if not np.isfinite(array).all():
        raise DataError(f"features {name} hold NaN or infinite values: a probe on them would "
                        "report numbers that mean nothing")


def real_array(value, name: str) -> np.ndarray:
    """float32 of real numbers; complex values (whose imaginary parts a cast would drop with a
    warning), booleans, text, objects and scalars are refused by name, and so are wider values
    that float32 cannot tell apart (``_cast_keeps``)."""
    array = np.asarray(value)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise DataError(f"features {name} must be real numbers, got dtype {array.dtype}")
    if not array.ndim:
        raise DataError(f"features {name} must hold one row per image, got a single number")
    with np.errstate(over="ignore"):  # past float32's range: refused as infinite (ProbeData)
        cast = array.astype(np.float32, copy=False)
    if cast is not array and array.dtype.itemsize > 2:  # float64, (u)int32/64
        _cast_keeps(array, cast, name)
    return cast


def _cast_keeps(array: np.ndarray, cast: np.ndarray, name: str) -> None:
    """Refuse a cast to float32 that changes some channel's spread by over 0.1%: values like
    1e4 + 1e-4 * signal become one float32 number, and a probe on them scores chance with no
    word of why."""
    if not array.size:  # no channel to lose (an empty width is refused by ProbeData)
        return
    wide = np.asarray(array.reshape(-1, array.shape[-1]), np.float64)  # float64: no copy
    with np.errstate(over="ignore", invalid="ignore"):  # infinite casts: refused as such later
        spread, kept = wide.std(0), cast.reshape(wide.shape).std(0, dtype=np.float64)
        # a constant channel's float64 spread is its mean's rounding (0.1: 5e-16), no signal
        signal = spread > 1e-12 * np.abs(wide.mean(0))
        lost = np.flatnonzero(signal & np.isfinite(kept) & (np.abs(kept - spread) > 1e-3 * spread))
    if len(lost):
        j = int(lost[0])
        raise DataError(
            f"features {name}: {array.dtype} values that float32 cannot tell apart (channel "
            f"{j}: spread {spread[j]:.3g} around {wide[:, j].mean():.6g}, {kept[j]:.3g} in "
            f"float32; {len(lost)} channels so); centre or scale them before saving")


def standardised(x: np.ndarray, train: np.ndarray) -> np.ndarray:
    """``x`` centred and scaled by the statistics of its ``train`` rows (each channel, over
    every other axis), float32: a trained head's inputs, with no test statistic in them."""
    ref = x[train].reshape(-1, x.shape[-1])
    return ((x - ref.mean(0)) / (ref.std(0) + 1e-6)).astype(np.float32)


def save_features(path: str | Path, features: Features) -> None:
    """One .npz (numpy alone opens it): the arrays, patch tokens as ``patch_tokens/<layer>``."""
    write_npz(path, feature_arrays(features))


def feature_arrays(features: Features) -> dict[str, np.ndarray]:
    arrays = {k: getattr(features, k) for k in _ARRAY_KEYS if getattr(features, k) is not None}
    arrays |= {f"patch_tokens/{k}": v for k, v in features.patch_tokens.items()}
    arrays["meta"] = np.asarray(repr(sorted(features.meta.items())))
    return arrays


def write_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` as one .npz at ``path`` (``np.load`` opens it), named as given, whole or not at
    all (a full disk had left a truncated file under the final name). Written entry by entry
    through ``atomic_write``'s stream, which ``np.savez`` does not take (it wants a readable
    file)."""

    def write(f) -> None:
        with zipfile.ZipFile(f, "w") as npz:
            for name, array in arrays.items():
                with npz.open(f"{name}.npy", "w", force_zip64=True) as entry:
                    np.lib.format.write_array(entry, np.asanyarray(array), allow_pickle=False)

    atomic_write(str(path), write)


def read_npz(path: str | Path, what: str, wanted: Callable[[str], bool],
             optional: Callable[[str], bool] = lambda key: False) -> dict[str, np.ndarray]:
    """The arrays of the .npz at ``path`` whose names ``wanted`` takes, each checked from its
    header before the very member checked is read: no pickled objects (refused, never loaded),
    no more data than its member holds (a 1 KB file declaring a 373 GiB array), no two members
    of one name (``x`` and ``x.npy`` read as one by numpy), no more in all than this host's
    available memory. An ``optional`` one that fails its check is left out instead. ``what``:
    the file's kind (``features .npz``), for the messages."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries: dict[str, zipfile.ZipInfo] = {}
            for info in archive.infolist():
                key = info.filename.removesuffix(".npy")
                if key in entries and wanted(key):
                    raise DataError(f"{path}: two members are named {key!r} "
                                    f"({entries[key].filename!r}, {info.filename!r})")
                entries[key] = info
            sizes = {}
            for key in filter(wanted, entries):
                try:
                    sizes[key] = _declared_bytes(archive, entries[key], path, key)
                except (DataError, ValueError):
                    if not optional(key):
                        raise
            have = available_memory()
            if have is not None and sum(sizes.values()) > have:
                raise DataError(f"{path}: its arrays take {sum(sizes.values()) / 2**30:.1f} GiB,"
                                f" read whole, and {have / 2**30:.1f} GiB of memory is available")
            arrays = {}
            for key in sizes:
                with archive.open(entries[key]) as f:
                    arrays[key] = np.lib.format.read_array(f, allow_pickle=False)
            return arrays
    except DataError:  # a ValueError: said whole above
        raise
    except (OSError, ValueError, EOFError, RuntimeError, NotImplementedError,
            zipfile.BadZipFile) as err:  # RuntimeError: encrypted; NotImplemented: Deflate64
        raise DataError(f"{path}: not a readable {what} file ({err})") from None


def _declared_bytes(archive: zipfile.ZipFile, entry: zipfile.ZipInfo, path, key: str) -> int:
    with archive.open(entry) as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read(f)
    if dtype.hasobject:
        raise DataError(f"{path}: {key!r} holds pickled Python objects ({dtype}), which are "
                        "not loaded: save it as numbers or strings")
    size = math.prod(shape) * dtype.itemsize
    if size > entry.file_size:
        raise DataError(f"{path}: {key!r} declares a {dtype} array of shape {list(shape)} "
                        f"({size:,} bytes) in an entry of {entry.file_size:,}: a truncated or "
                        "forged file")
    return size


def load_npz_features(path: str | Path) -> Features:
    if not Path(path).is_file():
        raise DataError(f"{path}: not a features .npz file nor an embed output folder")
    stored = read_npz(path, "features .npz",
                      lambda k: k in _ARRAY_KEYS or k.startswith("patch_tokens/") or k == "meta",
                      optional=lambda k: k == "meta")  # another tool's meta: not read
    outputs: dict = {k: v for k, v in stored.items() if k in _ARRAY_KEYS}
    outputs["patch_tokens"] = {_layer(k, path): v for k, v in stored.items()
                               if k.startswith("patch_tokens/")}
    meta = _saved_meta(stored.get("meta"))  # num_tokens: the diagnostics' uniform entropy
    return features_from_outputs(outputs, {**meta, "source": str(path)})


def _saved_meta(value: np.ndarray | None) -> dict:
    """``save_features``' meta (the repr of its sorted items) read back as literals alone, its
    ``num_tokens`` kept where it is a whole number; {} for a file without it or another."""
    if value is None or value.ndim or value.dtype.kind != "U" or value.itemsize > 1 << 16:
        return {}
    try:
        items = dict(ast.literal_eval(str(value)))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return {}
    tokens = items.get("num_tokens")
    return {"num_tokens": tokens} if isinstance(tokens, int) and tokens > 1 else {}


def _layer(key: str, path) -> int:
    try:
        return int(key.split("/", 1)[1])
    except ValueError:
        raise DataError(f"{path}: {key!r} names no layer (patch_tokens/<layer index>)") from None


def features_from_embed_folder(path: str | Path) -> tuple[Features, list[str]]:
    """The features of a ``vit22b embed`` output folder and the image paths of its rows.

    Reads the stored arrays (``pooled``, ``class_token``, ``patch_tokens.<layer>``) with the
    embed job's numpy-only loader; bfloat16 outputs are widened to float32.
    """
    outputs = open_embed_output(path, "images")
    if any(name.startswith("frames.") for name in outputs.names):
        raise DataError(f"{path}: per-frame features of videos (`vit22b embed --frames K`): "
                        "probe them with `vit22b probe video --features`")
    arrays: dict = {"patch_tokens": {}}
    for name in outputs.names:
        kind, _, layer = name.partition(".")
        value = np.asarray(outputs[name])
        if kind == "patch_tokens":
            arrays["patch_tokens"][int(layer)] = value
        else:
            arrays[kind] = value
    meta = {"source": str(path), **identity_meta(outputs.manifest.get("identity", {})),
            "left_out": len(outputs.failed)}
    return features_from_outputs(arrays, meta), outputs.paths


def open_embed_output(path: str | Path, what: str):
    """A ``vit22b embed`` output folder of a finished job, opened for a probe (``what``:
    "images", "videos"). One cut short is refused (its missing shards would leave examples, or
    whole classes, out), as is one whose files differ from the manifest's sha256s (a flipped bit
    in a feature reads as a plausible number); the inputs the job could not read, which have no
    rows, are said (warned, counted in the report's ``left_out``)."""
    from vit22b.clients.outputs import OutputsError, open_outputs

    try:
        outputs = open_outputs(str(path), verify=True)
    except OutputsError as err:
        raise DataError(str(err)) from None
    except OSError as err:  # a shard the checksum pass cannot read (permissions, I/O)
        raise DataError(f"{err.filename or path}: cannot be read ({err.strerror or err})"
                        ) from None
    if not outputs.complete:
        raise DataError(f"{path}: its embed job has not finished ({len(outputs)} {what} "
                        "embedded so far): run the same `vit22b embed` command again to finish "
                        "it; a probe on part of the data would leave examples or classes out")
    if not len(outputs):
        raise DataError(f"{path}: the embed output holds no embedded {what} (errors.jsonl "
                        "says why each failed)")
    if failed := outputs.failed:
        named = ", ".join(str(f.get("id")) for f in failed[:3])
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        log.warning("%s: the embed job could not read %d of its %s, left out of the probe "
                    "(%s%s; errors.jsonl says why)", path, len(failed), what, named, more)
    return outputs


def identity_meta(identity) -> dict:
    """What made the features, as a report records it (``KEY_NAMES``): from a
    ``ModelIdentity``, a response's ``ModelRef`` or an embed manifest's identity (a dict; an
    older one may lack a field)."""
    from vit22b.model.identity import KEY_NAMES, ModelIdentity
    from vit22b.v1 import wire

    if isinstance(identity, dict):
        return {name: identity.get(name) for name in KEY_NAMES}
    if isinstance(identity, ModelIdentity):
        return identity.described()
    return dict(zip(KEY_NAMES, wire.identity_of_ref(identity), strict=True))


def load_features(source) -> Features:
    """Features from any source: a Features, a dict of arrays, a .npz file or an embed folder."""
    if isinstance(source, Features):
        return source
    if isinstance(source, dict):
        return features_from_outputs(source, {"source": "arrays"})
    path = Path(source)
    if path.is_dir():
        return features_from_embed_folder(path)[0]
    return load_npz_features(path)


# ------------------------------------------------------------------------------------------
# computing features: in-process with the model, or from a server
# ------------------------------------------------------------------------------------------


def evenly_spaced_layers(depth: int, count: int = 4) -> tuple[int, ...]:
    """``count`` blocks spread over the depth, ending at the last (DPT's choice: 2, 5, 8, 11 of
    a 12-block ViT-B); ``patch_layers="auto"`` asks for these."""
    return tuple(sorted({max(depth * q // count - 1, 0) for q in range(1, count + 1)}))


def _layers(patch_layers, depth: int) -> tuple[int, ...]:
    return evenly_spaced_layers(depth) if patch_layers == "auto" else tuple(patch_layers)


def features_from_model(
    images: np.ndarray,
    model=None,
    params: dict | None = None,
    seed: int = 0,
    patch_layers: tuple[int, ...] | str = (),
    attention_stats: bool = False,
    logits: bool = False,
    batch_size: int = 64,
    resolution: int = 0,
    ids: Iterable[str] | None = None,
) -> Features:
    """Run the backbone in-process on uint8 images ([N, H, W, 3] or a list of [H, W, 3]) or
    encoded images (bytes: decoded as served, reduced-size JPEG decoding included):
    ``model`` a preset name or a ViTConfig (default: the served default), random weights from
    ``seed`` unless ``params`` are given; ``patch_layers`` block indices or "auto" (4 evenly
    spaced); ``resolution`` the square input size (0: the model's own); ``ids`` name the
    images in a refusal (files' paths, say). For tests, demos and users without a server."""
    from vit22b.clients.embed_local import features_in_process
    from vit22b.model import DEFAULT_MODEL, OutputRequest, ViTConfig, get_config
    from vit22b.model.errors import InvalidImage

    cfg = model if isinstance(model, ViTConfig) else get_config(model or DEFAULT_MODEL)
    request = OutputRequest(
        pooled=cfg.head != "none",
        patch_layers=_layers(patch_layers, cfg.depth),
        attention_stats=attention_stats,
        logits=logits,
    )
    pixels = (image if isinstance(image, (bytes, bytearray, memoryview)) else np.asarray(image)
              for image in images)  # read as the embedding gets to them
    try:  # the server's own path: the same pixels, batching and finishing as served
        features, identity = features_in_process(cfg, pixels, request, params=params,
                                                 seed=seed, batch_size=batch_size,
                                                 resolution=resolution, ids=ids)
    except InvalidImage as err:  # an image with an id (a file's path) is named by it whole
        raise DataError(f"{err.image_id}: {err.reason}" if err.image_id else str(err)) from None
    size = resolution or cfg.image_size
    meta = {
        **identity_meta(identity),
        "num_tokens": cfg.tokens_at(cfg.grid_at(size, size)),
        "resolution": size,
        "source": f"in-process {cfg.name} (seed {seed})" if params is None else "in-process",
    }
    return features_from_outputs(features.as_tree(), meta)


SHOWN_ERRORS = 5  # a refusal names this many of the images the server could not use


def _named(images: list, index: int) -> str:
    """An input as a refusal names it: a file by its path, anything else by its position."""
    image = images[index]
    return str(image) if isinstance(image, (str, Path)) else f"image {index}"


def features_from_server(
    address: str,
    images,
    patch_layers: tuple[int, ...] | str = (),
    attention_stats: bool = False,
    logits: bool = False,
    batch_size: int | None = None,
    resolution: int = 0,
    **client_kwargs,
) -> Features:
    """Features of ``images`` (paths, bytes, PIL images or uint8 arrays) from a running server,
    through the SDK's ``FeatureClient`` (``client_kwargs``: token, tls, timeout, ...).

    ``patch_layers`` may count from the end (-1 is the last block), or be "auto" (4 evenly
    spaced); the returned patch tokens are keyed by the layers as requested; ``resolution``
    a square size the server allows (0: the model's own).
    """
    import json

    from vit22b.clients import FeatureClient
    from vit22b.v1 import wire

    outputs = ["pooled"] + ["attention_stats"] * attention_stats + ["logits"] * logits
    with FeatureClient(address, **client_kwargs) as client:
        info = client.model_info()
        layers = _layers(patch_layers, info.depth)
        images = list(images)
        result = client.embed(images, outputs=outputs, layers=layers, batch_size=batch_size,
                              resolution=resolution, skip_invalid=True)
    if result.errors:  # every image the server could not use, named as the caller gave it
        named = [f"{_named(images, e.index)}: {e.reason}" for e in result.errors[:SHOWN_ERRORS]]
        more = len(result.errors) - len(named)
        raise DataError(f"{len(result.errors)} of {len(images)} images cannot be embedded: "
                        + "; ".join(named) + (f"; and {more} more" if more else ""))
    config = json.loads(info.config_json or "{}")
    meta = {
        "source": address,  # the response's identity: its geometry's hash
        **identity_meta(result.model if result.model else wire.identity_of(info)),
        "num_tokens": (result.grid[0] * result.grid[1] if result.grid else info.num_patches)
        + int(bool(config.get("class_token"))),
        "resolution": resolution or info.preprocessing.image_size,
        "depth": info.depth,
    }
    return features_from_outputs(result.as_dict(), meta)
