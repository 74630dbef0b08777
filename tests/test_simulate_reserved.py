"""The simulation's reserved bytes (Note [Reserved bytes: the allocations through the caching
allocator's model] in ac2_dist/_sim/_meter.py) against the same model fed by a real step:
an HF Llama (2 x 512, seq 256) trained on this CPU, every allocation and free of its
second step read from the CPU allocator's events, run through the caching allocator's model
in the order they happened (the parameters, buffers and batch first, as the simulation's
tracker meets them). Equal reserved bytes mean the simulated step allocates what the real
one does, in the same order and sizes; the model itself is checked against torch's
allocator rules in test_sim_allocator_model.py."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import ac2_dist as ac  # noqa: E402
from ac2_dist._measure._alloc import AllocationTrace  # noqa: E402
from ac2_dist._sim._allocator import CachingAllocator  # noqa: E402
from ac2_dist.simulate import simulate  # noqa: E402

L, D, S, B, V = 2, 512, 256, 2, 4096


def _build():
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=1344, num_hidden_layers=L,
                        num_attention_heads=D // 64, num_key_value_heads=2, max_position_embeddings=S)
    cfg._attn_implementation = "sdpa"
    return T.LlamaForCausalLM(cfg).train()


def _batch():
    ids = torch.randint(0, V, (B, S))
    return {"input_ids": ids, "labels": ids}


def _block():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _real_reserved(mode: str) -> tuple[int, int]:
    torch.manual_seed(0)
    model = _build()
    if mode == "full":
        ac.apply_ac(model, "recompute_all", modules=[_block()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    b = _batch()
    models = (CachingAllocator(), CachingAllocator(expandable_segments=True))
    seen = set()
    for t in [*model.parameters(), *model.buffers(), *b.values()]:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            for a in models:
                a.malloc(st.nbytes(), "default")
    traces = []
    for _ in range(2):
        with AllocationTrace() as trace:
            model(**b).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        traces.append(trace)
    out = []
    for a in models:
        live: dict = {}
        for k, trace in enumerate(traces):
            if k == 1:  # the counted step's high-water mark
                a.peak_reserved = a.reserved
            for _, ptr, nbytes in trace.allocations:
                if nbytes > 0:
                    live[ptr] = a.malloc(nbytes, "default")
                elif ptr in live:
                    a.free(live.pop(ptr))
        out.append(a.peak_reserved)
    return out[0], out[1]


@pytest.mark.parametrize("mode", ["none", "full"])
def test_simulated_reserved_equals_the_real_steps_through_the_same_model(mode):
    sim = simulate(_build, batch=_batch, blocks=[_block()], world_size=1, fsdp=None, modes=[mode],
                   device="cpu").modes[0]
    real = _real_reserved(mode)
    assert sim.reserved_bytes >= sim.peak_bytes and sim.reserved_expandable_bytes >= sim.peak_bytes
    assert (sim.reserved_bytes, sim.reserved_expandable_bytes) == pytest.approx(real, rel=0.02), \
        ((sim.reserved_bytes, sim.reserved_expandable_bytes), real)


def test_reserved_rows_in_the_table_under_fsdp2():
    report = simulate(functools.partial(_build), batch=_batch, blocks=[_block()], world_size=2, modes=["full"],
                      device="cpu")
    text = report.format()
    assert "peak reserved (caching allocator model)" in text and "with expandable_segments" in text
    full = report.modes[0]
    assert full.reserved_bytes >= full.peak_bytes
