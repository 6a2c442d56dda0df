"""The inputs of `vit22b embed`: folders, globs and list files -> one sorted list of images.

Each INPUT, a local path or an fsspec URL (``s3://bucket/photos/``, ``gs://...``: storage.py), is
- a folder: every file below it, recursively (hidden files and folders skipped; a folder that
  cannot be listed ends the listing, naming it, rather than leaving its images out);
- a text file ending in .txt, .lst or .list: one path per line (blank lines and lines starting
  with '#' skipped; relative paths are relative to the list file's folder; a line may be a URL);
- anything else: a glob (``**`` recurses) or a single file.

Every image gets a stable id: its path relative to the folder when a single folder is given,
otherwise the path as written (folder argument + relative path; the glob match; the list line);
a name that is not UTF-8 has its odd bytes written ``\\xNN`` in its id (``as_text``).
The list is sorted by id and de-duplicated (a file that several INPUTs or a glob name twice, by
other spellings or through a link, is listed once: under the name that goes through no link, is
the shortest, then sorts first), so the same command always sees the
same list in the same order: shard ``k`` is positions ``k*shard_size ...`` of it, whatever was
done before. The job's identity holds where the files were read from too (``places_digest``):
another folder with the same names is another list.
Non-image files are kept: the job records them as failures with the reason, which is what a
user who pointed it at the folder needs to know. ``extensions`` narrows the walk when wanted.
The job's own output folder, when it lies below an INPUT (``vit22b embed photos -o
photos/embeddings``), holds no inputs: its files would change the list on every rerun.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import posixpath
from dataclasses import dataclass

from vit22b.model.errors import quoted

from .files import as_text, hidden
from .storage import check_url, filesystem, is_url

LIST_SUFFIXES = (".txt", ".lst", ".list")
LIST_ENCODING = "utf-8-sig"  # UTF-8, less the byte-order mark Windows editors put first


class InputListError(ValueError):
    """An INPUT that names nothing usable; the message says which and why."""


@dataclass(frozen=True, slots=True)
class InputItem:
    id: str  # stable, relative where possible; the key of the image in the outputs (text)
    path: str  # absolute path or URL read by the job (a file system's name as Python holds it)

    @property
    def shown_path(self) -> str:
        """The path as the outputs record it: text (see ``as_text``)."""
        return as_text(self.path)


def _posix(path: str) -> str:
    return os.path.normpath(path).replace(os.sep, "/")


def _unlisted(err: OSError) -> None:
    """os.walk's default skips a folder it cannot list, and every image below it with no word."""
    folder = quoted(as_text(str(err.filename)))
    raise InputListError(f"cannot list the folder {folder} below an input: "
                         f"{err.strerror or err} (its images would be left out)") from None


def _each_folder_once(top: str):
    """``os.walk`` below ``top``, links followed, each folder once (a link back up the tree is
    not walked again), hidden names left out, a folder that cannot be listed refused by name."""
    seen: set[tuple[int, int]] = set()
    for root, dirs, files in os.walk(top, onerror=_unlisted, followlinks=True):
        try:
            info = os.stat(root)
        except OSError as err:
            _unlisted(err)
        if (info.st_dev, info.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((info.st_dev, info.st_ino))
        dirs[:] = [d for d in dirs if not hidden(d)]
        yield root, dirs, [f for f in files if not hidden(f)]


def _walk(folder: str, prefix: str | None) -> list[InputItem]:
    items = []
    for root, _, files in _each_folder_once(folder):
        for name in files:
            path = os.path.join(root, name)
            rel = _posix(os.path.relpath(path, folder))
            item_id = rel if prefix is None else f"{prefix}/{rel}"
            items.append(InputItem(item_id, os.path.abspath(path)))
    return items


def _read_list(list_path: str) -> list[InputItem]:
    base = os.path.dirname(os.path.abspath(list_path))
    items = []
    # A line that is not UTF-8 names the file whose bytes it holds (a Latin-1 list of Latin-1
    # names): decoded as the file system's names are.
    with open(list_path, encoding=LIST_ENCODING, errors="surrogateescape") as f:
        for line in f:
            entry = line.strip()
            if entry and not entry.startswith("#"):
                items.append(_listed(entry, lambda e: os.path.normpath(os.path.join(base, e))))
    return items


def _recursive_glob(spec: str) -> list[str]:
    """What ``glob.glob(spec, recursive=True)`` matches, walked as a folder INPUT is
    (``_each_folder_once``): Python's glob follows links to folders, so a link back up the
    tree listed one file once per lap."""
    parts = spec.split(os.sep)
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    base, pattern = os.sep.join(parts[:fixed]), parts[fixed:]
    if fixed == 1 and not base:  # "/**/x.png"
        base = os.sep
    top = base or os.curdir
    matches = [base] if base and _matches([], pattern) else []
    for root, dirs, files in _each_folder_once(top):
        rel = [] if root == top else os.path.relpath(root, top).split(os.sep)
        for name in [*dirs, *files]:
            if _matches([*rel, name], pattern):
                matches.append(os.path.join(root, name) if base else os.path.join(*rel, name))
    return matches


def _matches(names: list[str], pattern: list[str]) -> bool:
    """A path's names against a glob's, ``**`` standing for any number of folders."""
    if not pattern:
        return not names
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_matches(names[k:], rest) for k in range(len(names) + 1))
    return bool(names) and fnmatch.fnmatchcase(names[0], head) and _matches(names[1:], rest)


