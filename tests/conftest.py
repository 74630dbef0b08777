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
    config.addinivalue_line("markers", "quick: the quick tier, a first check of the promises (tests/conftest.py QUICK)")
    if config.getoption("--simulate-cuda-initialised"):
        mp = pytest.MonkeyPatch()
        simulate(mp)
        config.add_cleanup(mp.undo)


# The quick tier (``python -m pytest -m quick``, README "The tests"): a first check in a few
# minutes on 2 cores of the three promises, each against eager and torch's checkpoint in the
# same run: gradients bitwise (plain models, every policy; HF's own switch), never more
# memory (a Hugging Face Llama and GPT-2 per layer, from the allocator), never a replayed
# collective or FSDP2 all-gather (2 gloo ranks), and the README's main job under torchrun.
# The whole suite is what CI runs.
QUICK = (
    "tests/test_models.py::test_grads_bitwise",
    "tests/test_hf_models.py::test_per_layer_checkpointing_keeps_and_peaks_no_more_than_torch[llama]",
    "tests/test_hf_models.py::test_per_layer_checkpointing_keeps_and_peaks_no_more_than_torch[gpt2]",
    "tests/test_dist_side_effects.py::test_collectives_not_replayed_and_grads_bitwise",
    "tests/test_fsdp.py::test_fsdp_grads_and_allgathers",
    "tests/test_hf_integration.py::test_enable_matches_eager_bitwise_through_hf_switch",
    "tests/test_launch.py::test_train_py_under_torchrun_writes_report[ac2-full]",
)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config, items):
    """Tests of the quick tier get the ``quick`` marker; tests marked ``cuda`` skip, with
    a reason, when no CUDA device is present."""
    for item in items:
        if item.nodeid.startswith(QUICK) and (item.nodeid in QUICK or item.nodeid.split("[")[0] in QUICK):
            item.add_marker(pytest.mark.quick)
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
