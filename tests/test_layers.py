"""The import layers of ``.importlinter`` hold, and project modules import each other without circles.

Both checks run on this checkout (a subprocess with the repository root first on ``sys.path``), not on whatever
copy of fxpar happens to be installed.
"""
import configparser
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.structure, pytest.mark.slow]

pytest.importorskip("importlinter")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"
PACKAGES = ("fxpar", "passes", "cost_models")

KNOWN_CIRCLES: list = []      # none: any circle among project modules fails the test

_LINT = """
import sys
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))
"""

_CIRCLES = """
import json, sys
import grimp
import networkx as nx
ignored = [tuple(s.strip() for s in line.split("->")) for line in json.loads(sys.argv[1])]
g = grimp.build_graph(*json.loads(sys.argv[2]), exclude_type_checking_imports=True)
edges = nx.DiGraph()
edges.add_nodes_from(g.modules)
for m in g.modules:
    edges.add_edges_from((m, t) for t in g.find_modules_directly_imported_by(m))
edges.remove_edges_from(ignored)
print(json.dumps({"modules": sorted(g.modules),
                  "circles": [sorted(c) for c in nx.strongly_connected_components(edges) if len(c) > 1]}))
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _contract() -> configparser.SectionProxy:
    cfg = configparser.ConfigParser(inline_comment_prefixes=None, comment_prefixes=(";", "#"))
    cfg.read(CONFIG)
    return cfg["importlinter:contract:layers"]


def _ignored() -> list:
    return [line.strip() for line in _contract()["ignore_imports"].splitlines() if line.strip()]


def test_layers_contract_holds():
    got = _run(_LINT, str(CONFIG))
    assert got.returncode == 0, f"an import runs up the layers of .importlinter:\n{got.stdout}\n{got.stderr}"


def test_contract_catches_a_back_arrow(tmp_path):
    """Without its ignore line, ClusterSpec.calibrate's import of the tools is a back-arrow the contract reports:
    the contract is live, not vacuous."""
    exception = "fxpar.cluster -> fxpar.tools.runtime_cost"
    assert exception in _ignored()
    text = CONFIG.read_text()
    stricter = tmp_path / "strict.importlinter"
    stricter.write_text("\n".join(line for line in text.splitlines() if line.strip() != exception) + "\n")
    got = _run(_LINT, str(stricter))
    assert got.returncode != 0 and "fxpar.cluster -> fxpar.tools.runtime_cost" in got.stdout, got.stdout


def test_no_import_circles():
    got = _run(_CIRCLES, json.dumps(_ignored()), json.dumps(PACKAGES))
    assert got.returncode == 0, got.stderr
    circles = [set(c) for c in json.loads(got.stdout)["circles"]]
    new = [sorted(c) for c in circles if c not in KNOWN_CIRCLES]
    assert not new, f"modules that import each other (directly or through others): {new}"


def test_every_module_has_a_layer():
    got = _run(_CIRCLES, "[]", json.dumps(PACKAGES))
    assert got.returncode == 0, got.stderr
    layers = [name.strip() for line in _contract()["layers"].splitlines()
              for name in line.replace("|", ":").split(":") if name.strip()]
    roots = set(PACKAGES)
    missing = [m for m in json.loads(got.stdout)["modules"]
               if m not in roots and not any(m == layer or m.startswith(layer + ".") for layer in layers)]
    assert not missing, f"place these modules in a layer of .importlinter: {missing}"


def test_floor_import_does_not_load_the_api():
    """``fxpar/__init__`` is lazy: a pass importing ``fxpar.meta`` or ``fxpar.plan`` loads neither the API nor the
    passes nor the cost models, and every public name still resolves."""
    code = ("import sys, fxpar.meta, fxpar.plan\n"
            "print([m for m in sys.modules if m.startswith(('fxpar.api', 'passes', 'cost_models'))])\n"
            "import fxpar\n"
            "assert all(getattr(fxpar, n) is not None for n in fxpar.__all__) and callable(fxpar.parallelize)\n"
            "assert set(fxpar.__all__) <= set(dir(fxpar))\n")
    got = _run(code)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]"
