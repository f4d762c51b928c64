"""The layering rule, read from the source: a module imports only from its own layer or
from layers below it, never from a peer beside it; and the public API stays light."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folder at the repository root -> rank. Equal ranks are peers: neither imports the other.
RANKS = {"schemas": 0, "journal": 1, "migrations": 2, "engine": 2, "worker": 3, "replay": 3,
         "telemetry": 4, "adapters": 4, "recovery": 5, "kvledger": 6}


def layer_of(module: str) -> str | None:
    """The layer a `kvledger...` module name belongs to (None: not ours)."""
    parts = module.split(".")
    if parts[0] != "kvledger":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else "kvledger"


def imports(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kvledger":  # `from kvledger import engine`: the names are modules
                found += [(node.lineno, f"kvledger.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def violations(layer: str, path: str, source: str) -> list[str]:
    out = []
    for line, module in imports(source):
        target = layer_of(module)
        if target is None or target == layer:
            continue
        if RANKS[target] >= RANKS[layer]:
            kind = "a peer" if RANKS[target] == RANKS[layer] else "a higher layer"
            out.append(f"{path}:{line}: {layer} imports {module} ({kind}: {target})")
    return out


def test_no_module_imports_a_layer_above_or_beside_it():
    found = []
    for layer in RANKS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            found += violations(layer, str(path.relative_to(ROOT)), path.read_text())
    assert found == []


def test_the_rule_catches_a_wrong_import():
    """What the rule reads: each of these would be refused in that layer's folder."""
    assert violations("schemas", "schemas/x.py", "from kvledger.engine.state import HandleState\n")
    assert violations("journal", "journal/x.py", "import kvledger.worker.serving\n")
    assert violations("engine", "engine/x.py", "def f():\n    from kvledger.worker import model\n")
    assert violations("replay", "replay/x.py", "from kvledger.worker.serving import Worker\n")  # a peer
    assert violations("worker", "worker/x.py", "from kvledger import Ledger\n")
    assert violations("adapters", "adapters/x.py", "from kvledger.ledger import Ledger\n")  # the facade is above
    assert violations("adapters", "adapters/x.py", "from kvledger.telemetry import metrics\n")  # a peer
    assert not violations("adapters", "adapters/x.py", "from kvledger.worker.loading import DTYPE_NAMES\n"
                                                       "from kvledger.replay import verify\n")
    assert not violations("kvledger", "kvledger/hf.py", "from kvledger.adapters.hf import journaled_generate\n")
    assert not violations("worker", "worker/x.py", "from kvledger.engine import commands\n"
                                                   "from kvledger.schemas import events\n")


# -- the journal's port: what engine/ and replay/ may see of the journal -----------------

# The journal modules engine/ and replay/ may import: the port, the values it takes and
# gives, the package's entry points (opening a journal) and the process's machine tuning.
# Never how a backend stores things (records, step rows, blocks, id keys, SQL).
PORT = {
    "kvledger.journal",  # the package: open_journal, Journal, Operation, ...
    "kvledger.journal.port",
    "kvledger.journal.contract",
    "kvledger.journal.tuning",
}
# Imports of journal internals that exist today and are to go (issue 45: the decode batch
# moves the step encoding out of the engine and replay). This list may only shrink: an
# entry that no longer matches an import fails test_the_port_allowlist_is_not_stale.
ALLOWED: set[tuple[str, str]] = set()


def journal_imports(source: str) -> set[str]:
    """The kvledger.journal modules a source imports (anywhere: in a function, under
    TYPE_CHECKING), a `from kvledger.journal import steps` read as the module it names."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "kvledger.journal":
                names = [f"kvledger.journal.{a.name}" if (ROOT / "journal" / f"{a.name}.py").exists()
                         else node.module for a in node.names]
        else:
            continue
        found |= {n for n in names if n == "kvledger.journal" or n.startswith("kvledger.journal.")}
    return found


def port_violations(path: str, source: str) -> set[tuple[str, str]]:
    return {(path, m) for m in journal_imports(source) if m not in PORT}


def _engine_and_replay_violations() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for layer in ("engine", "replay"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            found |= port_violations(str(path.relative_to(ROOT)), path.read_text())
    return found


def test_engine_and_replay_import_only_the_journal_port():
    assert _engine_and_replay_violations() - ALLOWED == set()


def test_the_port_allowlist_is_not_stale():
    """An allowlisted import that is gone must leave the list, so it only shrinks."""
    assert ALLOWED - _engine_and_replay_violations() == set()


def test_the_port_rule_catches_an_internal_import():
    assert port_violations("engine/x.py", "from kvledger.journal.records import decode_record\n")
    assert port_violations("replay/x.py", "def f():\n    from kvledger.journal import steps\n")
    assert port_violations("replay/x.py", "import kvledger.journal.blocks\n")
    assert port_violations("engine/x.py", "if TYPE_CHECKING:\n    from kvledger.journal.sql import SqlJournal\n")
    assert not port_violations("engine/x.py", "from kvledger.journal.port import Journal\n"
                                              "from kvledger.journal.contract import Operation\n"
                                              "from kvledger.journal import open_journal, tuning\n")


def test_importing_the_api_loads_no_heavy_dependency():
    code = ("import sys, kvledger\n"
            "from kvledger import Ledger\n"
            "heavy = ('torch', 'psycopg', 'prometheus_client', 'rich', 'structlog', 'numpy', 'zmq', 'transformers')\n"
            "print(','.join(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == ""


# The packages whose names load when first used (kvledger.schemas.lazy).
LAZY_PACKAGES = ("kvledger", "kvledger.journal", "kvledger.replay")


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_a_lazy_package_serves_every_name_it_declares_and_no_other(package):
    """`__all__`, the TYPE_CHECKING imports (what mypy and readers see) and the names the
    package's `__getattr__` serves are one list; each name is the object its module defines."""
    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text())
    typed = {alias.asname or alias.name: node.module for block in ast.walk(tree) if isinstance(block, ast.If)
             for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert set(typed) == set(module.__all__)
    for name, source in typed.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name), name
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018 - the attribute access is the test