def _listed(entry: str, resolve) -> InputItem:
    return InputItem(entry, entry) if is_url(entry) else InputItem(_posix(entry), resolve(entry))


def _hidden(rel: str) -> bool:
    """A name starting with '.' on the way (a store's key may hold '.' and '..' as names)."""
    return any(hidden(part) and part not in (".", "..") for part in rel.split("/"))


def _expand_url(spec: str, several: bool) -> list[InputItem]:
    """The same rules as for local INPUTs, through the URL's fsspec filesystem."""
    fs, path = filesystem(check_url(spec))

    def resolve(entry: str) -> str:  # a list line, relative to the list file's folder
        if entry.startswith(("/", "file://")):  # the list's store has no such root
            raise InputListError(f"list {spec}: the line {entry!r} names a local file; a list "
                                 "on remote storage names URLs, or keys relative to its folder")
        return fs.unstrip_protocol(posixpath.normpath(f"{posixpath.dirname(path)}/{entry}"))

    def walk(folder: str, prefix: str | None) -> list[InputItem]:
        items, base = [], folder.rstrip("/") + "/"
        for found in fs.find(folder):
            # the key as it is: a key's "..", "." or "//" are part of its name on a store
            rel = found[len(base):] if found.startswith(base) else posixpath.basename(found)
            if not _hidden(rel) and not found.endswith("/"):  # "a/": a folder's marker
                items.append(InputItem(rel if prefix is None else f"{prefix}/{rel}",
                                       fs.unstrip_protocol(found)))
        return items

    try:
        if fs.isdir(path):
            return walk(path, spec.rstrip("/") if several else None)
        if fs.isfile(path):
            if not spec.lower().endswith(LIST_SUFFIXES):
                return [InputItem(spec, spec)]
            lines = fs.cat_file(path).decode(LIST_ENCODING, "surrogateescape").splitlines()
            return [_listed(line.strip(), resolve) for line in lines
                    if line.strip() and not line.strip().startswith("#")]
        if not glob.has_magic(spec):
            fs.info(path)  # isdir and isfile say False for a store they cannot reach: say why
            raise FileNotFoundError(path)
        # hidden names match only a pattern that names them, as Python's glob does locally
        explicit = any(part.startswith(".") for part in path.split("/"))
        matches = sorted(m for m in fs.glob(path) if explicit or not _hidden(m))
    except (FileNotFoundError, PermissionError) as err:  # no such key or bucket, access denied
        if isinstance(err, FileNotFoundError) and not glob.has_magic(spec):
            raise InputListError(
                f"input {spec!r} does not exist (want a folder, a glob or a list file)") from None
        raise InputListError(f"input {spec!r}: {err}") from None
    if not matches:
        raise InputListError(f"input glob {spec!r} matches nothing")
    items = []
    for match in matches:
        url = fs.unstrip_protocol(match)
        items.extend(walk(match, url) if fs.isdir(match) else [InputItem(url, url)])
    return items


def _same_file(path: str) -> str:
    """One spelling per file: the real path of a local one (a NUL byte: as given, that
    input's failure later), a URL as its filesystem writes it (``memory://a`` is
    ``memory:///a``)."""
    if is_url(path):
        fs, inner = filesystem(path)
        return fs.unstrip_protocol(inner)
    return path if "\0" in path else os.path.realpath(path)


