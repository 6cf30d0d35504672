"""Shared fixtures: the rank pools and the hypothesis profiles.

Profiles (choose with HYPOTHESIS_PROFILE=<name>; CI uses "ci"):
  ci    -- 10 examples per property, derandomized: the same examples every run, so CI is stable
           (4 in the TRITON_INTERPRET=1 child runs of the kernel tests: "ci_interpreted").
  dev   -- the default locally: random examples, a few more.
  long  -- hundreds of examples per test, for a soak before a release.
Every profile prints the ``@reproduce_failure`` blob of a failing example, so a
failure seen anywhere can be replayed exactly.

`ci_examples(n)` lowers the ci profile's count for one heavy property whose explicit ``@example``s
already put every awkward case into every run; the other profiles (``long`` too) keep theirs.
"""

import os
import sys
import threading

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
_loaded = "ci_interpreted" if _profile == "ci" and os.environ.get("TRITON_INTERPRET") == "1" else _profile
settings.load_profile(_loaded)


def ci_examples(n: int):
    """``@ci_examples(n)`` on a property: under the ci profile it draws ``n`` examples after its
    explicit ``@example``s (which always all run) instead of the profile's 10. Only for heavy
    properties whose explicit examples already put the awkward cases into every run (each use says
    which); every other profile (dev, long, ci_interpreted) leaves the property its own count."""
    if _loaded != "ci":
        return lambda test: test
    return settings(max_examples=n)


# The ranks run one thread each; the reference in this process does the same.
torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Tell kernel_testing which kernel modules' interpreted tests this session runs, so that one
    TRITON_INTERPRET=1 child pytest runs them all (kernel_testing is imported by then if any is)."""
    kernel_testing = sys.modules.get("kernel_testing")
    if kernel_testing is not None:
        kernel_testing.SESSION_FILES[:] = sorted(
            {str(item.path) for item in session.items if item.name == "test_triton_kernels_under_interpreter"})


@pytest.fixture(autouse=True)
def _kernel_tests_on_the_gpu(request):
    """MINIPAR_TEST_DEVICE=cuda (benchmarks/gpu_report.py): the Triton tests' tensors go to the GPU
    (kernel_testing.OnDevice), so the kernels run compiled there."""
    if os.environ.get("MINIPAR_TEST_DEVICE") != "cuda" or request.node.get_closest_marker("triton") is None:
        yield
        return
    from kernel_testing import OnDevice
    with OnDevice("cuda"):
        yield


@pytest.fixture
def world_of_one():
    """torch.distributed over this process alone (``minipar.init()``) for the test, torn down after it:
    other tests rely on the pytest process having no world."""
    import minipar
    import torch.distributed as dist
    started = not dist.is_initialized()
    mesh = minipar.init()
    yield mesh
    if started:
        mesh.destroy()
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def pools():
    """``pools.run(world_size, fn, *args)`` -> every rank's ``fn(ctx, *args)``; pools live for the session."""
    ps = PoolSet()
    yield ps
    close_all(ps)


def close_all(ps: PoolSet) -> None:
    """Close every pool of ``ps`` at once: each close waits up to a few seconds for its ranks to leave
    their process group and exit (longer on a loaded machine), so closing them in turn adds those up."""
    closers = [threading.Thread(target=pool.close) for pool in ps._pools.values()]
    for t in closers:
        t.start()
    for t in closers:
        t.join()
    ps.close()
