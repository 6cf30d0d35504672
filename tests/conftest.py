"""Shared fixtures: the rank pools and the hypothesis profiles.

Profiles (choose with HYPOTHESIS_PROFILE=<name>; CI uses "ci"):
  ci    -- 10 examples per property, derandomized: the same examples every run, so CI is stable.
  dev   -- the default locally: random examples, a few more.
  long  -- hundreds of examples per test, for a soak before a release.
Every profile prints the ``@reproduce_failure`` blob of a failing example, so a
failure seen anywhere can be replayed exactly.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from minipar.testing import PoolSet

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=10, derandomize=True, database=None, **_common)
settings.register_profile("dev", max_examples=20, **_common)
settings.register_profile("long", max_examples=300, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# The ranks run one thread each; the reference in this process does the same.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` -> every rank's ``fn(ctx, *args)``; pools live for the session."""
    ps = PoolSet()
    yield ps
    ps.close()
