import math
from pathlib import Path

import pytest
import torch

import fxpar

# node ids of the tests marked slow by their measured time (the file says how they were measured)
SLOW_BY_TIME = Path(__file__).with_name("slow_by_time.txt")
# each test file's worker seconds in a full run (the file says how they were measured): the heaviest run first
FILE_SECONDS = Path(__file__).with_name("file_seconds.txt")


class _Clusters:
    """LocalClusters shared by every test of the session (a gloo group costs 1-3 s to start)."""

    def __init__(self):
        self._by_size = {}

    def get(self, n: int) -> fxpar.LocalCluster:
        lc = self._by_size.get(n)
        if lc is None or not lc.alive:
            lc = self._by_size[n] = fxpar.LocalCluster(n)
        return lc

    def close(self):
        for lc in self._by_size.values():
            lc.close()


@pytest.fixture(scope="session")
def clusters():
    c = _Clusters()
    yield c
    c.close()


@pytest.fixture(scope="module", autouse=True)
def _shared_captures(request):
    """A test module's builds of models made alike trace their training step once (``fxpar.capture.shared_captures``
    with ``across_models=True``: the later ones get copies). A module that tests capture itself, or changes what a
    trace reads between its tests, sets ``SHARED_CAPTURES = False``."""
    if not getattr(request.module, "SHARED_CAPTURES", True):
        yield None
        return
    from fxpar.capture import shared_captures
    with shared_captures(across_models=True) as shared:
        yield shared


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


TIERS = ("structure", "numerics", "cost")


def _slow_by_time() -> set:
    lines = SLOW_BY_TIME.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)        # before `-m` deselects by mark
def pytest_collection_modifyitems(config, items):
    """Every test belongs to one tier (tests/README.md): say which ones carry none or several. The tests listed in
    slow_by_time.txt get the `slow` mark."""
    slow = _slow_by_time()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    files = {item.nodeid.split("::")[0] for item in items}
    stale = sorted(n for n in slow - {item.nodeid for item in items} if n.split("::")[0] in files)
    if stale and not any("::" in a for a in config.args):       # whole files collected: a listed test is gone
        config.issue_config_time_warning(pytest.PytestWarning(
            f"{len(stale)} test(s) in tests/{SLOW_BY_TIME.name} were not collected, e.g. {stale[0]}: rename or drop "
            "them there"), stacklevel=2)
    wrong = [item.nodeid for item in items if sum(item.get_closest_marker(t) is not None for t in TIERS) != 1]
    if wrong:
        config.issue_config_time_warning(pytest.PytestWarning(
            f"{len(wrong)} test(s) need exactly one tier mark ({', '.join(TIERS)}; tests/README.md), e.g. "
            f"{wrong[0]}: add `pytestmark = pytest.mark.<tier>` to the module or a mark to the test"), stacklevel=2)


def _file_seconds() -> dict:
    lines = FILE_SECONDS.read_text().splitlines()
    return {f: float(s) for s, f in (line.split() for line in lines if line.strip() and not line.startswith("#"))}


def _xdist_groups(config, items) -> None:
    """Under ``--dist loadgroup``, each test marked ``xdist_group(name)`` has its node id end in ``@name``: the
    scheduler hands out tests by that suffix, a group's tests to one worker. pytest-xdist adds it by assigning
    ``Item._nodeid``, which pytest 9.2 no longer reads (it keeps the id as ``Item._id``, a ``NodeId``): there the
    groups were silently lost and their module-wide builds made on both workers. Adds the suffix where it is
    missing."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({m.args[0] if m.args else m.kwargs.get("name", "default")
                        for m in item.iter_markers("xdist_group")})
        if not names or item.nodeid.endswith("@" + "_".join(names)):
            continue
        nodeid = f"{item.nodeid}@{'_'.join(names)}"
        if hasattr(item, "_id"):                   # pytest >= 9.2
            from _pytest.nodeid import coerce_node_id
            item._id = coerce_node_id(nodeid)
        else:
            item._nodeid = nodeid
        assert item.nodeid == nodeid, (item.nodeid, nodeid)


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")   # after `-m` deselected: what runs
def pytest_heaviest_files_first(config, items):
    """The heaviest files first (file_seconds.txt), each file's tests in their own order (its module-wide builds are
    made once): pytest-xdist hands tests out in this order, so the long ones start early instead of ending the run
    on one worker while the other idles. A file not listed there (added since the list was made) goes before them:
    its cost is unknown, and a heavy file last would end the run on one worker, while a light one first costs
    nothing. Every worker collects the same order."""
    _xdist_groups(config, items)
    seconds = _file_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], math.inf))
