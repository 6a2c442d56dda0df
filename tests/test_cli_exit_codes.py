"""The command line's refusals and exit codes, through the real `vit22b` entry point.

`vit22b embed`: 0 complete, 1 incomplete (every server lost, also when none is reachable at the
start), 2 bad options. `vit22b info --mesh`: refuses a mesh that `serve` would refuse.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serving import capped_cli, serve_process, serving_then_stopped
from vit22b.clients.outputs import SHARDS_DIR, open_outputs
from vit22b.clients.storage import TEMP_MARK
from vit22b.model import get_config
from vit22b.model.sharding import available_memory, bytes_per_device

ROOT = Path(__file__).resolve().parents[1]


def vit22b(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vit22b.clients.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_image(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(data / "a.png")
    return data


def test_embed_with_no_reachable_server_exits_1_naming_each(tmp_path):
    data = one_image(tmp_path)
    first, second = f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}"
    job = vit22b("embed", str(data), "--server", first, "--server", second,
                 "--output", str(tmp_path / "out"), "--quiet")
    assert job.returncode == 1, job.stderr
    assert "no server could be reached: " in job.stderr
    assert f"{first} (UNAVAILABLE: " in job.stderr and f"{second} (UNAVAILABLE: " in job.stderr
    assert "rerun the same command" in job.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_embed_with_its_terminal_or_its_disk_full(tmp_path):
    """The progress bar's first write to a full stderr failed the job before any shard, and a
    summary stdout could not take ended in a traceback; a shard's failed write (ENOSPC, EFBIG)
    named no file."""
    data = one_image(tmp_path)
    with open("/dev/full", "w") as full:
        job = subprocess.run([sys.executable, "-m", "vit22b.clients.cli", "embed", str(data),
                              "--local", "--output", str(tmp_path / "a")], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=full, text=True, timeout=300)
        assert job.returncode == 0 and job.stdout.startswith("embedded 1, "), job.stdout
        job = subprocess.run([sys.executable, "-m", "vit22b.clients.cli", "embed", str(data),
                              "--local", "--quiet", "--output", str(tmp_path / "b")], cwd=ROOT,
                             stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert job.returncode == 1, job.stderr
    assert job.stderr.strip() == ("vit22b embed: cannot write the summary to stdout: No space "
                                  "left on device (the job is complete)"), job.stderr
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["complete"]
    job = capped_cli(100, "embed", str(data), "--local", "--quiet", "--output",
                     str(tmp_path / "c"))
    assert job.returncode == 1, job.stderr
    assert re.fullmatch(rf"vit22b embed: {re.escape(str(tmp_path / 'c'))}/\S+: File too large; "
                        r"completed shards are kept: rerun the same command to resume\n",
                        job.stderr), job.stderr


def test_embed_bad_options_exit_2(tmp_path):
    job = vit22b("embed", str(one_image(tmp_path)), "--server", "127.0.0.1:1", "--local",
                 "--output", str(tmp_path / "out"))
    assert job.returncode == 2 and "exclude each other" in job.stderr
    job = vit22b("embed", str(tmp_path / "missing"), "--output", str(tmp_path / "out"))
    assert job.returncode == 2 and "missing" in job.stderr
    (tmp_path / "a-file").write_text("not a folder")
    job = vit22b("embed", str(one_image(tmp_path / "x")), "--local", "--quiet",
                 "--output", str(tmp_path / "a-file"))
    assert job.returncode == 2 and "Traceback" not in job.stderr, job.stderr
    assert "cannot be a folder of outputs: Not a directory" in job.stderr
    # checked before any model is loaded: an unknown preset is not even looked up
    job = vit22b("embed", str(tmp_path / "x" / "data"), "--local", "--model", "nope",
                 "--output", str(tmp_path / "a-file"))
    assert job.returncode == 2 and "cannot be a folder of outputs" in job.stderr, job.stderr


def test_info_refuses_a_mesh_that_cuts_through_heads():
    refused = vit22b("info", "--model", "vit-22b/14", "--mesh", "data=1,model=7")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "vit-22b/14: the mesh's model axis (7) does not divide heads (48)" in refused.stderr
    served = vit22b("info", "--model", "vit-22b/14", "--mesh", "data=1,model=8",
                    "--dtype", "bfloat16")
    assert served.returncode == 0, served.stderr
    info = json.loads(served.stdout)
    assert info["mesh"] == {"data": 1, "model": 8} and info["bytes_per_device"] > 0


def test_seeds_beyond_64_bits_and_unwritable_checkpoints_are_one_line_each(tmp_path):
    """A seed of 10^22 ended in an OverflowError deep in the initialisation (init, serve, embed,
    probe), and a checkpoint folder that cannot be made in a FileNotFoundError traceback."""
    huge = "9" * 22
    for args in (["init", "--out", str(tmp_path / "c")], ["serve"],
                 ["embed", str(one_image(tmp_path)), "--output", str(tmp_path / "o")],
                 ["probe", "linear", "--digits"]):
        done = vit22b(*args, "--seed", huge)
        assert done.returncode == 2, done.stderr
        assert f"a seed is a 64-bit signed integer, got {huge}" in done.stderr
        assert "Traceback" not in done.stderr
    done = vit22b("probe", "linear", "--digits", "--seed=-1")
    assert done.returncode == 2 and "the seed also seeds the data split" in done.stderr
    (tmp_path / "file").write_text("not a folder")
    done = vit22b("init", "--out", str(tmp_path / "file" / "ckpt"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert str(tmp_path / "file") in done.stderr


def test_a_truncated_checkpoint_is_refused_in_a_few_lines(tmp_path):
    """`vit22b serve` on a checkpoint whose weights file was cut in half: the refusal names the
    parameters and ends the output, not buried under orbax's INFO lines (one restore per
    parameter, about twenty lines each) and the tracebacks of the reads the failed restore
    abandoned (up to two thousand lines before)."""
    checkpoint = tmp_path / "c"
    made = vit22b("init", "--model", "vit-22b-tiny/16", "--out", str(checkpoint))
    assert made.returncode == 0, made.stderr
    data = max((p for p in (checkpoint / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    served = vit22b("serve", "--checkpoint", str(checkpoint), "--port", "0")
    assert served.returncode == 2
    lines = served.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if "cannot be restored" in line)
    problems = lines[start + 1 :]
    assert problems and all("stored data is unreadable, truncated or corrupt" in line
                            for line in problems)  # the refusal is the last thing printed
    assert len(lines) < 120, len(lines)  # the tiny model has 44 parameters


def test_serve_names_a_compile_cache_that_cannot_be_a_folder(tmp_path):
    """`--compile-cache` under a file ended in "[Errno 20] Not a directory: ..." with no flag
    named."""
    (tmp_path / "file").write_text("not a folder")
    cache = tmp_path / "file" / "cache"
    done = vit22b("serve", "--model", "vit-22b-tiny/16", "--compile-cache", str(cache))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (f"vit22b serve: --compile-cache {cache}: cannot create {cache}: Not a directory "
            "(give a folder, or 'off')") in done.stderr


def test_a_default_compile_cache_that_cannot_be_made_is_a_warning(tmp_path, monkeypatch):
    """A read-only home (a container's root filesystem) or a full disk under the default
    cache folder refused the start, where the same folder, once made, only warned as each
    entry failed to write. Not asked for, the cache is left off, said once; a folder given
    with --compile-cache is still refused (the test above)."""
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    proc, address = serve_process("--model", "vit-22b-tiny/16", "--mesh", "data=2,model=4")
    rest = serving_then_stopped(proc, address)
    assert proc.returncode == 0, rest
    assert (f"compilation cache off: cannot create {tmp_path / 'file' / 'vit22b'}: Not a "
            "directory (--compile-cache to choose a folder)") in proc.start_output


def cold_then_warm(tmp_path: Path, monkeypatch, command) -> None:
    """``vit22b *command(out)`` for out = tmp_path/cold, then tmp_path/warm, with `vit22b
    serve`'s default cache folder under tmp_path: the cold run writes entries there, the warm
    one compiles nothing new."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    cache = tmp_path / "home-cache" / "vit22b" / "xla"
    written = None
    for out in ("cold", "warm"):
        done = vit22b(*command(tmp_path / out), timeout=300)
        assert done.returncode == 0, done.stderr
        entries = sorted(p.name for p in cache.rglob("*-cache"))
        assert entries, "nothing was written to the compilation cache"
        written = written or entries
    assert entries == written  # the warm run compiled nothing new


def test_a_local_job_keeps_its_compiles_in_the_servers_compile_cache(tmp_path, monkeypatch):
    """A local job compiled its forwards afresh at every run (benchmarks/startup.py times it
    cold and warm). It uses `vit22b serve`'s cache folder, with the same flag; a rerun reads it
    and stores the same bits."""
    data = one_image(tmp_path)
    cold_then_warm(tmp_path, monkeypatch,
                   lambda out: ("embed", str(data), "-o", str(out), "--mesh", "data=2", "--quiet"))
    cold, warm = (tmp_path / out / "shards" / "00000.pooled.npy" for out in ("cold", "warm"))
    assert cold.read_bytes() == warm.read_bytes()
    given = tmp_path / "given"
    done = vit22b("embed", str(data), "-o", str(tmp_path / "off"), "--mesh", "data=2",
                  "--compile-cache", str(given), "--quiet")
    assert done.returncode == 0 and list(given.rglob("*-cache")), done.stderr
    done = vit22b("embed", str(data), "-o", str(tmp_path / "o2"), "--server", "127.0.0.1:1",
                  "--compile-cache", str(given))
    assert done.returncode == 2
    assert "--server and --compile-cache exclude each other (the in-process engine's" in done.stderr


def test_a_probe_keeps_its_compiles_in_the_servers_compile_cache(tmp_path, monkeypatch):
    """`vit22b probe` compiled the in-process backbone and the decoders' training steps afresh
    at every run. It uses `vit22b serve`'s cache folder too, with the same flag."""
    probe = ("probe", "depth", "--shapes-world", "16", "--world-size", "32", "--steps", "2",
             "--decoders", "linear")
    cold_then_warm(tmp_path, monkeypatch, lambda out: (*probe, "--out", str(out)))
    cold, warm = ((r["linear"], r["baselines"]) for r in
                  (json.loads((tmp_path / out / "depth.json").read_text()) for out in ("cold",
                                                                                      "warm")))
    assert cold == warm
    given = tmp_path / "a-file"
    given.write_text("")
    done = vit22b(*probe, "--out", str(tmp_path / "o2"), "--compile-cache", str(given))
    assert done.returncode == 2
    assert f"--compile-cache {given}: cannot create" in done.stderr


def test_init_keeps_its_compiles_in_the_servers_compile_cache(tmp_path, monkeypatch):
    """`vit22b init` compiled its seeded init afresh at every run (benchmarks/startup.py times
    it cold and warm); it uses `vit22b serve`'s cache folder too, with the same flag, and the
    warm run writes the same weights."""
    cold_then_warm(tmp_path, monkeypatch,
                   lambda out: ("init", "--model", "vit-22b-tiny/16", "--out", str(out)))
    cold, warm = (json.loads((tmp_path / out / "metadata.json").read_text())["fingerprint"]
                  for out in ("cold", "warm"))
    assert cold == warm
    given = tmp_path / "a-file"
    given.write_text("")
    done = vit22b("init", "--out", str(tmp_path / "o2"), "--compile-cache", str(given))
    assert done.returncode == 2 and not (tmp_path / "o2").exists()
    version = f"jax-{metadata.version('jax')}-jaxlib-{metadata.version('jaxlib')}"
    assert done.stderr.strip() == (f"vit22b init: --compile-cache {given}: cannot create "
                                   f"{given}/{version}: Not a directory (give a folder, or "
                                   "'off')"), done.stderr
    off = vit22b("init", "--out", str(tmp_path / "o3"), "--compile-cache", "off")
    assert off.returncode == 0, off.stderr


def test_a_model_larger_than_the_hosts_memory_is_refused_before_any_allocation():
    """ViT-22B's parameters on CPU devices (eight data replicas here, 331 GiB in bfloat16)
    were allocated as asked, past the host's memory (Linux overcommits: no allocation need fail
    up front). Each command that builds the weights now refuses at once, naming both sizes."""
    need = 8 * bytes_per_device(get_config("vit-22b/14"), {"data": 8, "model": 1})
    have = available_memory()
    if have is None or have >= need:
        pytest.skip(f"this host has {have} bytes available: the model fits")
    for command in (("serve", "--port", "0", "--metrics-port", "-1"),
                    ("init", "--out", "never-written"),
                    ("embed", str(ROOT / "tests"), "-o", "never-written", "--quiet")):
        done = vit22b(*command, "--model", "vit-22b/14", "--mesh", "data=8,model=1")
        assert done.returncode == 2, done.stderr[-2000:]
        line = done.stderr.strip().splitlines()[-1]
        assert re.fullmatch(
            rf"vit22b {command[0]}: vit-22b/14 does not fit this host's memory: its bfloat16 "
            rf"parameters take {need / 2**30:.1f} GiB on this process's CPU devices "
            r"\(mesh data=8,model=1; "
            r"each data replica holds a copy\) and [\d.]+ GiB is available; it needs "
            r"(fewer data replicas \(--mesh data=1\) or )?a host with more memory", line), line
        assert not (ROOT / "never-written").exists()


def test_serve_with_stdout_on_a_full_disk_serves_and_drains():
    """The status lines go to stdout, for scripts: a failed write there (a full disk, a reader
    gone) ended the start with "[Errno 28] No space left on device", or skipped the drain after
    SIGTERM. Each such line now goes to the log instead."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vit22b.clients.cli", "serve", "--model", "vit-22b-tiny/16",
             "--port", "0", "--metrics-port", "-1", "--compile-cache", "off"],
            cwd=ROOT, env=env, stdout=full, stderr=subprocess.PIPE, text=True)
    started = ""
    for line in proc.stderr:
        started += line
        if match := re.search(r"cannot write to stdout \(No space left on device\): "
                              r"vit22b serve: SERVING .* on (\S+),", line):
            break
    else:
        raise AssertionError(f"no SERVING line in the log (exit {proc.wait()}): {started}")
    rest = serving_then_stopped(proc, match[1])
    assert proc.returncode == 0, rest
    assert "vit22b serve: stopped (clean)" in rest and "Traceback" not in started + rest


def test_serve_refuses_a_compile_cache_entry_that_is_not_a_file(tmp_path):
    """JAX reads the entry of a program's key whole: a FIFO there blocked start-up for ever and
    a link to /dev/zero filled the memory (a sweep of edited cache folders). An entry that is
    not a regular file is refused before anything compiles; a folder any user may write is
    warned about (its entries are programs the server runs)."""
    cache = tmp_path / "xla"
    version = cache / f"jax-{metadata.version('jax')}-jaxlib-{metadata.version('jaxlib')}"
    version.mkdir(parents=True)
    entry = version / "jit_forward-0123abcd-cache"
    os.mkfifo(entry)
    cache.chmod(0o777)
    done = vit22b("serve", "--model", "vit-22b-tiny/16", "--compile-cache", str(cache))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (f"vit22b serve: --compile-cache {cache}: entry {entry} is a FIFO, not a regular file "
            "or a folder (remove it, or 'off')") in done.stderr
    assert f"compile cache {cache} may be written by any user" in done.stderr
    entry.unlink()
    entry.symlink_to(tmp_path / "gone")
    cache.chmod(0o755)
    done = vit22b("serve", "--model", "vit-22b-tiny/16", "--compile-cache", str(cache))
    assert done.returncode == 2 and "may be written" not in done.stderr, done.stderr
    assert f"entry {entry} cannot be read: No such file or directory (remove it, or 'off')" in \
        done.stderr


def _without(modules: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    """The CLI in a process where importing any of ``modules`` fails, as on an install
    without the extra that brings them."""
    code = (f"import sys; sys.modules.update(dict.fromkeys({modules!r}))\n"
            f"from vit22b.clients.cli import main; sys.exit(main({list(args)!r}))")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize(("missing", "argv", "says"), [
    (("jax",), ["info", "--model", "vit-22b/14"], "needs jax, which is not installed; install "
     "it with: pip install 'vit22b[model]'"),
    (("jax",), ["convert", "--from", "timm", "--input", "{data}", "--out", "{out}"],
     "pip install 'vit22b[model]'"),  # its --help answers without jax (tests/test_layout.py)
    (("jax",), ["embed", "{data}", "-o", "{out}"], "the in-process engine (--local, the "
     "default without --server) needs jax, which is not installed; install it with: "
     "pip install 'vit22b[server]'"),
    (("opentelemetry",), ["embed", "{data}", "-o", "{out}", "--local"], "pip install "
     "'vit22b[server]'"),
    (("av",), ["embed", "{data}", "-o", "{out}", "--server", "127.0.0.1:{port}", "--frames",
               "2"], "needs av, which is not installed; install it with: pip install "
     "'vit22b[video]'"),
    (("sklearn",), ["probe", "knn", "--digits", "--out", "{out}"], "needs sklearn, "
     "which is not installed; install it with: pip install 'vit22b[probes]'"),
    (("opentelemetry",), ["probe", "linear", "--digits", "--out", "{out}"], "pip install "
     "'vit22b[probes]'"),
])
def test_a_missing_extra_is_named_in_one_line(tmp_path, missing, argv, says):
    """`vit22b info`, `init`, `convert` and the local `embed` (the README's own first job) ended
    in a traceback on the base install; `embed --frames` without PyAV blamed each server."""
    data = one_image(tmp_path)
    out = tmp_path / "out"
    argv = [a.format(data=data, out=out, port=closed_port()) for a in argv]
    proc = _without(missing, *argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"vit22b {argv[0]}: {says}" or \
        proc.stderr.strip().endswith(says) and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    if argv[0] == "embed":
        assert not out.exists()  # a refused job leaves no empty output folder behind


def test_a_refused_job_removes_only_the_folders_it_made(tmp_path):
    data = one_image(tmp_path)
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    proc = _without(("jax",), "embed", str(data), "-o", str(kept))
    assert proc.returncode == 2, proc.stderr
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]  # shards/ made, then removed
    proc = _without(("jax",), "embed", str(data), "-o", str(tmp_path / "a" / "b"))
    assert proc.returncode == 2 and not (tmp_path / "a").exists()


def test_the_extras_table_follows_pyproject():
    """Each optional dependency the CLI names is one the extra it names brings."""
    from vit22b.clients.cli import _NESTED, EXTRA_OF_DEPENDENCY, extra_to_install

    requires = metadata.requires("vit22b")
    wanted: dict[str, set[str]] = {}  # extra -> distributions it lists
    for line in requires:
        name, _, marker = line.partition(";")
        found = re.search(r"extra == \"(\w+)\"", marker)
        if found:
            dist = re.split(r"[\[<>=!~ ]", name.strip())[0].lower().replace("_", "-")
            wanted.setdefault(found.group(1), set()).add(dist)
    for i, extra in enumerate(_NESTED[1:], 1):  # server brings model's, probes server's
        wanted[extra] |= wanted[_NESTED[i - 1]]
    wanted["ray"] |= wanted["storage"]

    def with_requirements(names: set[str]) -> set[str]:  # jaxlib comes with jax
        more = set(names)
        for name in names:
            try:
                lines = metadata.requires(name) or []
            except metadata.PackageNotFoundError:  # not installed here (ray on a new Python)
                continue
            more.update(re.split(r"[\[<>=!~ ;]", line)[0].lower().replace("_", "-")
                        for line in lines)
        return more

    dists = metadata.packages_distributions()
    checked = [module for module in EXTRA_OF_DEPENDENCY if module in dists]
    assert {"jax", "opentelemetry", "sklearn", "fsspec", "av"} <= set(checked)
    for module in checked:
        extra = EXTRA_OF_DEPENDENCY[module]
        names = {d.lower().replace("_", "-") for d in dists[module]}
        assert names & with_requirements(wanted[extra]), (module, extra, names)
    assert extra_to_install("embed", "vit22b.server") is None  # ours: a bug, not an extra
    assert extra_to_install("probe", "jax") == "probes"
    assert extra_to_install("serve", "av") == "video"


def _ctrl_c_job(tmp_path: Path) -> tuple[str, ...]:
    return ("embed", str(tmp_path / "data"), "-o", str(tmp_path / "out"), "--local",
            "--batch-size", "1", "--shard-size", "1", "--concurrency", "1", "--quiet")


def _embed_until(tmp_path: Path, ready, signals: int = 1,
                 after: float = 0.0) -> tuple[subprocess.Popen, str]:
    """`vit22b embed --local` of 200 images a shard each, sent ``signals`` SIGINTs ``after``
    seconds once ``ready(output)`` holds; returns the process (ended) and its stderr."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for i in range(200):
        Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(data / f"{i:03d}.png")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "vit22b.clients.cli", *_ctrl_c_job(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(after)
    for _ in range(signals):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
    _, err = proc.communicate(timeout=120)
    return proc, err


def _shards(out: Path) -> list[Path]:
    return [p for p in (out / SHARDS_DIR).glob("*") if TEMP_MARK not in p.name] \
        if (out / SHARDS_DIR).is_dir() else []


def test_embed_local_stops_at_ctrl_c_while_the_model_loads(tmp_path):
    """Python's KeyboardInterrupt landed inside JAX's load and compile: it was lost in a gc
    callback (the job ran on and exited 0) or crashed the interpreter at exit (-11). Ctrl-C is
    now a request the job acts on once the model has loaded: 130, the output folder it made
    removed (no job ran)."""
    # the output folder is made just before the model loads (for seconds: jax's import alone)
    proc, err = _embed_until(tmp_path, lambda out: out.exists(), after=0.5)
    assert proc.returncode == 130, err
    assert "vit22b embed: stopping: " in err and err.rstrip().endswith(
        "vit22b embed: interrupted; rerun the same command to resume"), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_embed_local_ctrl_c_finishes_the_batches_in_flight_and_resumes(tmp_path):
    proc, err = _embed_until(tmp_path, lambda out: bool(_shards(out)))
    assert proc.returncode == 130 and "Traceback" not in err, err
    job = vit22b(*_ctrl_c_job(tmp_path))
    assert job.returncode == 0, job.stderr
    embedded, skipped = map(int, re.match(r"embedded (\d+), skipped (\d+) ", job.stdout).groups())
    assert skipped >= 1 and embedded + skipped == 200  # what ran is kept, and not run again
    outputs = open_outputs(str(tmp_path / "out"), verify=True)
    assert sorted(outputs.ids) == [f"{i:03d}.png" for i in range(200)]


def test_embed_local_second_ctrl_c_stops_at_once(tmp_path):
    proc, err = _embed_until(tmp_path, lambda out: out.exists(), signals=2, after=0.5)
    assert proc.returncode == 130, err
    assert "Ctrl-C again to stop at once" in err and "interrupted; rerun" in err


def test_ctrl_c_in_a_command_without_a_stop_of_its_own_is_one_line_and_130(monkeypatch, capsys):
    """A real SIGINT inside a command's handler (a probe's, say) printed Python's traceback and
    the process died by the signal."""
    import types

    from vit22b.clients import cli

    module = types.ModuleType("interrupted_command")
    module.add_arguments = lambda name, parser: lambda args: signal.raise_signal(signal.SIGINT)
    monkeypatch.setitem(sys.modules, "interrupted_command", module)
    monkeypatch.setitem(cli.COMMANDS, "probe", ("interrupted_command", "a probe"))
    # Python's own handler, as an interactive shell's command gets it: a job a shell starts in
    # the background (`pytest ... &`) inherits SIGINT ignored, and the signal then does nothing
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.main(["probe"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err == "vit22b probe: interrupted\n"
