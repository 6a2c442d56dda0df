"""What every weight importer shares: reading files, taking tensors by name, layout helpers.

Layouts: PyTorch Linear is (out, in); conv kernels OIHW become HWIO,
flattened in (ph, pw, c) order like the patchify in vit.py; timm fuses qkv as [3D, D] (q|k|v,
heads inside each); big_vision keeps heads explicit ([d, H, hd]).
"""

from __future__ import annotations

import functools
import json
import math
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .checkpoint import format_problems
from .config import ViTConfig
from .host import available_memory

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".npz", ".tar")  # .tar: .pth.tar
# in a directory holding several weight files, the one read (an importer may name others)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# transformers' sharded checkpoints: each index, and the names its saves give the shards
SHARD_INDEX = "model.safetensors.index.json"
BIN_SHARD_INDEX = "pytorch_model.bin.index.json"  # an older save's (save_pretrained, pickles)
SHARD_INDEXES = {SHARD_INDEX: "model-*-of-*.safetensors",
                 BIN_SHARD_INDEX: "pytorch_model-*-of-*.bin"}


class ConvertError(ValueError):
    """A source checkpoint that cannot be converted; the message names the keys involved."""


def byte_size(n: int) -> str:
    """``n`` bytes in the largest binary unit under which it is at least 1 (``3.0 MiB``)."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if round(value, 1) < 1024 or unit == "EiB":  # 1048575 B is 1.0 MiB, not 1024.0 KiB
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def check_memory(what: str, size: int, then: str = "") -> None:
    """Refuse weight files of ``size`` bytes larger than the memory available: every reader
    holds their tensors whole (safetensors' copied out of its map; a zip's unpacked), so past it
    the reads would go on until the kernel's OOM killer ended the process, with no message. A
    lower bound of what a conversion needs (the converted parameters come on top), so it
    refuses nothing that could fit. ``then``: what the message adds (``"; no weight file
    was downloaded"``)."""
    have = available_memory()
    if have is not None and size > have:
        raise ConvertError(f"{what}: its weight files take {byte_size(size)}, read whole, "
                           f"and {byte_size(have)} of memory is available: converting it "
                           f"needs a host with more memory{then}")


@dataclass(frozen=True)
class Hints:
    """What the user told us: a preset to match, a head count, a parameter dtype, the MLP's
    activation (code, not weights: OpenCLIP's GELU or QuickGELU)."""

    preset: ViTConfig | None = None
    heads: int | None = None
    dtype: str | None = None
    mlp: str | None = None  # "gelu" or "quick_gelu"


@dataclass(frozen=True)
class Sizes:
    """What a checkpoint's tensor shapes tell: the sizes of its ViT."""

    width: int
    depth: int
    heads: int
    mlp_dim: int
    patch: int
    grid: int
    channels: int
    head_mlp_dim: int | None = None  # the attention-pooling head's MLP, where there is one

    def config(self, **fields) -> ViTConfig:
        """The config: these sizes plus the source's ``fields``."""
        return ViTConfig(
            width=self.width,
            depth=self.depth,
            heads=self.heads,
            mlp_dim=self.mlp_dim,
            patch=self.patch,
            image_size=self.grid * self.patch,
            channels=self.channels,
            head_mlp_dim=None if self.head_mlp_dim in (None, self.mlp_dim) else self.head_mlp_dim,
            **fields,
        )


# ------------------------------------------------------------------------------------------
# reading the source files
# ------------------------------------------------------------------------------------------


MAX_JSON_BYTES = 16 << 20  # a config file or an index: kilobytes
MAX_JSON_DEPTH = 64  # a config nests a few levels; past this, a hostile file


def read_json(file: Path) -> object:
    """A JSON file beside the weights: a regular file (a pipe would wait for a writer, a device
    be read without end) of a bounded size."""
    if not file.is_file():
        raise ConvertError(f"{file}: not a regular file")
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ConvertError(f"{file}: {size} bytes, over the {MAX_JSON_BYTES} a JSON file beside "
                           "the weights may hold")
    too_deep = ConvertError(f"{file}: nested over {MAX_JSON_DEPTH} levels deep, far past any "
                            "config's")
    try:
        data = json.loads(file.read_text())
    except ValueError as err:  # bad JSON, or bytes that are not UTF-8
        raise ConvertError(f"{file}: not valid JSON: {err}") from None
    except RecursionError:  # [[[... past Python's stack
        raise too_deep from None
    if _depth(data) > MAX_JSON_DEPTH:  # every reader of it recurses
        raise too_deep
    return data


def _depth(data: object) -> int:
    """How deep lists and objects nest in ``data`` (without recursion: every reader of it
    recurses)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def find_weights(path: Path, preferred: tuple[str, ...] = WEIGHT_FILES) -> list[Path]:
    """The weight file(s) at ``path``: a file, or a directory holding one (or a sharded index
    where the importer reads one); in a directory with several, the first of the ``preferred``
    names present."""
    if (index := shard_index(path, preferred)) is not None:
        return [index.parent / name for name in index_shards(index)]
    if path.is_file():
        for name, shards in SHARD_INDEXES.items():
            if name in preferred and path.match(shards) and (path.parent / name).is_file():
                raise ConvertError(f"{path}: one shard of the checkpoint its folder's {name} "
                                   "names: convert the folder")
        return [path]
    if not path.is_dir():
        raise ConvertError(f"{path}: not a regular file or a folder" if path.exists()
                           else f"{path}: no such file or directory")
    candidates = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    present = [path / name for name in preferred if (path / name) in candidates]
    if present or len(candidates) == 1:
        return present[:1] or candidates
    names = ", ".join(p.name for p in candidates) or "none"
    raise ConvertError(
        f"{path}: expected one weight file ({'/'.join(WEIGHT_SUFFIXES)}), found: {names}"
    )


def index_map(index: Path) -> dict[str, str]:
    """transformers' shard index: tensor name -> shard file, each a plain name beside it of the
    index's kind (``.safetensors``, or ``.bin`` for ``pytorch_model.bin.index.json``; no folder,
    no glob character: the hub fetches by pattern)."""
    suffix = Path(SHARD_INDEXES.get(index.name, SHARD_INDEX)).suffix
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConvertError(f"{index}: holds no weight_map, an object of tensor names to shard "
                           "files")
    for name in weight_map.values():
        if (not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..")
                or not name.endswith(suffix) or any(c in name for c in "*?[]")):
            raise ConvertError(f"{index}: weight_map names {name!r}, not a {suffix} file in its "
                               "folder")
    return weight_map


def index_shards(index: Path) -> list[str]:
    """The shard files transformers' index names, each once."""
    return sorted(set(index_map(index).values()))


