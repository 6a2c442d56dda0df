"""Package exports that load their module on first use (PEP 562), so importing a package stays
cheap: ``vit22b --help`` is instant and the vocabulary does not pull in jax."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` serving ``name`` from the submodule ``exports[name]``."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{exports[name]}", package), name)

    return __getattr__
