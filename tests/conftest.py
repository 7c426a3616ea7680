import pytest
import torch

import fxpar


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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


TIERS = ("structure", "numerics", "cost")


def pytest_collection_modifyitems(config, items):
    """Every test belongs to one tier (tests/README.md): say which ones carry none or several."""
    wrong = [item.nodeid for item in items if sum(item.get_closest_marker(t) is not None for t in TIERS) != 1]
    if wrong:
        config.issue_config_time_warning(pytest.PytestWarning(
            f"{len(wrong)} test(s) need exactly one tier mark ({', '.join(TIERS)}; tests/README.md), e.g. "
            f"{wrong[0]}: add `pytestmark = pytest.mark.<tier>` to the module or a mark to the test"), stacklevel=2)
