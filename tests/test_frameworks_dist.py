"""Frameworks' own FSDP + activation-checkpointing entry points on 2 gloo ranks, run by ac2
through ``integrations.torch_checkpoint`` (issue 20; ``test_frameworks.py`` covers the
single-process entry points).

Per framework, its real entry point on a small model (3 checkpointed blocks with dropout
and a head), each rank with its own fixed batch, 3 AdamW steps. The ac2 run turns the
switch on (``with torch_checkpoint.enabled():``) around the steps; the comparison runs are
the framework's own torch checkpointing and the framework without checkpointing (same
seeds, same data). Each test checks that ac2 ran (a checkpointed block's Python forward
runs once per step: torch's checkpoint runs it twice), the full (gathered) parameters
after 3 steps bitwise, on every rank, and that the bytes kept after the forward of a
further step are at most torch's.

Both frameworks refuse or ignore FSDP on CPU: the helpers marked "CPU workaround" get
around those limitations of Lightning and accelerate (none of them is ac2's).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks

from ac2_dist._measure._alloc import AllocationTrace
from ac2_dist.integrations import torch_checkpoint as switch

_FRAMEWORKS = "needs the 'frameworks' extra: pip install -e '.[test,hf,frameworks]'"

D, BLOCKS, STEPS = 32, 3, 3
MEASURED = 8  # further steps whose kept/peak bytes are measured (the least is reported)


class Block(nn.Module):
    """Linear -> Dropout -> ReLU -> Linear; ``calls`` counts its Python forward runs
    (torch's checkpoint re-runs them in backward, ac2 never does)."""

    def __init__(self, d: int = D, p: float = 0.1) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(d, 4 * d), nn.Dropout(p), nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.drop(self.a(x)).relu())


class Net(nn.Module):
    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(D, p) for _ in range(BLOCKS))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _blocks(model: nn.Module) -> list[Block]:
    return [m for m in model.modules() if isinstance(m, Block)]


def _count(model: nn.Module, cls: type) -> int:
    return sum(isinstance(m, cls) for m in model.modules())


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's fixed batch (different per rank: FSDP averages the gradients)."""
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(16, 8, D, generator=g), torch.randn(16, 8, 1, generator=g)


def _loss(model, x, y, step: int):
    return (model(x * (1 + 0.1 * step)) - y).square().mean()


def _launcher_env(rank: int, world: int) -> None:
    """What torchrun would export. run_ranks already made the process group; with these
    both frameworks use it instead of launching processes or initializing a group of their
    own (Lightning's launcher starts no processes when LOCAL_RANK is set and its
    ``_init_dist_connection`` skips an initialized group; accelerate reads
    RANK/WORLD_SIZE/LOCAL_RANK for MULTI_CPU and skips ``init_process_group`` too;
    OMP_NUM_THREADS keeps accelerate from changing the thread count)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS="1")


def _train(model, backward, opt, x, y, use_switch: bool) -> tuple[int, dict]:
    """``STEPS`` optimizer steps (the switch on around them for the ac2 run), then
    ``MEASURED`` forward+backward steps without an optimizer step; returns (Python forward
    calls per block per optimizer step, the least kept and peak bytes of the measured steps)."""
    blocks = _blocks(model)
    with switch.enabled() if use_switch else contextlib.nullcontext():
        before = sum(b.calls for b in blocks)
        for step in range(STEPS):
            torch.manual_seed(100 + step)  # the same dropout masks in every run
            opt.zero_grad(set_to_none=True)
            backward(_loss(model, x, y, step))
            opt.step()
        calls = sum(b.calls for b in blocks) - before
        assert calls % (len(blocks) * STEPS) == 0, calls
        measured = [_step_memory(model, backward, opt, x, y) for _ in range(MEASURED)]
    # The least of several steps: in some steps (timing-dependent; about 1 in 5 with FSDP2 on
    # gloo here) the forward's last all-gather output (one unit's gathered parameters, 33,408
    # bytes for a block, 264 for the root's head) is freed where the profiler records no free,
    # so it counts as kept. The least of MEASURED steps is the step's figure without it (the
    # figures are otherwise the same in every step); ac2 keeping more would show in every step.
    return calls // (len(blocks) * STEPS), {k: min(m[k] for m in measured) for k in ("kept", "peak")}


def _step_memory(model, backward, opt, x, y) -> dict:
    """``tests/_models.step_memory`` with the framework's ``backward`` (Fabric refuses a
    plain ``loss.backward()``): the bytes allocated in the forward and still held when it
    ends (kept), and the step's peak, both above what was allocated when it began."""
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with AllocationTrace() as trace:
        trace.mark("forward")
        loss = _loss(model, x, y, STEPS)
        trace.mark("backward")
        backward(loss)
        del loss
    fwd, bwd = trace.phases["forward"], trace.phases["backward"]
    return {"kept": bwd.start_bytes - fwd.start_bytes, "peak": max(fwd.peak_bytes, bwd.peak_bytes) - fwd.start_bytes}


