"""The planner's min-cut placements (Note [Saved sets as cuts] in ac2_dist/_plan/_cuts.py) and
a climb that may use the whole target (Note [A climb that replays nothing new] in
ac2_dist/_plan/_peak_model.py), on hand-built block problems; and on a recorded HF block,
every cut recomputes none of the ops it banned and is priced exactly."""

from __future__ import annotations

import torch

import ac2_dist as ac
from ac2_dist._plan._block_problem import _Option, _Problem, _Record
from ac2_dist._plan._cuts import cut_sets, min_cut
from ac2_dist._plan._peak_model import _solve_from

aten = torch.ops.aten


def _rec(seq, nbytes, seconds, inputs, flops=0, view=False):
    return _Record(seq, seq, aten.mul.Tensor, None, 0 if view else nbytes, flops, seconds, tuple(inputs), view)


def _fan_out_problem() -> _Problem:
    """A matmul M (costly; its output is written in place later, so no plan saves it) read
    by three pointwise ops p, q, r (60 bytes each), all read by backward, beside 12 small
    independent targets that each pay more per byte saved than p, q or r alone: keeping M
    from replaying takes saving p, q and r together, which the greedy path reaches only
    after every small target (276 bytes, where the cut needs 180)."""
    records = [_rec(1, 1000, 10.0, [0], flops=10**9), _rec(2, 60, 0.1, [1]), _rec(3, 60, 0.1, [1]),
               _rec(4, 60, 0.1, [1])]
    records += [_rec(10 + k, 8, 0.02, [0]) for k in range(12)]
    targets = {2, 3, 4} | {10 + k for k in range(12)}
    return _Problem(records, targets, set(), {1}, tuple(range(30)))


def test_a_cut_saves_the_set_the_greedy_path_misses():
    problem = _fan_out_problem()
    assert len(problem.cuttable) > 12  # past the exact enumeration
    cut = min_cut(problem, {1}, set(problem.cuttable))
    assert cut == frozenset({2, 3, 4})
    held, cost, replayed = problem.evaluate(cut)
    assert held == 180 and 1 not in replayed
    # the frontier holds that cut: no matmul replayed for 180 bytes
    zero = [o for o in problem.frontier() if o.flops == 0]
    assert zero and min(o.dk for o in zero) == 180, problem.frontier()
    problem._cuts = []  # without the cuts: the greedy path's set, every small target saved too
    assert min(o.dk for o in problem.frontier() if o.flops == 0) == 276
    # a byte limit between the two: the fraction solver starts from the cut
    problem._cuts = None
    assert problem.solve(200) >= frozenset({2, 3, 4})


def test_forced_values_cost_a_cut_nothing_and_region_inputs_are_free():
    # f (a collective's output, saved by the graph anyway) feeds g; M reads f and a region input
    records = [_rec(1, 500, 0.2, [0]), _rec(2, 1000, 10.0, [1, 0], flops=10**9), _rec(3, 40, 0.1, [2])]
    records += [_rec(10 + k, 8, 0.01, [0]) for k in range(12)]
    problem = _Problem(records, {3} | {10 + k for k in range(12)}, {1}, set(), tuple(range(30)))
    assert min_cut(problem, set(), set(problem.cuttable)) == frozenset()  # nothing banned: the floor
    assert min_cut(problem, {2}, set(problem.cuttable)) == frozenset({3})
    cuts = cut_sets(problem)
    assert frozenset({3}) in cuts and all(1 not in c for c in cuts)


