"""A peak target for a pipeline rank: the model of Note [A stage's microbatches in flight]
(ac2_dist/_plan/_stage_model.py) against brute force, and a pipeline rank's plan file used
outside its schedule (Note [A pipeline rank's plan is followed as simulated] in
ac2_dist/_plan/_peak_pipeline.py). The plans under torch's own schedules on gloo ranks: tests/test_simulate_pipeline.py."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

pytest.importorskip("transformers")

import _sim_case as case  # noqa: E402
from _pipeline_case import MICROBATCHES, STAGES, simulated, stage_module  # noqa: E402

from ac2_dist._plan._block_problem import _Option  # noqa: E402
from ac2_dist._plan._stage_model import counts, predict, solve  # noqa: E402
from ac2_dist.simulate import Pipeline  # noqa: E402


def test_counts_follow_the_microbatches_in_flight():
    """1F1B stage 0 of 2, 3 microbatches, 2 blocks: microbatch 0's saves stay alive through
    microbatch 1's forward and until its own backward frees them block by block; a
    zero-bubble I keeps them until its W has run."""
    order = ["act:F0@0", "fwd:0@0", "fwd:1@0", "act:F0@1", "fwd:0@1", "fwd:1@1", "act:B0@0", "bwd:1@0", "bwd:0@0",
             "act:F0@2", "fwd:0@2", "act:B0@1", "bwd:1@1", "bwd:0@1", "act:E0@0"]
    n = counts(order, [0, 0])
    assert n["fwd:0@1"] == (2, 1) and n["fwd:1@1"] == (2, 2)
    assert n["bwd:1@0"] == (2, 2) and n["bwd:0@0"] == (2, 1)
    assert n["act:F0@2"] == (1, 1) and n["fwd:0@2"] == (2, 1)
    assert n["bwd:0@1"] == (2, 0) and n["act:E0@0"] == (1, 0)
    split = counts(["act:F0@0", "fwd:0@0", "fwd:1@0", "act:I0@0", "bwd:1@0", "bwd:0@0", "act:F0@1", "fwd:0@1",
                    "act:W0@0", "act:E0@0"], [0, 0])
    assert split["act:F0@1"] == (1, 1) and split["fwd:0@1"] == (2, 1) and split["act:W0@0"] == (2, 1)
    assert split["act:E0@0"] == (1, 0)


def _options(rng: random.Random) -> list[_Option]:
    out, dk, sec = [], 0, 10.0
    for _ in range(rng.randint(1, 4)):
        out.append(_Option(dk, sec, int(sec * 1e9), frozenset()))
        dk += rng.randint(1, 40)
        sec = max(0.0, sec - rng.uniform(0.5, 4))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_solve_fits_and_is_near_the_brute_force_optimum(seed):
    """On random problems (3 blocks, one or two stages a rank, 1F1B-like counts) the plan
    fits the target, and costs no more than the best plan brute force finds within the
    target less one grid step of every in-flight total."""
    rng = random.Random(seed)
    stage_of = [0, 0, 1] if seed % 2 else [0, 0, 0]
    options = [_options(rng) for _ in stage_of]
    n = {}
    for s in range(12):
        c = [rng.randint(0, 3), rng.randint(0, 3)]
        k = rng.randint(-1, 2)
        n[f"s{s}"] = tuple(c[stage_of[j]] + (1 if j <= k and stage_of[j] == stage_of[max(k, 0)] else 0)
                           for j in range(3))
    bases = {s: rng.randint(0, 50) for s in n}
    target = 150
    choice = solve(options, bases, n, stage_of, target)
    best = None
    step = max(sum(max(o.dk for o in options[j]) for j in range(3) if stage_of[j] == sg) for sg in (0, 1)) / 7
    slack = int(3 * len(stage_of) * step) + 1
    for c in itertools.product(*[range(len(o)) for o in options]):
        dks = [options[j][i].dk for j, i in enumerate(c)]
        if predict(bases, n, dks) <= target - slack:
            cost = sum(options[j][i].seconds for j, i in enumerate(c))
            best = cost if best is None else min(best, cost)
    if choice is None:
        assert best is None
        return
    dks = [options[j][i].dk for j, i in enumerate(choice)]
    assert predict(bases, n, dks) <= target
    if best is not None:
        assert sum(options[j][i].seconds for j, i in enumerate(choice)) <= best + 1e-9


@pytest.fixture(scope="module")
def stage_plan(tmp_path_factory):
    """Rank 1's plan of a 1F1B job (tests/_pipeline_case.py) and its target."""
    sim = simulated(1, "1F1B", str(tmp_path_factory.mktemp("stage_plan")))
    return sim["target"], sim["path"]


def test_a_stage_plan_outside_its_schedule_is_an_error(stage_plan):
    """A pipeline rank's plan would be followed unmeasured where the planner can measure:
    a forward outside any pipeline stage refuses it, naming the module and the rank."""
    pp = Pipeline(STAGES, 1, MICROBATCHES, "1F1B")
    module = stage_module(pp, stage_plan)
    x = torch.randn(case.BATCH, case.SEQ, case.HIDDEN, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"module 'model.model.layers.0' runs outside a "
                                           r"torch.distributed.pipelining schedule, but the plan file holds the plan "
                                           r"of pipeline rank 1 \(1F1B, 4 microbatches"):
        module(x)
    with torch.no_grad():  # an evaluation forward is no step: it follows the plan
        module(x)


def test_plan_file_names_keep_a_single_stage_modules_own_fqns():
    """Only a rank of several stages is simulated inside ``RankStages`` (blocks
    ``stages.<k>.<fqn>``, named ``<k>.<fqn>`` in the file for the job's ``nn.ModuleList``);
    a one-stage module whose own submodule is called ``stages`` keeps its names."""
    from ac2_dist._sim._stage_plan import file_fqns

    assert file_fqns(["stages.0.layers.1", "stages.1.layers.0"], True) == ["0.layers.1", "1.layers.0"]
    assert file_fqns(["stages.0.block"], False) == ["stages.0.block"]