def _expand(spec: str, several: bool) -> list[InputItem]:
    if is_url(spec):
        return _expand_url(spec, several)
    spec = spec.removeprefix("file://")
    if os.path.isdir(spec):
        return _walk(spec, _posix(spec) if several else None)
    if os.path.isfile(spec):
        if spec.lower().endswith(LIST_SUFFIXES):
            return _read_list(spec)
        return [InputItem(_posix(spec), os.path.abspath(spec))]
    if not glob.has_magic(spec):
        raise InputListError(
            f"input {spec!r} does not exist (want a folder, a glob or a list file)"
        )
    matches = sorted(_recursive_glob(spec) if "**" in spec else glob.glob(spec))
    if not matches:
        raise InputListError(f"input glob {spec!r} matches nothing")
    items = []
    for match in matches:
        if os.path.isdir(match):
            items.extend(_walk(match, _posix(match)))
        else:
            items.append(InputItem(_posix(match), os.path.abspath(match)))
    return items


def _folder(spec: str) -> str:
    """A folder as the items below it spell their paths, with a trailing slash."""
    if is_url(spec):
        fs, path = filesystem(spec)
        return fs.unstrip_protocol(path).rstrip("/") + "/"
    return os.path.join(os.path.abspath(spec.removeprefix("file://")), "")


def _below(output: str | None, specs: list[str]):
    """item path -> whether it lies in the folder ``output`` (a local path or a URL), as the
    items of ``specs`` spell it: an INPUT reached through a link (``photos-link`` for
    ``photos``, with ``-o photos/emb``) reads the output as ``photos-link/emb``."""
    if output is None:
        return lambda path: False
    roots = {_folder(output)}
    if not is_url(output):
        real_out = os.path.realpath(output.removeprefix("file://"))
        roots.add(os.path.join(real_out, ""))
        for spec in (s.removeprefix("file://") for s in specs if not is_url(s)):
            real = os.path.realpath(spec)
            if os.path.join(real_out, "").startswith(os.path.join(real, "")):
                roots.add(os.path.join(os.path.abspath(spec), os.path.relpath(real_out, real),
                                       ""))
    return lambda path: path.startswith(tuple(roots))


def enumerate_inputs(specs: list[str], extensions: tuple[str, ...] = (),
                     output: str | None = None) -> list[InputItem]:
    """All images named by ``specs``, sorted by id, each once. ``extensions``: keep only these;
    ``output``: the job's output folder, whose files are never inputs."""
    if not specs:
        raise InputListError("no INPUT given")
    several = len(specs) > 1
    by_id: dict[str, InputItem] = {}
    # several INPUTs (or a glob through links) may name one file twice: it is listed once,
    # under the name that goes through no link, is the shortest, then sorts first
    by_file: dict[str, tuple[tuple, InputItem]] = {}
    wanted = tuple("." + e.lower().lstrip(".") for e in extensions)
    in_output = _below(output, specs)
    for spec in specs:
        if output is not None and in_output(_folder(spec)):
            raise InputListError(f"input {spec!r} lies in the output folder {output!r}, whose "
                                 "files are no inputs: choose an --output outside the inputs "
                                 "or below them")
        for item in _expand(spec, several):
            if (wanted and not item.path.lower().endswith(wanted)) or in_output(item.path):
                continue
            item = InputItem(as_text(item.id), item.path)
            if several or glob.has_magic(spec) or spec.lower().endswith(LIST_SUFFIXES):
                # "photos" and "/abs/photos", a folder and a list of its files, a list naming
                # a file twice, a glob through a link to a folder it also reaches: once
                real = _same_file(item.path)
                rank = (real != item.path, item.id.count("/"), item.id)
                first = by_file.get(real)
                if first is not None:
                    if rank >= first[0]:
                        continue
                    del by_id[first[1].id]  # the better name wins, whatever the order given
                by_file[real] = (rank, item)
            seen = by_id.setdefault(item.id, item)
            if seen.path != item.path:
                raise InputListError(
                    f"two different files share the id {item.id!r}: {seen.path} and {item.path}"
                )
    if not by_id:
        raise InputListError(f"no files found in {' '.join(specs)}")
    return [by_id[key] for key in sorted(by_id)]


def ids_digest(items: list[InputItem]) -> str:
    """sha256 of the ordered ids: the identity of an input list (or of one shard's slice)."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.id.encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()


def places_digest(items: list[InputItem]) -> str:
    """sha256 of where the ordered inputs are read from: a folder's ids are relative to it,
    so another folder of the same names has the same ids, and a resume from it would mix the
    two folders' images under one list."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.path.encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()


def shard_slices(count: int, shard_size: int) -> list[range]:
    """Shard k holds positions [k*shard_size, (k+1)*shard_size) of the sorted input list."""
    return [range(start, min(start + shard_size, count)) for start in range(0, count, shard_size)]
