"""Imported classifier heads applied to pooled features.

File format (``.npz``, written by ``save_head`` and by the weight converter; numpy alone reads it):

- ``kernel``: float array [d, C], the head's weight in Flax (in, out) layout
  (a PyTorch ``nn.Linear.weight`` is [C, d]: transpose it);
- ``bias``: float array [C];
- ``class_names`` (optional): unicode string array [C] (e.g. ImageNet synset names), stored
  without pickling.

``logits = pooled @ kernel + bias``: the features must be the same pooled representation the
head was trained on (big_vision's ``pre_logits``, timm's ``forward_head(pre_logits=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data import DataError
from .features import read_npz, write_npz
from .metrics import class_name_list


@dataclass(frozen=True)
class LinearHead:
    kernel: np.ndarray  # [d, C]
    bias: np.ndarray  # [C]
    class_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kernel.ndim != 2:
            raise DataError(f"head kernel must be [d, C], got shape {self.kernel.shape}")
        if self.bias.shape != (self.kernel.shape[1],):
            raise DataError(
                f"head bias of shape {self.bias.shape} does not match kernel {self.kernel.shape}"
            )
        if self.class_names and len(self.class_names) != self.kernel.shape[1]:
            raise DataError(
                f"head has {len(self.class_names)} class names for {self.kernel.shape[1]} classes"
            )
        for name, array in (("kernel", self.kernel), ("bias", self.bias)):
            if not np.isfinite(array).all():  # a corrupt download: every decision NaN
                raise DataError(f"head {name} holds {int((~np.isfinite(array)).sum())} NaN or "
                                "infinite values")

    @property
    def num_classes(self) -> int:
        return self.kernel.shape[1]

    def logits(self, pooled: np.ndarray) -> np.ndarray:
        pooled = np.asarray(pooled, np.float32)
        if pooled.ndim != 2 or pooled.shape[1] != self.kernel.shape[0]:
            raise DataError(
                f"pooled features of shape {pooled.shape} do not fit a head of input width "
                f"{self.kernel.shape[0]}"
            )
        with np.errstate(over="ignore", invalid="ignore"):  # refused just below
            logits = pooled @ self.kernel + self.bias
        if not np.isfinite(logits).all():
            raise DataError("the head's logits overflow float32 on these features")
        return logits


def save_head(path: str | Path, head: LinearHead) -> Path:
    """Write ``head`` to ``path`` (``.npz`` appended when missing, as ``np.savez`` does), whole
    or not at all: a failed write (a full disk) leaves the file it replaces as it was. Returns
    the path written."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    arrays = {"kernel": head.kernel.astype(np.float32), "bias": head.bias.astype(np.float32)}
    if head.class_names:
        arrays["class_names"] = np.asarray(head.class_names, dtype=str)
    write_npz(path, arrays)
    return path


def load_head(path: str | Path) -> LinearHead:
    path = Path(path)
    arrays = read_npz(path, ".npz head", lambda k: k in ("kernel", "bias", "class_names"))
    missing = {"kernel", "bias"} - set(arrays)
    if missing:
        raise DataError(f"{path}: head file lacks {sorted(missing)} (has {sorted(arrays)})")
    kernel, bias = arrays["kernel"], arrays["bias"]
    names = (class_name_list(arrays["class_names"], f"{path}: class_names")
             if "class_names" in arrays else ())
    for name, array in (("kernel", kernel), ("bias", bias)):
        if not np.issubdtype(array.dtype, np.floating):
            raise DataError(f"{path}: {name} must be floating point, got {array.dtype}")
    try:
        with np.errstate(over="ignore"):  # a float32 overflow is refused as infinite
            kernel, bias = kernel.astype(np.float32), bias.astype(np.float32)
        return LinearHead(kernel, bias, names)
    except DataError as err:
        raise DataError(f"{path}: {err}") from None
