"""The direction of imports: the vocabulary is jax-free, model/ stands alone, and the clients and
probes reach the server only through the facade, from the job's local backend."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("model", "server", "clients", "probes")
# The allowed edges from clients/ or probes/ into server/: the job's --local backend and the
# probes' in-process features run the server's own facade (LocalInfer), in a process given the
# server's XLA:CPU settings before jax starts (cpu_devices, jax-free).
ALLOWED_INTO_SERVER = {("clients/embed_local.py", "vit22b.server.engine"),
                       ("clients/embed_local.py", "vit22b.server.infer"),
                       ("clients/embed_local.py", "vit22b.server.cpu_devices")}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            package = path.parent.name
            found.add(f"vit22b.{package}.{node.module or ''}".rstrip("."))
    return found


def edges() -> list[tuple[str, str]]:
    return [
        (f"{folder}/{path.name}", name)
        for folder in FOLDERS
        for path in sorted((ROOT / folder).glob("*.py"))
        for name in imports(path)
        if name.startswith("vit22b.")
    ]


def test_model_imports_nothing_of_the_server_clients_or_probes():
    bad = [(f, n) for f, n in edges() if f.startswith("model/")
           and n.split(".")[1] in ("server", "clients", "probes")]
    assert not bad


def test_clients_and_probes_reach_the_server_only_through_the_facade():
    into_server = {(f, n) for f, n in edges()
                   if f.startswith(("clients/", "probes/")) and n.startswith("vit22b.server")}
    assert into_server == ALLOWED_INTO_SERVER


def test_no_cycles_between_folders():
    graph: dict[str, set[str]] = {}
    for f, n in edges():
        a, b = f.split("/")[0], n.split(".")[1]
        if a != b and b in FOLDERS:
            graph.setdefault(a, set()).add(b)
    # server -> clients exists only for the settings helper; clients -> server only via the
    # local backend: that pair is the job's one in-process edge, checked by file above
    for a, targets in graph.items():
        for b in targets:
            if a in graph.get(b, set()) and {a, b} != {"server", "clients"}:
                raise AssertionError(f"{a} and {b} import each other")


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_vocabulary_and_the_client_import_no_jax_and_no_server():
    # nor pillow-heif: the contract registers it at its first HEIC, so an SDK user's own
    # pillow-heif settings stay theirs
    code = (
        "import sys\n"
        "import vit22b.clients, vit22b.clients.client, vit22b.clients.embed\n"
        "from vit22b.clients import FeatureClient\n"
        "from vit22b.model import ViTConfig, OutputRequest, get_config\n"
        "from vit22b.model import pixels, features, identity, errors, outputs\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'orbax',"
        " 'pillow_heif')"
        " or m.startswith('vit22b.server')))\n"
    )
    assert _fresh(code).strip() == "[]"


def test_vit22b_models_runs_without_jax():
    code = (
        "import sys, contextlib, io\n"
        "from vit22b.clients.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    code = main(['models'])\n"
        "assert code in (0, None), code\n"
        "assert 'vit-22b/14' in out.getvalue()\n"
        "print('jax' in sys.modules)\n"
    )
    assert _fresh(code).strip() == "False"


def test_every_commands_help_and_a_bad_flag_answer_without_jax():
    # jax's import takes 3-5 s: `--help` and a flag argparse refuses answer before it
    code = (
        "import sys, contextlib, io\n"
        "from vit22b.clients.cli import COMMANDS, main\n"
        "for name in COMMANDS:\n"
        "    for flag, code in (('--help', 0), ('--no-such-flag', 2)):\n"
        "        with contextlib.redirect_stdout(io.StringIO()) as out, \\\n"
        "                contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "            try:\n"
        "                main([name, flag])\n"
        "            except SystemExit as stop:\n"
        "                assert stop.code == code, (name, flag, stop.code, err.getvalue())\n"
        "            else:\n"
        "                raise AssertionError((name, flag, 'did not stop'))\n"
        "        assert f'vit22b {name}' in (out.getvalue() + err.getvalue()), (name, flag)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'orbax'}))\n"
    )
    assert _fresh(code).strip() == "[]"