def shard_index(path: Path, preferred: tuple[str, ...] = WEIGHT_FILES) -> Path | None:
    """The shard index ``find_weights`` reads at ``path`` (the index itself, or a folder
    holding one), where the importer's ``preferred`` files name it and no file it prefers to
    it is in the folder (transformers' order: ``model.safetensors``, its index,
    ``pytorch_model.bin``, its index). timm's and big_vision's loaders read no index."""
    if path.name in SHARD_INDEXES and path.name in preferred and path.is_file():
        return path
    if not path.is_dir():
        return None
    dangling = None
    for name in preferred:  # an index that is no regular file is read, to be refused by name
        index = path / name
        if index.is_file() or (name in SHARD_INDEXES and index.exists()):
            return index if name in SHARD_INDEXES else None
        if name in SHARD_INDEXES and index.is_symlink():  # refused, if nothing else is there
            dangling = dangling or index
    return dangling


def _head(path: Path, size: int = 262) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


def unpacked_size(path: Path) -> int:
    """The bytes a reader holds for a weight file: a zip's (an .npz, PyTorch's format) as its
    directory lists them unpacked (what its readers allocate; Python's stops reading there),
    any other file's as it is."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            return max(size, sum(info.file_size for info in archive.infolist()))
    except (zipfile.BadZipFile, OSError, ValueError):
        return size


# Where a training checkpoint keeps its weights, in the order timm's load_checkpoint looks
# (the EMA weights first, as it loads them by default), then open_clip's and others' wrappers.
_TRAINED_WEIGHTS = ("state_dict_ema", "model_ema", "state_dict", "model", "module")


def _weights_of(obj: object, path: Path, notes: list[str]) -> object:
    """The state dict inside a training checkpoint (timm's checkpoint-N.pth.tar, open_clip's
    epoch_N.pt: the weights beside the epoch, the run's arguments, the optimizer); any other
    object as it is."""
    if not isinstance(obj, dict) or all(_is_tensor(v) for v in obj.values()):
        return obj
    found = [key for key in _TRAINED_WEIGHTS if obj.get(key) is not None]
    if not found:
        return obj
    key, others = found[0], found[1:]  # timm's choice: the first present, empty or not
    weights = obj[key]
    if not isinstance(weights, dict) or not weights:
        what = "empty" if isinstance(weights, dict) else f"a {type(weights).__name__}"
        raise ConvertError(f"{path}: a training checkpoint whose {key!r} (the weights timm's "
                           f"load_checkpoint reads) is {what}, not a state dict")
    if len(obj) > 1:
        notes.append(f"{path.name}: a training checkpoint: its {key!r} read (as timm's "
                     "load_checkpoint reads it)"
                     f"{f'; it also holds {others}' if others else ''}; its other entries "
                     "(epoch, arguments, optimizer) left unread")
    return weights


def arg_name(key: str) -> str:
    """A config file's key as a refusal names it: as it is when a plain name, else quoted (a
    newline or a terminal escape in it must not reach the message raw)."""
    return key if key.isidentifier() and key.isascii() else repr(key)


def _is_tensor(value: object) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _torch_tensors(path: Path, notes: list[str]) -> dict[str, np.ndarray]:
    import argparse
    import pickle

    import torch

    # torch's own words for a file it cannot place advise loading it unsafely: say what it is
    head = _head(path)
    if head[257:262] == b"ustar":
        raise ConvertError(f"{path}: saved in PyTorch's legacy tar format, which cannot be "
                           "read without running its pickles: save its state dict again with "
                           "a current PyTorch, or as safetensors")
    if not (head.startswith(b"PK") or head.startswith(b"\x80")):  # a zip, or a pickle
        raise ConvertError(f"{path}: not a PyTorch checkpoint (neither a zip archive nor a "
                           "pickle): damaged, or another format under this name?")

    try:  # tensors and plain containers only: a pickle's other objects could run code (a
        # Namespace, timm's saved run arguments, only sets attributes)
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))  # what torch's loader refused
        raise ConvertError(
            f"{path}: holds pickled Python objects besides tensors"
            f"{f' ({found[1]})' if found else ''}, which are never loaded (they could run code): "
            "save the model's state dict alone, or as safetensors, where the file is trusted"
        ) from None
    obj = _weights_of(obj, path, notes)
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: expected a state dict, found {type(obj).__name__}")
    tensors = {}
    for key, value in obj.items():
        if isinstance(value, dict) and value and all(_is_tensor(v) for v in value.values()):
            raise ConvertError(f"{path}: its weights are under {key!r} ({len(value)} tensors, "
                               "a training checkpoint's layout this converter does not read): "
                               "save that state dict alone")
        if not isinstance(value, torch.Tensor):
            raise ConvertError(f"{path}: key {key!r} is a {type(value).__name__}, not a tensor")
        value = value.detach().contiguous()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
            tensors[key] = value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            tensors[key] = value.numpy()
    return tensors


def _npz_tensors(path: Path) -> dict[str, np.ndarray]:
    if not zipfile.is_zipfile(path):  # numpy would take it for a pickle, and advise loading it
        raise ConvertError(f"{path}: not an .npz archive (no zip directory): damaged, or "
                           "another format under this name?")
    with np.load(path, allow_pickle=False) as npz:
        tensors = {key: npz[key] for key in npz.files}
    for key, value in tensors.items():
        if value.dtype.kind == "V" and value.dtype.itemsize == 2:  # bfloat16 saved as raw bytes
            tensors[key] = value.view(ml_dtypes.bfloat16)
    return tensors


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


# Prefixes a wrapper module gives every key: DDP's, torch.compile's (around DDP or inside it)
_WRAPPERS = (("_orig_mod.", "torch.compile"), ("module.", "DistributedDataParallel"),
             ("_orig_mod.", "torch.compile"))


def read_tensors(files: list[Path], index: Path | None = None,
                 notes: list[str] | None = None) -> dict[str, np.ndarray]:
    """Every tensor of ``files``; with the shard ``index`` they come from, each tensor it names
    must be in one of them. What a reader chose (a training checkpoint's weights) goes to
    ``notes``."""
    torch_file = functools.partial(_torch_tensors, notes=[] if notes is None else notes)
    readers: dict[str, Callable[[Path], dict]] = {
        ".safetensors": _safetensors,
        ".npz": _npz_tensors,
        ".pth": torch_file,
        ".pt": torch_file,
        ".bin": torch_file,
        ".tar": torch_file,  # timm's training checkpoints, checkpoint-N.pth.tar: a zip, not a tar
    }
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        reader = readers.get(path.suffix)
        if reader is None:
            raise ConvertError(f"{path}: unknown weight format {path.suffix!r}")
        if path.exists() and not path.is_file():  # a pipe would wait for a writer for ever
            raise ConvertError(f"{path}: not a regular file")
        try:
            part = reader(path)
        except ConvertError:
            raise
        except Exception as err:  # corrupt or truncated files raise many kinds
            raise ConvertError(f"{path}: cannot read weights: {type(err).__name__}: {err}") from err
        clash = sorted(set(part) & set(tensors))
        if clash:
            raise ConvertError(f"{path}: keys {clash[:5]} also appear in another shard")
        tensors.update(part)
    if index is not None:  # a tensor the index names but no shard holds
        lost = sorted(k for k in index_map(index) if k not in tensors)
        if lost:  # would be read as absent (a bias, a head): another model, silently
            shown = ", ".join(repr(k) if len(k) <= 80 else f"{k[:60]!r}..." for k in lost[:5])
            raise ConvertError(f"{index}: names tensors no shard holds ({shown}"
                               f"{', ...' if len(lost) > 5 else ''}): a shard of another save?")
    for prefix, wrapper in _WRAPPERS:  # in either order, as timm's clean_state_dict strips them
        if tensors and all(key.startswith(prefix) for key in tensors):
            if notes is not None:
                notes.append(f"stripped the {prefix!r} prefix (a {wrapper} state dict)")
            tensors = {key.removeprefix(prefix): value for key, value in tensors.items()}
    return tensors


# ------------------------------------------------------------------------------------------
# taking tensors by name, with every problem collected
# ------------------------------------------------------------------------------------------


class SourceTensors:
    """The source's tensors by name; each must be taken or dropped exactly once."""

    def __init__(self, tensors: dict[str, np.ndarray], source: str):
        self.tensors = tensors
        self.source = source
        self.used: set[str] = set()
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.family = ""  # set by an importer's infer_config when it reads several layouts
        self.scales_folded = False  # a LayerScale was folded into a projection (float32)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def take(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as f32; a missing, mis-shaped, complex or non-finite one is recorded and
        stands in as zeros (a NaN weight would make every output NaN: a corrupt download, not a
        model)."""
        shape = tuple(int(n) for n in shape)
        if key not in self.tensors:
            self.problems.append(f"missing key {key!r} (expected shape {shape})")
            return np.zeros(shape, np.float32)
        self.used.add(key)
        value = self.tensors[key]
        if tuple(value.shape) != shape:
            self.problems.append(f"key {key!r} has shape {tuple(value.shape)}, expected {shape}")
            return np.zeros(shape, np.float32)
        if np.iscomplexobj(value):  # a cast to float32 would drop the imaginary parts
            self.problems.append(f"key {key!r} holds complex values ({value.dtype})")
            return np.zeros(shape, np.float32)
        if not _floating(value.dtype):  # integers read as weights: a quantized or broken file
            self.problems.append(f"key {key!r} holds {value.dtype} values, not floating point")
            return np.zeros(shape, np.float32)
        value = np.asarray(value, np.float32)
        if not np.isfinite(value).all():
            nan, inf = int(np.isnan(value).sum()), int(np.isinf(value).sum())
            self.problems.append(f"key {key!r} holds {nan} NaN and {inf} infinite values of "
                                 f"{value.size}")
            return np.zeros(shape, np.float32)
        return value

    def zeros(self, key: str, shape: tuple[int, ...], why: str) -> np.ndarray:
        if key in self.tensors:
            return self.take(key, shape)
        self.notes.append(f"{key}: not in the checkpoint ({why}); zeros")
        return np.zeros(shape, np.float32)

    def drop(self, key: str, why: str) -> None:
        if key in self.tensors:
            self.used.add(key)
            self.notes.append(f"dropped {key} {self.shape(key)}: {why}")

    def refuse(self, key: str, what: str) -> None:
        if key in self.tensors:
            raise ConvertError(
                f"{self.source} checkpoint: key {key!r} {self.shape(key)} is {what}, which this "
                "model cannot express; refusing to convert rather than drop it"
            )

    def finish(self) -> None:
        unexpected = sorted(set(self.tensors) - self.used)
        problems = self.problems + [
            f"unexpected key {key!r} with shape {self.shape(key)}" for key in unexpected
        ]
        if problems:
            context = f"{self.source} checkpoint does not convert"
            raise ConvertError(format_problems(problems, context, limit=40))

    def some_keys(self, n: int = 8) -> str:
        """The first keys, for a message saying what a checkpoint holds."""
        return ", ".join(sorted(self.tensors)[:n]) or "none"

    def float_dtype(self) -> str:
        """'bfloat16' when every floating tensor is, else 'float32'."""
        floats = [v.dtype for v in self.tensors.values() if _floating(v.dtype)]
        return "bfloat16" if floats and all(d == _BF16 for d in floats) else "float32"


_BF16 = np.dtype(ml_dtypes.bfloat16)


def _floating(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == _BF16


def check_claims(source: str, file: str, claims: dict[str, tuple]) -> None:
    """A config file's claims, ``{name: (what the file says, what the weights have)}``, must hold
    wherever the file makes one; every contradiction is named, with both values."""
    problems = [
        f"{name}: {file} has {said}, the weights have {have}"
        for name, (said, have) in claims.items()
        if said is not None and have is not None and said != have
    ]
    if problems:
        raise ConvertError(
            f"{source} checkpoint: {file} contradicts the weights: {'; '.join(problems)}"
        )


def count_blocks(t: SourceTensors, pattern: str) -> int:
    indices = {int(m[1]) for key in t.tensors if (m := re.match(pattern, key))}
    if not indices:
        raise ConvertError(f"{t.source} checkpoint: no transformer blocks (keys like {pattern!r})")
    depth = max(indices) + 1
    missing = sorted(set(range(depth)) - indices)
    if missing:
        raise ConvertError(f"{t.source} checkpoint: blocks {missing} are missing (depth {depth})")
    return depth


def grid_of(n_pos: int, class_token: bool, source: str) -> tuple[int, bool]:
    """Grid side and whether the position table covers the class token."""
    if class_token and math.isqrt(n_pos - 1) ** 2 == n_pos - 1:
        return math.isqrt(n_pos - 1), True
    if math.isqrt(n_pos) ** 2 == n_pos:
        return math.isqrt(n_pos), False
    raise ConvertError(f"{source} checkpoint: its position embedding of {n_pos} tokens is not a "
                       "square grid (nor one after a class token): only square grids are supported")


def patch_conv(t: SourceTensors, key: str, hwio: bool = False) -> tuple[int, int, int]:
    """(width, channels, patch side) of the patch embedding's kernel ``key`` (OIHW, or HWIO);
    non-square patches are refused by name (the model's patches are square)."""
    shape = t.shape(key)
    width, channels, height, across = (shape[3], shape[2], *shape[:2]) if hwio else shape
    if height != across:
        raise ConvertError(f"{t.source} checkpoint: {key} {shape} embeds {height}x{across} "
                           "patches: only square patches are supported")
    return width, channels, height


def infer_heads(
    t: SourceTensors, hints: Hints, head_dim_key: str | None, width: int, from_file: int | None
) -> int:
    if head_dim_key and head_dim_key in t:  # QK-norm scales are (head_dim,)
        return width // t.shape(head_dim_key)[0]
    for heads in (hints.heads, from_file, hints.preset and hints.preset.heads):
        if heads:
            return int(heads)
    raise ConvertError(
        f"{t.source} checkpoint: the number of heads is not in the weights (no QK-norm) nor in a "
        "config.json beside them: pass --heads N (or --model PRESET)"
    )


# ------------------------------------------------------------------------------------------
# layout helpers (PyTorch (out, in) -> ours)
# ------------------------------------------------------------------------------------------


def patch_kernel(w_oihw: np.ndarray) -> np.ndarray:
    """Conv kernel [d, C, p, p] -> [p*p*C, d] in vit.py's (ph, pw, c) patch order."""
    return w_oihw.transpose(2, 3, 1, 0).reshape(-1, w_oihw.shape[0])


def split_heads_in(w_in_out: np.ndarray, heads: int) -> np.ndarray:
    """[d, H*hd] (input-major) -> [d, H, hd]."""
    return w_in_out.reshape(w_in_out.shape[0], heads, -1)


def split_heads_out(w_in_out: np.ndarray, heads: int) -> np.ndarray:
    """[H*hd, d] (input-major) -> [H, hd, d]."""
    return w_in_out.reshape(heads, -1, w_in_out.shape[-1])


def fused_to_heads(w_in_out: np.ndarray, parts: int, heads: int) -> np.ndarray:
    """[d, parts*H*hd] with parts outermost (timm qkv, kv) -> [d, H, parts*hd], per head q|k|v."""
    d = w_in_out.shape[0]
    return w_in_out.reshape(d, parts, heads, -1).transpose(0, 2, 1, 3).reshape(d, heads, -1)


def fused_bias_to_heads(bias: np.ndarray, parts: int, heads: int) -> np.ndarray:
    return bias.reshape(parts, heads, -1).transpose(1, 0, 2).reshape(heads, -1)


def norm_params(t: SourceTensors, scale_key: str, bias_key: str, cfg: ViTConfig, dim: int) -> dict:
    params = {"scale": t.take(scale_key, (dim,))}
    if cfg.norm == "layernorm":
        params["bias"] = t.take(bias_key, (dim,))
    return params


def torch_norm(t: SourceTensors, prefix: str, cfg: ViTConfig, dim: int | None = None) -> dict:
    return norm_params(t, f"{prefix}.weight", f"{prefix}.bias", cfg, dim or cfg.width)


def torch_linear(t: SourceTensors, prefix: str, n_out: int, n_in: int, bias: bool):
    """PyTorch Linear -> (kernel [in, out], bias [out] or None)."""
    kernel = t.take(f"{prefix}.weight", (n_out, n_in)).T
    return kernel, (t.take(f"{prefix}.bias", (n_out,)) if bias else None)


def fold_layer_scale(t: SourceTensors, key: str, dim: int, *arrays: np.ndarray | None) -> None:
    """Fold a LayerScale ``x + gamma * f(x)`` into f's output projection (in place)."""
    if key not in t:
        return
    gamma = t.take(key, (dim,))
    t.scales_folded = True
    for array in arrays:
        if array is not None:
            array *= gamma
