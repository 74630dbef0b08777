"""The modes fuzzer (tests/_modes_fuzz.py) over a fixed budget of seeds: random small
programs mixing autocast, no_grad / enable_grad / inference_mode, detach and leaves made
inside, custom autograd Functions, saved-tensor hooks inside and around the region, a
dispatch mode of the user's, tensor hooks and retain_grad, int / bool / mixed-dtype ops,
random ops, nested regions, tuple / dict outputs, backward twice and double backward; each
run eagerly, under torch's checkpoint and under ac2 (the drop-in, ``apply_ac_policy`` with
three policies, ``wrap``; the C and the Python recorder): outputs, gradients, what hooks
and modes saw and the RNG state bitwise eager's, nothing alive after the step.

The budget: seeds 0-119 in five chunks (about 115 programs run; the rest are invalid
eagerly; 30-50 s of test time on 2 cores). ``AC2_FUZZ_SECONDS=180`` turns each chunk
into a timed run over fresh seeds (the five together run that many seconds); CI's long
run is ``python -m tests._modes_fuzz --minutes 3``. A failure prints the seed, the
program's source and ``python -m tests._modes_fuzz --seed N -v``, which replays it alone.

Then the fuzzer's own checks: each kind of discrepancy, planted in ac2's drop-in by a
monkeypatch, is caught; a documented refusal counts only where it applies; each known
issue (``KNOWN``) still reproduces (one that no longer does must leave the list).
"""

from __future__ import annotations

import os

import _modes_fuzz as mf
import pytest
import torch

import ac2_dist

CHUNKS = 5
SEEDS_PER_CHUNK = 24


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_programs_under_modes_match_eager(chunk):
    seconds = float(os.environ.get("AC2_FUZZ_SECONDS", "0")) / CHUNKS
    if seconds > 0:
        summary = mf.fuzz(iter(range(1_000_000 * (chunk + 1), 1_000_000 * (chunk + 2))), seconds=seconds)
    else:
        summary = mf.fuzz(iter(range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK)))
    print("\n" + summary.format(show=0))
    # The generator must keep making programs that run (it cannot pass by making none).
    assert summary.run >= summary.seeds * 3 // 4, summary.format(show=0)
    assert not summary.failures, summary.format(show=3)


def test_the_fixed_budget_covers_every_program_element():
    """Every element of the module docstring's list appears in the budget's programs (the
    generator cannot drift into leaving one out)."""
    programs = [mf.generate(seed) for seed in range(CHUNKS * SEEDS_PER_CHUNK)]
    missing = [name for name, has in mf.FEATURES.items() if not any(has(p) for p in programs)]
    assert not missing, missing


# ---- the fuzzer catches what it is for ------------------------------------------------

PROGRAM = mf.Program(
    seed=3,
    stmts=["t1 = (x @ w).tanh() * y", "obs.hook(t1, 'k1')\nobs.retain(t1, 'r1')",
           "with obs.hooks(clone=True):\n    t2 = t1.sin() * x", "t3 = F.dropout(t2, 0.3, training=True)",
           "with obs.mode():\n    t4 = t3.cos() * y"],
    ret="{'a': t4, 'b': (t1,)}",
)


def _variants(python: bool = False) -> list[tuple[str, bool]]:
    return [("ac2_checkpoint", python)]


def _planted(monkeypatch, wrap_outputs=None, wrap_call=None):
    """Replace ``ac2_dist.checkpoint`` with one that calls the real one (or
    ``wrap_call(real, function, *args, **kwargs)``) and passes each output tensor through
    ``wrap_outputs``."""
    real = ac2_dist.checkpoint

    def planted(function, *args, **kwargs):
        out = wrap_call(real, function, *args, **kwargs) if wrap_call else real(function, *args, **kwargs)
        if wrap_outputs is None:
            return out
        return torch.utils._pytree.tree_map(lambda o: wrap_outputs(o) if isinstance(o, torch.Tensor) else o, out)

    monkeypatch.setattr(ac2_dist, "checkpoint", planted)


def _kinds(res: mf.Result) -> set[str]:
    return {f.kind for f in res.failures}


def test_the_hand_written_program_passes():
    """The program the planted bugs below run: correct as it is (else they prove nothing)."""
    res = mf.check_program(PROGRAM, variants=_variants() + _variants(True))
    assert res.status == "ok" and not res.failures and not res.known, [f.format() for f in res.failures]


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * (1 + 2**-12)


def test_a_wrong_gradient_is_caught(monkeypatch):
    _planted(monkeypatch, wrap_outputs=_Scaled.apply)
    assert "wrong_grad" in _kinds(mf.check_program(PROGRAM, variants=_variants()))


def test_a_wrong_output_is_caught(monkeypatch):
    _planted(monkeypatch, wrap_outputs=lambda o: o + 2**-20)
    assert "wrong_output" in _kinds(mf.check_program(PROGRAM, variants=_variants()))