def test_the_command_line_parser_and_help_load_no_backend():
    """`kvledger --help` and an argument refused before any work load neither the database
    layer nor the projector's arrays, nor structlog: they need none of them."""
    code = ("import contextlib, io, sys\n"
            "from kvledger.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['--help'])\n"
            "with contextlib.redirect_stderr(io.StringIO()):\n"
            "    assert main(['demo', '--requests', '0']) == 2\n"
            "heavy = ('sqlalchemy', 'alembic', 'numpy', 'torch', 'psycopg', 'structlog', 'rich')\n"
            "print(','.join(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "", out.stdout


def test_the_modules_named_to_preload_exist():
    """A forkserver preload or a zygote's warm-up skips, or fails on, a name that is not an
    installed module; the racers' list once named three such, and every racer imported them
    itself. Run outside the repository root, whose folders would be found from there."""
    from kvledger.journal.backends import BACKENDS

    import crash_workers

    names = [*crash_workers.PRELOAD, *(m for b in BACKENDS for m in b.modules)]
    code = f"import importlib.util as u\nprint([n for n in {names!r} if u.find_spec(n) is None])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "[]"


def test_one_top_level_name_is_installed():
    """The layers are importable only under kvledger (run outside the repository root,
    whose folders would otherwise be found from the current directory)."""
    code = ("import importlib.util as u\n"
            "print([n for n in ('engine', 'journal', 'schemas', 'replay', 'migrations', 'worker',"
            " 'telemetry', 'recovery', 'adapters') if u.find_spec(n) is not None])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "[]"


# -- the light core: `pip install kvledger` without torch, safetensors or psycopg ----------

EXTRA_MODULES = ("torch", "safetensors", "psycopg", "transformers")
# Run first in a child: the extras' modules are absent, as in a bare `pip install kvledger`
# (CI's light venv proves the same with nothing installed; here the test venv has them all).
ABSENT = f"""
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRA_MODULES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""


def _light(code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", ABSENT + code], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_the_core_extras_are_declared_apart():

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for heavy in ("torch", "safetensors", "psycopg", "transformers"):
        assert heavy not in core
    assert "pyzmq" in core  # kv-events record/serve are core commands
    extras = project["optional-dependencies"]
    assert {"worker", "postgres", "hf", "kv-events", "dev", "bench", "plot"} <= set(extras)
    assert any(d.startswith("torch") for d in extras["worker"])
    assert any(d.startswith("psycopg[binary]") for d in extras["postgres"])


def test_the_core_commands_run_without_any_extra(tmp_path):
    """record (from a real publisher), replay, verify, reconcile, export/import, init and
    schema in a process where torch, safetensors, psycopg and transformers cannot be
    imported: each exits 0 and none of them is in sys.modules afterwards."""
    from kv_publisher import Publisher, Workload

    pub = Publisher("vllm")
    w = Workload(3)
    try:
        for _ in range(40):  # before the recorder starts: it asks the replay socket for them
            pub.publish(w.batch())
        (tmp_path / "empty.jsonl").write_text("")
        code = f"""
import json, sys
from kvledger.cli import main
db = "sqlite:///kv.db"
runs = [["init", "--db", db], ["schema", "--compact"],
        ["kv-events", "record", "--endpoint", "{pub.endpoint}", "--replay-endpoint", "{pub.replay_endpoint}",
         "--topic", "kv", "--idle-exit", "1", "--db", db, "--json"],
        ["replay", "--db", db, "--json"], ["verify", "--db", db, "--json"],
        ["export", "--db", db, "--out", "audit.jsonl"], ["import", "--db", "sqlite:///copy.db", "audit.jsonl"],
        ["verify", "--db", "sqlite:///copy.db"], ["reconcile", "--db", db, "--telemetry", "empty.jsonl"]]
codes = [main(argv) for argv in runs]
print(json.dumps({{"codes": codes, "loaded": [m for m in {EXTRA_MODULES!r} if m in sys.modules]}}))
"""
        out = _light(code, tmp_path)
    finally:
        pub.close()
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"codes": [0] * 9, "loaded": []}, out.stderr
    exported = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert sum('"kv_events_batch"' in line for line in exported) == 40


def test_a_command_that_needs_a_missing_extra_names_it(tmp_path):
    """One coded line naming the extra (exit 2), never a traceback, and no journal left behind."""
    cases = [(["demo", "--requests", "8"], "kvledger[worker]"),
             (["generate", "--prompt-ids", "1,2,3"], "kvledger[worker]"),
             (["crash-test", "--trials", "1", "--db", "sqlite:///crash.db"], "kvledger[worker]"),
             (["replay", "--db", "postgresql://kv@127.0.0.1:1/kv"], "kvledger[postgres]"),
             (["init", "--db", "postgresql+psycopg://kv@127.0.0.1:1/kv"], "kvledger[postgres]")]
    for argv, extra in cases:
        out = _light(f"import sys\nfrom kvledger.cli import main\nsys.exit(main({argv!r}))", tmp_path)
        assert out.returncode == 2, (argv, out.stderr)
        lines = out.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("INVALID_ARGUMENT: "), (argv, out.stderr)
        assert f"pip install '{extra}'" in lines[0]
        assert out.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no database created by a refused command
