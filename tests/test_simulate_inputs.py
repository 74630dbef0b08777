"""``python -m ac2_dist.simulate``'s bad inputs (issue: invalid configs, sizes and paths
ended in tracebacks, some after the whole simulation): each is one line on stderr naming
the value, exit status 2, before any step runs."""

from __future__ import annotations

import json

import pytest

from ac2_dist._sim._cli import main

pytest.importorskip("transformers", reason="the 'hf' extra installs transformers")

_BASE = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def _never(*args, **kwargs):
    raise AssertionError("the simulation ran: the input should have been refused before any step")


def _refused(tmp_path, capsys, config: dict | None, *argv: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_BASE if config is None else {**_BASE, **config}))
    rc = main(_never, ["--hf-config", str(path), "--world-size", "2", "--seq", "32", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    return err


@pytest.mark.parametrize("config,argv,says", [
    ({"hidden_size": -64}, (), "-64"),
    ({"hidden_size": 66}, (), "66"),  # not a multiple of the heads: transformers' own validator
    ({"vocab_size": 0}, (), "vocab_size must be >= 1, got 0"),
    (None, ("--seq", "128"), "--seq 128 is longer than the config's max_position_embeddings (64)"),
    (None, ("--modes", ","), "--modes ','"),
    (None, ("--modes", ""), "names no mode"),
    (None, ("--target", "1GiB", "--plan-out", "/nonexistent-ac2/dir/plan.json"), "does not exist"),
    (None, ("--plan-out", "plan.json"), "--plan-out needs --target"),
    (None, ("--batch", "0"), "--batch must be >= 1, got 0"),
    (None, ("--save-ops", "not_an_op"), "'not_an_op' is not an aten op"),
])
def test_bad_input_is_one_line_before_any_step(tmp_path, capsys, config, argv, says):
    assert says in _refused(tmp_path, capsys, config, *argv)


def test_plan_out_into_a_folder_is_refused(tmp_path, capsys):
    err = _refused(tmp_path, capsys, None, "--target", "1GiB", "--plan-out", str(tmp_path))
    assert "is a folder" in err


def test_the_api_refuses_no_mode():
    import torch

    from ac2_dist.simulate import simulate

    with pytest.raises(ValueError, match="nothing to simulate"):
        simulate(lambda: torch.nn.Linear(4, 4), batch=lambda: torch.randn(2, 4), blocks=[torch.nn.Linear],
                 world_size=2, modes=())


# ---- MoE: transformers' default experts path in float32 ---------------------------------------


def test_grouped_mm_fake_output_is_the_real_kernels():
    """The output the simulation makes for ``aten._grouped_mm`` in float32 (torch's meta
    function takes bfloat16 only) has the real CPU kernel's shape and dtype, in all four
    operand layouts."""
    import torch

    from ac2_dist._sim._kernels import _grouped_mm_out

    offs = torch.tensor([16, 32, 48], dtype=torch.int32)
    cases = [(torch.randn(48, 16), torch.randn(3, 16, 8), offs), (torch.randn(3, 8, 16), torch.randn(3, 16, 8), None),
             (torch.randn(8, 48), torch.randn(48, 8), offs), (torch.randn(3, 8, 16), torch.randn(16, 48), offs)]
    for a, b, o in cases:
        real = torch._grouped_mm(a, b, offs=o)
        made = _grouped_mm_out(a, b, o, None)
        assert made.shape == real.shape and made.dtype == real.dtype == torch.float32
        assert _grouped_mm_out(a, b, o, torch.bfloat16).dtype == torch.bfloat16  # out_dtype wins


def test_mixtral_default_experts_path_simulates_in_float32_and_says_so(tmp_path):
    """HF Mixtral's default experts path (``_grouped_mm``) in float32 died inside the fake
    step; it simulates now, the report naming the op it made from shapes."""
    import torch

    from ac2_dist.simulate import simulate

    T = pytest.importorskip("transformers")
    cfg = T.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64)

    def batch():
        ids = torch.randint(0, 128, (2, 32))
        return {"input_ids": ids, "labels": ids}

    report = simulate(lambda: T.MixtralForCausalLM(cfg).train(), batch=batch,
                      blocks=[T.models.mixtral.modeling_mixtral.MixtralDecoderLayer], world_size=2,
                      modes=("none", "full"))
    assert report.substituted == {"aten._grouped_mm in float32"}
    assert "aten._grouped_mm in float32" in report.format()
    none, full = report.mode("no AC"), report.mode("full AC")
    assert 0 < full.peak_bytes < none.peak_bytes
