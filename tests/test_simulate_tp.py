"""ac2_dist.simulate with tensor parallelism inside each block (a dp x tp mesh, torch's
``parallelize_module`` with Hugging Face's Llama plan, then FSDP2 over dp): every rank of a
4-rank job (dp 2 x tp 2) simulated and measured on 4 gloo ranks from the CPU allocator's
events (the lowest of five steps: Note [A measured CPU step varies with gloo's threads] in
test_simulate.py); a plan file for a target followed by the real job within it; plans and
sizes given wrongly are refused before any step."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import _sim_case as case  # noqa: E402
from _dist import run_ranks  # noqa: E402

from ac2_dist.simulate import simulate  # noqa: E402

WORLD, TP = 4, 2


def _sim(rank, modes=("none", "full"), **kw):
    args = {"tp_size": TP, "tp_plan": case.TP_PLAN, **kw}
    return simulate(case.build, batch=case.batch, blocks=[case.block_type()], world_size=WORLD, rank=rank,
                    modes=list(modes), device="cpu", **args)


def test_every_rank_within_2_percent_and_a_plan_file_within_its_target(tmp_path):
    """Every rank simulated, no AC and full AC, then a plan for a target half-way between
    full AC and no AC (rank 0's) written to a file; 4 real ranks run no AC, full AC and the
    plan file. Every rank's peaks within 2 % of the simulation's. The plan records the
    DTensor conversions the blocks make (Note [Wrapper subclasses made and unwrapped outside
    dispatch] in ac2_dist/_trace/_subclass_wraps.py) and the collectives as the job issues
    them (Note [The simulated collectives complete as eager ones do] in
    ac2_dist/_sim/_world.py); the job loads it on every rank, its first step follows it, and
    every step of the job is within the target: the plan keeps clear of it the buffers
    gloo's threads may free late (Note [Collective buffers gloo frees late] in
    ac2_dist/_plan/_late_buffers.py). One test, not one per rank and mode: a module fixture
    would run the 4-rank job once per xdist worker that takes one of its tests."""
    sim = {r: dict(zip(["none", "full"], _sim(r).modes)) for r in range(WORLD)}
    report = _sim(0)
    none, full = sim[0]["none"].peak_bytes, sim[0]["full"].peak_bytes
    # half-way between the lowest target a plan exists for on gloo and no AC
    target = full + report.late_bytes + (none - full - report.late_bytes) // 2
    report.plan(target)
    path = str(tmp_path / "plan.json")
    report.save_plan(path)
    real = run_ranks(case.measure_tp_rank, ["none", "full", "plan"], TP, path, target, world=WORLD)
    off = [(rank, mode, sim[rank][mode].peak_bytes, real[rank][mode]["peaks"])
           for rank in range(WORLD) for mode in ("none", "full")
           if abs(sim[rank][mode].peak_bytes - real[rank][mode]["peak"]) > 0.02 * real[rank][mode]["peak"]]
    assert not off, off
    for rank, r in enumerate(real):
        # The blocks gloo's threads freed in two full-AC steps: FSDP's collective buffers,
        # which the late bound counts, and nothing of tensor parallelism's all-reduces (an
        # activation each) -- Note [Collective buffers gloo frees late], "Tensor parallelism".
        full = r["full"]
        others = [n for n in full["off_thread_frees"] if n not in full["fsdp_buffers"]]
        assert full["fsdp_buffers"] and sum(others) < 1024, (rank, others, full["fsdp_buffers"])
        got = r["plan"]
        assert got["history"][0][1] != "floor", (rank, got)  # step 1 followed the file
        assert max(got["peaks"]) <= target, (rank, got, target)


def test_tensor_parallel_shards_the_blocks():
    """tp 2 holds fewer block bytes than the same dp-only job of 2 ranks (its parameters and
    activations are split over tp), and the header names the mesh."""
    tp = _sim(0, modes=["none"])
    dp = simulate(case.build, batch=case.batch, blocks=[case.block_type()], world_size=WORLD // TP, rank=0,
                  modes=["none"], device="cpu")
    assert tp.modes[0].kept_bytes["model.layers.0"] < dp.modes[0].kept_bytes["model.layers.0"]
    assert tp.format().splitlines()[0].startswith(f"ac2_dist.simulate: rank 0 of {WORLD} (dp 2 x tp 2)")


@pytest.mark.parametrize("kw, match", [
    ({"tp_size": 3}, "tp_size must be a positive int that divides world_size=4"),
    ({"tp_size": 0}, "tp_size must be"),
    ({"tp_plan": None}, "tp_plan must be a non-empty mapping"),
    ({"tp_plan": {"mlp.up_proj": "packed_colwise"}}, "'mlp.up_proj' -> 'packed_colwise' is not simulated"),
    ({"tp_plan": {"mlp.gate": "colwise"}}, "has no submodule 'mlp.gate'"),
    ({"shard_size": 2}, "tp_size applies to fsdp='per-block' without shard_size"),
    ({"tp_size": None}, "tp_plan needs tp_size"),
])
def test_bad_tensor_parallel_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        _sim(0, modes=["none"], **kw)


def _cli(tmp_path, capsys, *extra, layers=None):
    from ac2_dist.simulate import _main

    cfg = case.config().to_dict()
    if layers is not None:
        cfg.update(layers)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "transformers_version"}))
    status = _main(["--hf-config", str(path), "--world-size", str(WORLD), "--batch", str(case.BATCH), "--seq",
                    str(case.SEQ), "--device", "cpu", "--modes", "none", *extra])
    return status, capsys.readouterr()


def test_cli_takes_the_configs_plan(tmp_path, capsys):
    status, out = _cli(tmp_path, capsys, "--tp", str(TP))
    assert status == 0, out.err
    sim = _sim(0, modes=["none"]).modes[0]
    assert out.out.splitlines()[0] == f"ac2_dist.simulate: rank 0 of {WORLD} (dp 2 x tp 2), recompute priced for cpu"
    from ac2_dist._sizes import human_bytes

    assert human_bytes(sim.peak_bytes) in out.out.splitlines()[3]


@pytest.mark.parametrize("extra, layers, match", [
    (["--tp", "3"], None, "--tp 3 must be >= 1 and divide --world-size 4"),
    (["--tp-plan", "mlp.up_proj=colwise"], None, "--tp-plan needs --tp"),
    (["--tp", "2", "--tp-plan", "mlp.up_proj=packed"], None, "'mlp.up_proj=packed' is not path=colwise"),
    (["--tp", "4"], {"num_key_value_heads": 2}, "--tp 4 does not divide the config's num_key_value_heads \\(2\\)"),
])
def test_cli_refuses_bad_tensor_parallel_input_in_one_line(tmp_path, capsys, extra, layers, match):
    import re

    status, out = _cli(tmp_path, capsys, *extra, layers=layers)
    assert status == 2
    assert len(out.err.strip().splitlines()) == 1 and re.search(match, out.err), out.err


