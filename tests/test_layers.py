"""The layering rule, read from the source: a module imports only from its own layer or
from layers below it, never from a peer beside it; and the public API stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
    assert violations("journal", "journal/x.py", "import kvledger.worker.placement\n")
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


def test_importing_the_api_loads_no_heavy_dependency():
    code = ("import sys, kvledger\n"
            "from kvledger import Ledger\n"
            "heavy = ('torch', 'psycopg', 'prometheus_client', 'rich', 'structlog', 'numpy', 'zmq', 'transformers')\n"
            "print(','.join(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == ""


def test_one_top_level_name_is_installed():
    """The layers are importable only under kvledger (run outside the repository root,
    whose folders would otherwise be found from the current directory)."""
    code = ("import importlib.util as u\n"
            "print([n for n in ('engine', 'journal', 'schemas', 'replay', 'migrations', 'worker',"
            " 'telemetry', 'recovery', 'adapters') if u.find_spec(n) is not None])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "[]"
