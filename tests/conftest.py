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
