"""Shared fixtures: the rank pools and the hypothesis profiles.

Profiles (choose with HYPOTHESIS_PROFILE=<name>; CI uses "ci"):
  ci    -- 10 examples per property, derandomized: the same examples every run, so CI is stable
           (4 in the TRITON_INTERPRET=1 child runs of the kernel tests: "ci_interpreted").
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
# The Triton interpreter runs a kernel thousands of times slower than PyTorch: in CI its child runs
# (kernel_testing.run_interpreted) draw 4 derandomized examples per property; `long` still draws 300.
settings.register_profile("ci_interpreted", max_examples=4, derandomize=True, database=None, **_common)
_profile = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
settings.load_profile("ci_interpreted" if _profile == "ci" and os.environ.get("TRITON_INTERPRET") == "1" else _profile)


# The ranks run one thread each; the reference in this process does the same.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` -> every rank's ``fn(ctx, *args)``; pools live for the session."""
    ps = PoolSet()
    yield ps
    ps.close()
