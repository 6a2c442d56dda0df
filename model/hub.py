"""Models named on the Hugging Face Hub: ``ORG/NAME`` (``--from hf``) or ``hf-hub:ORG/NAME``
(any source, timm's spelling), optionally ``@REVISION``, read from the local hub cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``: the
``models--ORG--NAME/{refs,snapshots}`` layout). Where a hub is reachable it is asked which files
the revision holds and what the cache lacks is downloaded into it, so the same files are read
whatever an earlier tool left there; where it is not, a cached snapshot is read as it is
(warned), and with ``HF_HUB_OFFLINE=1`` the cache alone.

Only what an importer reads is fetched: its config files and the first weight file of its
preference list that the repository holds (a repository often keeps the same weights in several
formats), or, for transformers' sharded checkpoints (safetensors, or an older save's pickles),
the index and then the shards it names. The weights' sizes are asked first (the hub's file
metadata): weights larger than the memory available (the converter reads them whole) or than the
cache's free disk are refused before any of them is downloaded. A snapshot cut short (an index
and some of its shards) is completed.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .convert_common import (
    SHARD_INDEXES,
    ConvertError,
    byte_size,
    check_memory,
    index_shards,
    shard_index,
)

log = logging.getLogger(__name__)

PREFIX = "hf-hub:"
_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")
# a branch, tag or commit ("main", "v1.0", "refs/pr/1", a hash): huggingface_hub reads
# refs/REVISION as a file, so "../" would read any file's first line as a commit
_REVISION = re.compile(r"^(?!.*\.\.)[\w.-]+(/[\w.-]+)*$")


@dataclass(frozen=True)
class HubModel:
    """A repository on the hub, as the user named it, and the revision asked for."""

    spec: str  # what was typed, without the revision: "facebook/dinov2-small", "hf-hub:timm/..."
    repo: str
    revision: str = "main"

    def folder(self, cache: Path) -> Path:
        return cache / ("models--" + self.repo.replace("/", "--"))


def parse(source: str, name: str) -> HubModel | None:
    """The hub model ``name`` names, or None when it is a local path (an existing path always
    is; so is any name that is not ``hf-hub:ORG/NAME``, or for ``--from hf`` ``ORG/NAME``)."""
    spec = str(name)
    if Path(spec).exists():
        return None
    bare = spec.removeprefix(PREFIX)
    if bare == spec and source != "hf":
        return None
    repo, _, revision = bare.partition("@")
    if not _REPO.match(repo):
        if bare != spec:
            raise ConvertError(f"{spec}: not a hub model name (hf-hub:ORG/NAME[@REVISION])")
        return None  # a local path that does not exist: find_weights says so
    spec = spec.partition("@")[0]
    if revision and not _REVISION.match(revision):
        raise ConvertError(f"{spec}: revision {revision!r} is not a branch, tag or commit name")
    return HubModel(spec, repo, revision or "main")


def cache_dir() -> Path:
    """The hub cache, read from the environment at each call (huggingface_hub's own constants
    are fixed when it is imported), with huggingface_hub's precedence."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return _expanded(os.environ[var], var)
    if os.environ.get("HF_HOME"):
        return _expanded(os.environ["HF_HOME"], "HF_HOME") / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(_expanded("~", "HOME"), ".cache")
    return _expanded(cache, "XDG_CACHE_HOME") / "huggingface" / "hub"


def _expanded(value: str, var: str) -> Path:
    """``value`` with a leading ``~`` or ``~user`` expanded; ConvertError where it cannot be
    (huggingface_hub's own expansion raised a bare RuntimeError)."""
    path = os.path.expanduser(value)
    if path.startswith("~"):
        raise ConvertError(f"{var}={value!r}: {path.split(os.sep)[0]} names no user's home "
                           "folder here, so the Hugging Face cache has no place")
    return Path(path)