def test_a_climb_that_replays_nothing_new_uses_the_whole_target():
    """Measured plan A under the target; B saves more in block 0 and replays a subset of
    what A replays: it may fill the target. C replays an op A saved: it keeps the margin."""

    class Problem:
        sizes = {1: 100, 2: 300, 3: 50}
        replays = {frozenset(): {1, 2, 3}, frozenset({1}): {2, 3}, frozenset({1, 2}): {3},
                   frozenset({3}): {1, 2}, frozenset({1, 3}): {2}, frozenset({1, 2, 3}): set(),
                   frozenset({2}): {1, 3}, frozenset({2, 3}): {1}}

        def evaluate(self, saved):
            return sum(self.sizes[s] for s in saved), 0.0, self.replays[frozenset(saved)]

    opts = [_Option(0, 4.0, 0, frozenset()), _Option(50, 3.5, 0, frozenset({3})),
            _Option(100, 3.0, 0, frozenset({1})), _Option(400, 1.0, 0, frozenset({1, 2})),
            _Option(450, 0.0, 0, frozenset({1, 2, 3}))]
    peaks = {"fwd:0": 500, "bwd:0": 600}
    problems = [Problem()]
    # A = {1}; {1, 2} adds 300 and replays a subset of A's replays: fits 900 exactly, no margin
    choice, bases = _solve_from([opts], problems, (2,), peaks, 900, margin=100)
    assert choice == (3,), choice
    assert bases == {"fwd:0": 500 + 300 - 400, "bwd:0": 600 + 300 - 400}
    # {3} alone replays 1, which A saved: with the margin it does not fit 650 (600 + 50 + 100 > 650)
    opts2 = [_Option(0, 4.0, 0, frozenset()), _Option(50, 0.5, 0, frozenset({3})), _Option(100, 3.0, 0, frozenset({1}))]
    choice, _ = _solve_from([opts2], problems, (2,), peaks, 650, margin=100)
    assert choice == (2,), choice  # stays at A
    choice, _ = _solve_from([opts2], problems, (2,), peaks, 650, margin=0)
    assert choice == (1,), choice  # priced from A up: {3} adds 50 (1 saved by A frees nothing)


def test_cuts_of_a_recorded_llama_block_replay_nothing_they_banned():
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = T.LlamaForCausalLM(cfg).train()
    budget = ac.MemoryBudget(peak=1 << 40)
    ac.apply_ac(model, budget, modules=[T.models.llama.modeling_llama.LlamaDecoderLayer])
    model(input_ids=torch.randint(0, 64, (2, 32)), use_cache=False).logits.sum().backward()
    budget.close()  # stop measuring: the test reads the recorded problem only
    (problem,) = budget.peak_planner.problems.values()
    assert len(problem.cuttable) > 12
    records = problem.records
    costly = [s for s in problem.evaluate(frozenset())[2] if records[s].flops > 0]
    assert costly
    cut = min_cut(problem, set(costly), set(problem.cuttable))
    held, seconds, replayed = problem.evaluate(cut)
    assert not replayed & set(costly)
    assert held == sum(records[s].nbytes for s in cut if s in problem.targets or any(
        s in records[r].inputs for r in replayed))  # every saved output is read by backward or a replay
    frontier = problem.frontier()
    assert frontier[-1].flops == 0 and all(a.dk < b.dk and a.seconds > b.seconds for a, b in zip(frontier, frontier[1:]))
    # the frontier (bytes against estimated time) has the cut or something better in both
    floor = problem.evaluate(frozenset())[0]
    assert any(o.dk <= held - floor and o.seconds <= seconds for o in frontier)


class _WritesInALoop(torch.nn.Module):
    """A block past the exact enumeration (more than 12 candidate outputs) that writes in place
    through views of a buffer it made, in a loop: ``mul_`` on a ``select``, ``index_put_``,
    setitem on a ``slice`` of a ``view``."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        buf = torch.zeros_like(h)
        for i in range(3):
            buf.select(0, i).mul_(0.5).add_(h[i].sigmoid())
            buf.index_put_((torch.tensor([i + 3]),), (h[i] * h[i + 1]).unsqueeze(0), accumulate=True)
            buf.view(-1, h.shape[-1])[i + 6:i + 7] = self.b(h[i:i + 1]).relu()
        return self.c(buf * h).square() + x


def _step(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    model(x).sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def test_cut_plans_keep_eager_gradients_through_in_place_writes_in_a_loop():
    import copy

    torch.manual_seed(0)
    base = torch.nn.Sequential(*[_WritesInALoop() for _ in range(3)])
    x = torch.randn(16, 32)
    want = _step(copy.deepcopy(base), x)
    floor = ac.apply_ac(copy.deepcopy(base), "recompute_all", modules=[_WritesInALoop])
    for policy in (ac.MemoryBudget(0.3), ac.MemoryBudget(0.7), ac.MemoryBudget(peak=1 << 30)):
        model = ac.apply_ac(copy.deepcopy(base), policy, modules=[_WritesInALoop])
        for _ in range(6):  # a peak target: the floor, its planned steps, settled
            got = _step(model, x)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), policy
        if policy.peak_planner is not None:
            policy.close()
            (problem,) = policy.peak_planner.problems.values()
            assert len(problem.cuttable) > 12 and problem.cuts()  # the cuts were among the options
    assert all(torch.equal(a, b) for a, b in zip(want, _step(floor, x)))
