"""What ``pip install .`` ships is the whole library, and CI's tests use the installed copy.

Always: the find rule in pyproject.toml names every directory of fxpar/, passes/ and cost_models/ that holds
code, and child processes (``python script.py``, ``python -c``, spawned ranks) import the same fxpar as the
test process. With ``FXPAR_EXPECT_INSTALLED=1`` (set by ``.ci/run``, which runs the tests against the built
wheel): every package comes from site-packages, not from a checkout, and the installed packages hold every
source file of the checkout named by ``FXPAR_SOURCE_DIR``.
"""
import importlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fxpar.runtime.launch import start_context

pytestmark = pytest.mark.structure

ROOT = Path(__file__).resolve().parent.parent
TOP_PACKAGES = ("fxpar", "passes", "cost_models")
MODULES = ("fxpar", "passes", "passes.sharding", "cost_models")
EXPECT_INSTALLED = os.environ.get("FXPAR_EXPECT_INSTALLED") == "1"
SOURCE = Path(os.environ.get("FXPAR_SOURCE_DIR") or ROOT).resolve()

installed_only = pytest.mark.skipif(not EXPECT_INSTALLED, reason="FXPAR_EXPECT_INSTALLED=1 is set by .ci/run only")


def _where() -> dict:
    """Where each of MODULES is imported from, in this process."""
    return {name: str(Path(importlib.import_module(name).__file__).resolve()) for name in MODULES}


def _code_dirs(root: Path) -> dict:
    """Dotted name -> names of the .py files, for every directory under the top packages that holds any."""
    out = {}
    for top in TOP_PACKAGES:
        for d in [root / top, *(p for p in (root / top).rglob("*") if p.is_dir())]:
            files = {p.name for p in d.glob("*.py")}
            if files and "__pycache__" not in d.parts:
                out[".".join(d.relative_to(root).parts)] = files
    return out


def test_find_rule_in_pyproject_names_every_package_directory():
    tomllib = pytest.importorskip("tomllib")
    setuptools = pytest.importorskip("setuptools")
    config = tomllib.loads((SOURCE / "pyproject.toml").read_text())["tool"]["setuptools"]
    if isinstance(config.get("packages"), list):          # a list by hand: what it names is what ships
        found = set(config["packages"])
    else:
        rule = config["packages"]["find"]
        finder = setuptools.find_namespace_packages if rule.get("namespaces", True) else setuptools.find_packages
        found = set(finder(where=str(SOURCE / rule.get("where", ["."])[0]), include=rule.get("include", ["*"]),
                           exclude=rule.get("exclude", [])))
    code = set(_code_dirs(SOURCE))
    assert "passes.sharding" in code
    missing = sorted(code - found)
    assert not missing, (f"the packages pyproject.toml ships leave out {missing}; the installed library would fail to "
                         f"import them (a package directory needs an __init__.py)")
    assert all(name.split(".")[0] in TOP_PACKAGES for name in found), f"the wheel would ship {sorted(found)}"


def _spawned_where(queue):
    queue.put(_where())


@pytest.mark.slow
def test_child_processes_import_the_same_packages_as_the_tests(tmp_path):
    """The ways tests start Python again: a script that puts the checkout on sys.path first (as the examples
    do) run from the checkout, ``python -c`` from the checkout (which puts the working directory first), and a
    child of the context LocalCluster starts ranks in (``start_context()``: a forkserver that preloads torch and
    fxpar, or spawn), which inherits sys.path."""
    here = _where()
    probe = ("import importlib, json\nfrom pathlib import Path\n"
             f"print(json.dumps({{n: str(Path(importlib.import_module(n).__file__).resolve()) for n in {MODULES!r}}}))\n")
    script = tmp_path / "probe.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + probe)
    for argv in ([sys.executable, str(script)], [sys.executable, "-c", probe]):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout) == here, argv[1:]
    ctx = start_context()
    queue = ctx.Queue()
    child = ctx.Process(target=_spawned_where, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=120) == here
    finally:
        child.join(30)
    assert child.exitcode == 0


def _site_dirs() -> list:
    paths = sysconfig.get_paths()
    return sorted({str(Path(paths[k]).resolve()) for k in ("purelib", "platlib")})


@installed_only
def test_packages_come_from_site_packages_not_a_checkout():
    sites = _site_dirs()
    for name, path in _where().items():
        assert any(path.startswith(s + os.sep) for s in sites), f"{name} imported from {path}, not from {sites}"
        for tree in {ROOT, SOURCE}:
            assert not path.startswith(str(tree) + os.sep), f"{name} imported from the checkout {tree}: {path}"


@installed_only
def test_installed_packages_hold_every_source_file():
    site = Path(importlib.import_module("fxpar").__file__).resolve().parent.parent
    source, installed = _code_dirs(SOURCE), _code_dirs(site)
    assert "passes.sharding" in source
    for name, files in source.items():
        assert files <= installed.get(name, set()), (f"the installed package {name} lacks "
                                                     f"{sorted(files - installed.get(name, set()))}")
