import os
import sys

import pytest
import torch
from _cuda_initialised import HAS_CUDA_DEVICE, simulate

# The launch/ scripts' models are shared with the tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))


def pytest_addoption(parser):
    parser.addoption(
        "--simulate-cuda-initialised", action="store_true", default=False,
        help="run every test (in every xdist worker) as a CPU job on a GPU machine after torch.compile "
             "initialised CUDA: torch.cuda.is_available() and is_initialized() answer True (tests/_cuda_initialised.py)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA device; skips without one (launch/gpu_check.py runs `-m cuda -rs` on a GPU, "
        "where a skip is a failure)",
    )
    if config.getoption("--simulate-cuda-initialised"):
        mp = pytest.MonkeyPatch()
        simulate(mp)
        config.add_cleanup(mp.undo)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, with a reason, when no CUDA device is present."""
    if HAS_CUDA_DEVICE:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU by launch/gpu_check.py)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_profiler_session_left_running():
    """A test that leaves a profiler session running (a memory tracker, a MemoryBudget's
    measurement) breaks the memory figures of every later test in its worker: fail it."""
    yield
    if torch._C._autograd._profiler_enabled():
        from ac2_dist._measure._alloc import active_trace

        trace = active_trace()
        while trace is not None:  # stop it, so that the next test starts clean
            trace.__exit__(None, None, None)
            trace = active_trace()
        pytest.fail("a profiler session was left running by this test")


@pytest.fixture
def simcuda():
    """A simulated CUDA on this thread (tests/_simcuda.py): regions take its streams for
    torch.cuda's, and the test fails on an unsynchronised cross-stream free or an
    unordered access, here at the latest."""
    from _simcuda import SimCuda

    with SimCuda() as sim:
        yield sim
        sim.check()