def test_a_moved_global_generator_is_caught(monkeypatch):
    """A backward that draws from the global generator (a replay that does not restore it)."""
    def draw(o):
        o.register_hook(lambda g: (torch.rand(1), None)[1])
        return o

    _planted(monkeypatch, wrap_outputs=lambda o: draw(o.view_as(o)) if o.requires_grad else o)
    assert _kinds(mf.check_program(PROGRAM, variants=_variants())) == {"wrong_rng"}


def test_a_recompute_that_reruns_the_python_is_caught(monkeypatch):
    """torch's checkpoint in ac2's place: its recompute runs the saved-tensor hooks and the
    dispatch mode inside the region again (more packs, more ops than eager)."""
    monkeypatch.setattr(ac2_dist, "checkpoint", torch.utils.checkpoint.checkpoint)
    res = mf.check_program(PROGRAM, variants=_variants())
    assert _kinds(res) == {"wrong_observed"}, [f.format() for f in res.failures]
    assert any("(packs, unpacks)" in f.detail for f in res.failures)
    assert any("a dispatch mode inside the region saw" in f.detail for f in res.failures)


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_a_hook_that_sees_another_gradient_is_caught(monkeypatch):
    """Only what a tensor hook saw differs: the output's gradient reaches ``t1`` doubled,
    its hook sees that, a later hook halves it back (exactly): outputs and gradients are
    eager's."""
    def call(real, function, *args, **kwargs):
        out = real(function, *args, **kwargs)
        out.register_hook(lambda g: g / 2)  # after obs.hook's, registered inside
        return _Doubled.apply(out)

    program = mf.Program(seed=5, stmts=["t1 = (x @ w).tanh() * y\nobs.hook(t1, 'k1')"], ret="t1")
    assert not mf.check_program(program, variants=_variants()).failures
    _planted(monkeypatch, wrap_call=call)
    res = mf.check_program(program, variants=_variants())
    assert _kinds(res) == {"wrong_observed"} and "hook k1" in res.failures[0].detail, \
        [f.format() for f in res.failures]


def test_a_leak_is_caught(monkeypatch):
    kept = []
    _planted(monkeypatch, wrap_outputs=lambda o: kept.append(o) or o)
    assert "leak" in _kinds(mf.check_program(PROGRAM, variants=_variants()))


def test_a_leaked_intermediate_is_caught_by_the_tracked_run(monkeypatch):
    """An intermediate kept alive (not an output, not an input): only the extra run, which
    tracks every tensor an op made in forward, sees it."""
    kept = []

    def call(real, function, *args, **kwargs):
        def inner(x, y, w):
            kept.append(x.detach() * 1.0)  # a tensor of forward that outlives the step
            return function(x, y, w)
        return real(inner, *args, **kwargs)

    _planted(monkeypatch, wrap_call=call)
    monkeypatch.setattr(mf, "AC2_VARIANTS", [("ac2_checkpoint", False)])
    monkeypatch.setattr(mf, "_track_variant", lambda program: ("ac2_checkpoint", False))
    res = mf.check_program(PROGRAM)
    assert _kinds(res) == {"leak_made"}, [f.format() for f in res.failures]


def test_a_refusal_counts_only_where_it_is_documented(monkeypatch):
    """The drop-in's refusal of a double backward through inputs packed by hooks around
    it: counted under those hooks and a double backward, a crash anywhere else."""
    def refuse(real, function, *args, **kwargs):
        raise RuntimeError("ac2_dist: backward with create_graph=True needs the region input, packed by the "
                           "saved-tensor hooks around the region with its autograd history")

    _planted(monkeypatch, wrap_call=refuse)
    where = PROGRAM.replace(around_hooks=True, backward="double")
    res = mf.check_program(where, variants=_variants())
    assert not res.failures and len(res.refused) == 1, res.refused
    for elsewhere in (PROGRAM, PROGRAM.replace(around_hooks=True), PROGRAM.replace(backward="double")):
        res = mf.check_program(elsewhere, variants=_variants())
        assert _kinds(res) == {"crash"} and not res.refused


@pytest.mark.parametrize("known", mf.KNOWN, ids=[k.name[:60] for k in mf.KNOWN])
def test_each_known_issue_still_reproduces(known):
    """A known issue's minimal program fails as the entry says, on both recorders, and the
    default (non-strict) check counts it apart. Once ac2 fixes it, this test fails: remove
    the entry from ``KNOWN`` in tests/_modes_fuzz.py."""
    variants = [(known.variant, False), (known.variant, True)]
    strict = mf.check_program(known.program, variants=variants, strict=True)
    assert strict.status != "invalid", strict.why
    assert strict.failures, f"known issue fixed? remove it from KNOWN: {known.name}"
    assert all(mf.known_issue(f) is known for f in strict.failures), [f.format() for f in strict.failures]
    lenient = mf.check_program(known.program, variants=variants)
    assert not lenient.failures and {name for name, _ in lenient.known} == {known.name}
