"""Fixtures shared by the reward tests."""

import pytest

from grpokit.rewards import REGISTRY, register


@pytest.fixture
def temp_rewards():
    """`add(name, fn)` registers a reward for one test; it is removed afterwards."""
    added = []

    def add(name, fn):
        register(name)(fn)
        added.append(name)
        return fn

    yield add
    for name in added:
        REGISTRY.pop(name, None)