def offline() -> bool:
    return any(
        os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def fetch(model: HubModel, side_files: tuple[str, ...], weights: tuple[str, ...]) -> Path:
    """The snapshot folder holding ``side_files`` (where the repository has them) and the
    first of ``weights`` the repository holds (the importer's order; transformers' shard index
    stands for the shards it names). Online, the hub is asked which files it holds, and what
    the cache lacks is downloaded (files it holds are not fetched again); where the hub cannot
    be asked, a cached snapshot holding weights is converted as it is, with a warning, as the
    sources' libraries do. Offline (``HF_HUB_OFFLINE``), the cache alone. The folder's name is
    the commit it holds."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir()
    shards = [SHARD_INDEXES[name] for name in weights if name in SHARD_INDEXES]
    patterns = [*side_files, *weights, *shards]
    try:
        folder = Path(
            snapshot_download(
                model.repo,
                revision=model.revision,
                cache_dir=cache,
                local_files_only=True,
                allow_patterns=patterns,
            )
        )
    except LocalEntryNotFoundError as err:
        # IncompleteSnapshotError (newer huggingface_hub) keeps the folder: files of the repo we
        # never fetched are missing, ours may not be
        snapshot = getattr(err, "snapshot_path", None)
        folder = Path(snapshot) if snapshot else None
    lacks = None if folder is None else _missing(folder, weights)
    if offline() and lacks == []:
        return folder
    if offline():
        raise ConvertError(f"{_named(model)}{_lacking(model, lacks, weights)} "
                           f"({model.folder(cache)}), and HF_HUB_OFFLINE forbids downloading it")
    try:  # online, the hub says which of its files the importer reads (as its library does)
        return _download(model, cache, side_files, weights, folder)
    except HubUnreachable as err:
        if lacks is None:
            raise
        if lacks:
            raise ConvertError(f"{_named(model)}{_lacking(model, lacks, weights)} "
                               f"({model.folder(cache)}), and downloading it failed: "
                               f"{err.reason}") from err
        _keep_ref(model, cache, folder.name)
        log.warning("%s: asking the hub failed (%s); converting the cached snapshot %s as it "
                    "is", model.spec, err.reason, folder)
        return folder


def _lacking(model: HubModel, lacks: list[str] | None, weights: tuple[str, ...]) -> str:
    """What the cache lacks of ``model``, for a refusal."""
    if lacks is None:
        return f"revision {model.revision!r} is not in the Hugging Face cache"
    if lacks == list(weights):
        return f"its cached snapshot holds none of {', '.join(weights)}"
    return f"its cached snapshot lacks {', '.join(lacks)} (a download cut short?)"


def _keep_ref(model: HubModel, cache: Path, commit: str) -> None:
    """Point the revision's ref at the snapshot converted: huggingface_hub moves it to the
    hub's newer commit before fetching its files, so a download that then failed left it
    naming a snapshot without weights, and every later offline run refused the model."""
    ref = model.folder(cache) / "refs" / model.revision
    try:
        if ref.is_file() and ref.read_text().strip() != commit:
            ref.write_text(commit)
    except OSError as err:  # a read-only cache: said, the conversion goes on
        log.warning("%s: could not point %s back at %s: %s", model.spec, ref, commit, err)


class HubUnreachable(ConvertError):
    """The hub could not be asked, or would not give a file (``reason``: its words)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _named(model: HubModel) -> str:
    """How a message starts: a bare ORG/NAME may also have been meant as a local path."""
    local = "" if model.spec.startswith(PREFIX) else "no such local path, and "
    return f"{model.spec}: {local}"


def _revision(model: HubModel) -> str:
    return f"{model.spec} (revision {model.revision!r})"


def _missing(folder: Path, weights: tuple[str, ...]) -> list[str]:
    """The weight files ``folder`` lacks for the converter: the shards an index names that it
    lacks (a download cut short keeps the index and some), none when it holds one of
    ``weights``, else ``weights`` themselves."""
    if (index := shard_index(folder, weights)) is not None:  # as the converter reads it
        return [name for name in index_shards(index) if not (folder / name).is_file()]
    files = [name for name in weights if name not in SHARD_INDEXES]
    return [] if any((folder / name).is_file() for name in files) else list(weights)


def _size(sibling) -> int | None:
    """A file's bytes as the hub's metadata gives them (an LFS object's, else the file's); None
    where neither is a byte count."""
    for size in (getattr(getattr(sibling, "lfs", None), "size", None),
                 getattr(sibling, "size", None)):
        if isinstance(size, float) and math.isfinite(size) and size.is_integer():
            size = int(size)  # JSON's 1e10
        if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
            return size
    return None


def _free_disk(folder: Path) -> int | None:
    """Free bytes on the file system that holds (or will hold) ``folder``."""
    for level in (folder, *folder.parents):
        if level.exists():
            try:
                return shutil.disk_usage(level).free
            except OSError:
                return None
    return None


def _check_room(model: HubModel, cache: Path, sizes: dict[str, int | None],
                names: list[str], cached: Path | None) -> None:
    """Refuse, before downloading, weight files ``names`` that the converter could not read
    whole here or the cache could not hold (those already in the cached snapshot ``cached``
    need no room)."""
    what = _revision(model)
    needed = sum(sizes.get(name) or 0 for name in names
                 if cached is None or not (cached / name).is_file())
    free = _free_disk(cache)
    if free is not None and needed > free:
        raise ConvertError(
            f"{what}: its weight files take {byte_size(needed)} to download, and the Hugging "
            f"Face cache ({cache}) has {byte_size(free)} free; no weight file was downloaded "
            "(HF_HUB_CACHE chooses another cache)"
        )
    check_memory(what, sum(sizes.get(name) or 0 for name in names),
                 "; no weight file was downloaded")


def _files(model: HubModel, endpoint: str | None) -> dict[str, int | None]:
    """The repository's files at the revision, with their sizes where the hub gives them."""
    from huggingface_hub import HfApi

    try:
        # model_info asks once (list_repo_files would retry an unreachable hub for half a
        # minute); huggingface_hub parses the answer as it comes
        info = HfApi(endpoint=endpoint).model_info(model.repo, revision=model.revision,
                                                   timeout=10, files_metadata=True)
        return {sibling.rfilename: _size(sibling) for sibling in info.siblings or ()}
    except (AssertionError, AttributeError, KeyError, TypeError) as err:  # another shape
        raise ConvertError(f"{_named(model)}the hub's description of revision "
                           f"{model.revision!r} is malformed ({type(err).__name__}: {err}); "
                           "no weight file was downloaded") from None


def _download(
    model: HubModel, cache: Path, side_files: tuple[str, ...], weights: tuple[str, ...],
    cached: Path | None,
) -> Path:
    from huggingface_hub import snapshot_download

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, as the cache is

    def download(patterns: list[str]) -> Path:
        return Path(snapshot_download(model.repo, revision=model.revision, cache_dir=cache,
                                      allow_patterns=patterns, endpoint=endpoint))

    try:
        sizes = _files(model, endpoint)
        chosen = [name for name in weights if name in sizes][:1]  # the converter's order
        if chosen and (index := chosen[0]) in SHARD_INDEXES:
            # the index first: its shards alone are fetched (a repository may keep others)
            chosen = index_shards(download([*side_files, index]) / index)
            if absent := [name for name in chosen if name not in sizes]:
                raise ConvertError(
                    f"{_revision(model)}: its {index} names "
                    f"{', '.join(absent)}, which the repository does not hold; no weight file "
                    "was downloaded")
            chosen.append(index)
        if not chosen:
            held = ", ".join(sorted(sizes)) or "no files"
            raise ConvertError(
                f"{_revision(model)} holds none of the weight files this "
                f"importer reads ({', '.join(weights)}); it has: {held}"
            )
        _check_room(model, cache, sizes, chosen, cached)
        folder = download([*side_files, *chosen])
    except ConvertError:
        raise
    except Exception as err:  # no route, refused, unknown repository or revision, no access
        # whole (a 404's file is on its third line), in one line
        reason = f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"
        raise HubUnreachable(
            f"{_named(model)}revision {model.revision!r} is not in the Hugging Face cache "
            f"({model.folder(cache)}), and downloading it failed: {reason}", reason
        ) from err
    if missing := _missing(folder, weights):  # a hub that listed files it does not serve
        raise ConvertError(f"{_named(model)}revision {model.revision!r}: downloaded, but "
                           f"{', '.join(missing)} did not arrive in {folder}")
    return folder
