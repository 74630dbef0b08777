import os
import sys


# Note [One CPU per xdist worker]
#     ``pytest -n N`` runs N workers; each one's torch would start as many intra-op threads
#     as the machine has CPUs, so N workers (and the processes their tests start) share the
#     CPUs N times over, and OpenMP's threads spin while they wait for work. On 2 cores, two
#     workers with 2 threads each ran tests/test_timeline.py, test_streams.py and
#     test_fsdp.py in 232 s, with one thread each in 143 s. So each worker gets its share of
#     the CPUs, set before torch loads, and the processes its tests start inherit it unless
#     they set their own (rank processes use one thread: tests/_dist.py). Without xdist, or
#     with OMP_NUM_THREADS set, nothing changes.
def _threads_per_worker() -> int:
    """Each xdist worker's share of the CPUs (Note [One CPU per xdist worker]); 0 without xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // workers) if workers > 0 else 0


_THREADS = _threads_per_worker() if "OMP_NUM_THREADS" not in os.environ else 0
if _THREADS:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402
from _cuda_initialised import HAS_CUDA_DEVICE, simulate  # noqa: E402

if _THREADS:
    torch.set_num_threads(_THREADS)

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
