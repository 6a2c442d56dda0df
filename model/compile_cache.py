"""JAX's persistent compilation cache, as every command that compiles uses it: `vit22b serve`,
local jobs, the probes and `vit22b init` (``--compile-cache DIR|off``, one folder shared safely
by processes). Importing this module imports no jax: the commands' flags read the default
before jax is loaded."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import warnings

from .errors import odd_entry

log = logging.getLogger(__name__)

COMPILE_CACHE_HELP = ("JAX's persistent compilation cache (a folder per jax version; shared "
                      "safely between processes); 'off' compiles afresh at every start")
# what the commands that compile for themselves (local jobs, probes, init) say of their default
COMPILE_CACHE_DEFAULT_HELP = ("default: vit22b serve's, $XDG_CACHE_HOME/vit22b/xla, else "
                              "~/.cache/vit22b/xla")


def default_compile_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.join(base, "vit22b", "xla")


def use_compile_cache(directory: str | None) -> None:
    """`--compile-cache` of every command that compiles: ``directory``, or 'off' (none
    from now on); None leaves JAX's cache as this process has it. The default folder, when it
    cannot be made (a read-only home, as a container's), leaves the cache off with a warning:
    it costs compiles, not the start; a folder given is refused (ValueError naming the flag)."""
    if directory == "off":
        _switch_compile_cache(None)
        return
    if not directory:
        return
    try:
        log.info("compilation cache: %s", enable_compile_cache(directory))
    except OSError as err:
        problem = f"cannot create {err.filename}: {err.strerror}"
        if directory != default_compile_cache():
            raise ValueError(f"--compile-cache {directory}: {problem} (give a folder, or "
                             "'off')") from None
        log.warning("compilation cache off: %s (--compile-cache to choose a folder)", problem)
    except ValueError as err:
        raise ValueError(f"--compile-cache {directory}: {err} (remove it, or 'off')") from None


def enable_compile_cache(directory: str) -> str:
    """JAX's persistent compilation cache under ``directory``, in a folder per jax/jaxlib
    version; returns that folder. JAX keys each entry by the program, the compile options
    (the folder's path among them) and the devices, and stores it zlib-compressed: an entry
    read while another process writes it, or damaged since, fails zlib's check and is compiled
    afresh (a warning), so processes may share the folder; such an entry is then removed, so
    that the program compiled afresh is written in its place. The version folder keeps a cache
    written by another install from being read at all."""
    import jax
    import jaxlib

    folder = os.path.join(os.path.expanduser(directory), f"jax-{jax.__version__}-jaxlib-"
                          f"{jaxlib.__version__}")
    os.makedirs(folder, exist_ok=True)
    _check_cache_folder(folder)
    _switch_compile_cache(folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _remove_unreadable_when_warned()
    return folder


def _switch_compile_cache(folder: str | None) -> None:
    """JAX opens its cache once per process, at the first compile after a folder is set, and
    keeps it: a second engine built with another folder (or 'off') wrote its programs into the
    first one's. Closing JAX's cache makes the next compile open ``folder``."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir != folder:
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", folder)


def _check_cache_folder(folder: str) -> None:
    """Refuse entries that are not regular files (JAX reads an entry whole when its key comes
    up: a FIFO blocked start-up for ever, a link to /dev/zero filled the memory), warn when
    any user may write the folder (its entries are compiled programs this process runs) and
    remove empty entries."""
    for path in (folder, os.path.dirname(folder)):
        if os.stat(path).st_mode & stat.S_IWOTH:
            log.warning("compile cache %s may be written by any user: its entries are "
                        "compiled programs this process loads and runs", path)
            break
    problem = odd_entry(folder)  # a dangling link too: JAX would write through it
    if problem:
        raise ValueError(f"entry {problem}")
    # JAX writes an entry in place and never replaces one: an entry a full disk left empty
    # would fail to load (and compile afresh) at every start. One cut short is found only by
    # reading it whole: _remove_unreadable_when_warned does that when JAX could not read one.
    for entry in os.scandir(folder):
        if entry.name.endswith("-cache") and entry.is_file(follow_symlinks=False) and \
                entry.stat(follow_symlinks=False).st_size == 0:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                log.info("compile cache: removed the empty entry %s", entry.name)


_UNREADABLE_ENTRY = "Error reading persistent compilation cache entry"  # JAX's warning


def _remove_unreadable_when_warned() -> None:
    """When JAX warns that it could not read an entry (one cut short by a process killed while
    writing it, or damaged since), remove the cache's entries that no longer decompress.
    JAX compiles that program afresh, and writes it only where no entry is: without this, the
    damaged entry cost a compile at every start (minutes for ViT-22B). The check reads every
    entry, so it runs only after such a warning. An entry another process is writing at that
    moment may be removed too: it is compiled afresh at a later start."""
    shown = warnings.showwarning
    if getattr(shown, "removes_unreadable_entries", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        import jax  # loaded long before: only compiles warn this

        folder = jax.config.jax_compilation_cache_dir
        if folder and str(message).startswith(_UNREADABLE_ENTRY):
            _remove_unreadable_entries(folder)
        shown(message, category, filename, lineno, file, line)

    showwarning.removes_unreadable_entries = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


def _remove_unreadable_entries(folder: str) -> None:
    from jax._src.compilation_cache import decompress_executable  # JAX's own codec (zlib, zstd)

    for entry in os.scandir(folder):
        if not (entry.name.endswith("-cache") and entry.is_file(follow_symlinks=False)):
            continue
        try:
            with open(entry.path, "rb") as f:
                decompress_executable(f.read())
        except OSError:
            continue  # gone, or unreadable to this user: JAX cannot write it either
        except Exception as err:  # noqa: BLE001 - each codec raises its own error type
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                log.warning("compile cache: removed the unreadable entry %s (%s)", entry.name,
                            err)