def _clean(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (Fabric, FSDP1, checkpoint_wrapper)."""
    for wrapper in ("_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in params.items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert list(a) == list(b), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs by {(a[name] - b[name]).abs().max().item()}"


def _release() -> None:
    """Collect the runs' FSDP modules (reference cycles) while the process group is alive:
    a gloo worker that frees a finished collective's tensors after the interpreter began
    finalizing aborts the rank at exit (Note [Shutdown order] in ac2_dist/distributed.py)."""
    gc.collect()
    torch.distributed.barrier()


def _report(framework: str, rank: int, calls: tuple, memory: tuple) -> None:
    names = ("no-AC", "torch", "ac2")
    print(f"\n  {framework} rank {rank}: calls/block/step "
          + " ".join(f"{n} {c}" for n, c in zip(names, calls))
          + "; kept " + " ".join(f"{n} {m['kept']}" for n, m in zip(names, memory))
          + "; peak " + " ".join(f"{n} {m['peak']}" for n, m in zip(names, memory)))


# ---- Lightning Fabric, FSDPStrategy (FSDP1) ---------------------------------------------------


def _cpu_fsdp_strategy(**kwargs):
    """CPU workaround: Lightning's ``FSDPStrategy`` as a subclass that can FSDP-wrap on CPU.

    (a) Fabric's accelerator connector refuses ``FSDPStrategy`` with ``accelerator="cpu"``
        by an exact type check (``type(strategy) is FSDPStrategy``): a subclass passes it.
    (b) Lightning's ``setup_module`` passes ``device_id=self.root_device.index``, ``None``
        on CPU, and torch's FSDP1 refuses ``device_id=None`` when there is no accelerator.
        While ``setup_module`` runs (Lightning imports ``FullyShardedDataParallel`` from
        ``torch.distributed.fsdp`` inside it), that name is a subclass forcing
        ``device_id=torch.device("cpu")``; torch's class is put back after.
    """
    import torch.distributed.fsdp as tdf
    from lightning.fabric.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        def setup_module(self, module):
            original = tdf.FullyShardedDataParallel

            class CPUFullyShardedDataParallel(original):
                def __init__(self, *args, **kw):
                    kw["device_id"] = torch.device("cpu")
                    super().__init__(*args, **kw)

            tdf.FullyShardedDataParallel = CPUFullyShardedDataParallel
            try:
                return super().setup_module(module)
            finally:
                tdf.FullyShardedDataParallel = original

    return CPUFSDPStrategy(**kwargs)


def _lightning_run(rank: int, world: int, units: str, checkpointing: bool, use_switch: bool) -> dict:
    import lightning as L
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    options = {"activation_checkpointing_policy": {Block}} if checkpointing else {}
    if units == "block-units":
        options["auto_wrap_policy"] = {Block}  # each block its own FSDP unit (resharded after its forward)
    strategy = _cpu_fsdp_strategy(process_group_backend="gloo", **options)
    fabric = L.Fabric(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, precision="32-true")
    fabric.launch()  # starts no processes (LOCAL_RANK is set); uses the existing process group
    assert (fabric.global_rank, fabric.world_size) == (rank, world)
    torch.manual_seed(0)
    model = fabric.setup_module(Net(p=0.1))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert _count(model, CheckpointWrapper) == (BLOCKS if checkpointing else 0)
    assert _count(model, FullyShardedDataParallel) == (1 + BLOCKS if units == "block-units" else 1)
    x, y = _data(rank)
    calls, memory = _train(model, fabric.backward, opt, x, y, use_switch)
    with FullyShardedDataParallel.summon_full_params(model):
        params = {_clean(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"calls": calls, "memory": memory, "params": params}


def _lightning_ranks(rank: int, world: int, units: str) -> dict:
    _launcher_env(rank, world)
    eager = _lightning_run(rank, world, units, checkpointing=False, use_switch=False)
    theirs = _lightning_run(rank, world, units, checkpointing=True, use_switch=False)
    ours = _lightning_run(rank, world, units, checkpointing=True, use_switch=True)
    where = f"rank {rank}: Lightning FSDPStrategy ({units})"
    _assert_same(theirs["params"], ours["params"], f"{where}, ac2 vs torch checkpoint")
    # Lightning's checkpoint_wrapper keeps preserve_rng_state=True: torch's masks are eager's too.
    _assert_same(eager["params"], ours["params"], f"{where}, ac2 vs no checkpointing")
    _release()
    return {"calls": (eager["calls"], theirs["calls"], ours["calls"]),
            "memory": (eager["memory"], theirs["memory"], ours["memory"]), "digest": _digest(ours["params"])}


@pytest.mark.parametrize("units", ["root-unit", "block-units"])
def test_lightning_fabric_fsdp_activation_checkpointing_runs_ac2_under_the_switch(units):
    """``FSDPStrategy(activation_checkpointing_policy={Block})``: Lightning wraps the model in
    FSDP1 (one root unit, or with ``auto_wrap_policy={Block}`` a unit per block), then
    ``apply_activation_checkpointing`` puts torch's ``checkpoint_wrapper`` on every block."""
    pytest.importorskip("lightning", reason=_FRAMEWORKS)
    results = run_ranks(_lightning_ranks, units)
    for rank, r in enumerate(results):
        _report(f"lightning fsdp {units}", rank, r["calls"], r["memory"])
    for r in results:
        eager_mem, torch_mem, ac2_mem = r["memory"]
        assert r["calls"] == (1, 2, 1)  # no-AC, torch's checkpoint, ac2
        assert ac2_mem["kept"] <= torch_mem["kept"]
        assert ac2_mem["kept"] < eager_mem["kept"]  # the blocks' activations are not kept
    assert len({r["digest"] for r in results}) == 1  # the full parameters are equal on every rank


# ---- accelerate, FullyShardedDataParallelPlugin(fsdp_version=2) ------------------------------


def _force_fsdp_on_cpu(accelerator, plugin) -> None:
    """CPU workaround: accelerate sets ``DistributedType.FSDP`` only on accelerators
    (MULTI_GPU/XPU/NPU/..., in ``AcceleratorState``); with ``cpu=True`` the state is
    MULTI_CPU and the FSDP plugin is silently ignored (plain DDP, no activation
    checkpointing). Setting both on the shared state makes ``prepare`` take its FSDP2
    path (``fsdp2_apply_ac``, then ``fully_shard`` per block and the root)."""
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def _accelerate_run(rank: int, checkpointing: bool, use_switch: bool, p: float) -> dict:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator per run (its state is shared)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=checkpointing,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"])
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    _force_fsdp_on_cpu(accelerator, plugin)
    torch.manual_seed(0)
    model = Net(p=p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    assert _count(model, CheckpointWrapper) == (BLOCKS if checkpointing else 0)
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in _blocks(model))
    x, y = _data(rank)
    calls, memory = _train(model, accelerator.backward, opt, x, y, use_switch)
    params = {_clean(n): (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
              for n, t in model.named_parameters()}
    return {"calls": calls, "memory": memory, "params": params}


def _accelerate_ranks(rank: int, world: int) -> dict:
    from accelerate.state import AcceleratorState

    _launcher_env(rank, world)
    out = {}
    for p in (0.1, 0.0):
        eager = _accelerate_run(rank, checkpointing=False, use_switch=False, p=p)
        theirs = _accelerate_run(rank, checkpointing=True, use_switch=False, p=p)
        ours = _accelerate_run(rank, checkpointing=True, use_switch=True, p=p)
        where = f"rank {rank}, dropout {p}: accelerate FSDP2"
        # ac2 regenerates the forward's dropout masks whatever preserve_rng_state says: eager's parameters.
        _assert_same(eager["params"], ours["params"], f"{where}, ac2 vs no checkpointing")
        if p:
            # accelerate's fsdp2_apply_ac calls checkpoint_wrapper(layer, preserve_rng_state=False):
            # torch's recompute draws new dropout masks, so its parameters leave eager's.
            assert any(not torch.equal(a, b) for a, b in zip(eager["params"].values(), theirs["params"].values()))
        else:  # no random ops: torch's checkpoint gives eager's parameters too
            _assert_same(theirs["params"], ours["params"], f"{where}, ac2 vs torch checkpoint")
        out[p] = {"calls": (eager["calls"], theirs["calls"], ours["calls"]),
                  "memory": (eager["memory"], theirs["memory"], ours["memory"]), "digest": _digest(ours["params"])}
    out["rng_state_bytes"] = torch.get_rng_state().numel()
    AcceleratorState._reset_state(reset_partial_state=True)
    _release()
    return out


def test_accelerate_fsdp2_activation_checkpointing_runs_ac2_under_the_switch():
    """``FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True,
    auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])``:
    ``Accelerator.prepare`` wraps every block in ``checkpoint_wrapper(preserve_rng_state=False)``
    and ``fully_shard``s the blocks and the root (FSDP2)."""
    pytest.importorskip("accelerate")
    results = run_ranks(_accelerate_ranks)
    for rank, r in enumerate(results):
        for p in (0.1, 0.0):
            _report(f"accelerate fsdp2 dropout {p}", rank, r[p]["calls"], r[p]["memory"])
    for r in results:
        for p in (0.1, 0.0):
            (eager_mem, torch_mem, ac2_mem) = r[p]["memory"]
            assert r[p]["calls"] == (1, 2, 1)  # no-AC, torch's checkpoint, ac2
            assert ac2_mem["kept"] < eager_mem["kept"]  # the blocks' activations are not kept
            if p:
                # torch (preserve_rng_state=False) keeps no generator state and draws new masks;
                # ac2 keeps one CPU generator state per block to regenerate the forward's
                # (Note [preserve_rng_state under the switch]).
                assert ac2_mem["kept"] <= torch_mem["kept"] + BLOCKS * r["rng_state_bytes"]
            else:
                assert ac2_mem["kept"] <= torch_mem["kept"]
    for p in (0.1, 0.0):
        assert len({r[p]["digest"] for r in results}) == 1  # the full parameters are equal on every rank
