"""Ending a torchrun job cleanly.

The last line of a torchrun script::

    import ac2_dist as ac
    import torch.distributed as dist

    def main():                 # builds the model, trains, reports
        ...

    if __name__ == "__main__":
        dist.init_process_group("gloo")
        main()                  # the model, optimizer and mesh die when it returns
        ac.distributed.shutdown()

``dist.destroy_process_group()`` alone, at the end of a gloo job, aborts about one run in
ten with ``terminate called without an active exception`` (SIGABRT) *after* the job
succeeded, with or without ac2_dist: see :func:`shutdown` for why and what it does instead.
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["shutdown"]


def shutdown(*, after_error: bool = False) -> None:
    """Tear down the default process group so that the job exits cleanly on every rank.

    Call it once per rank at the very end of a torchrun script, **after** the function
    that built the model has returned (what references the process group -- an FSDP2
    model, its optimizer, a device mesh -- must be gone by then, see below). It does:

    1. a barrier: no rank tears down while another still has a collective in flight;
    2. ``torch.distributed.destroy_process_group()``;
    3. drops the process groups that torch's device meshes keep (``fully_shard`` makes a
       mesh when given none, and torch's DTensor caches keep meshes for the life of the
       process), then runs the garbage collector, so that the groups are destroyed --
       and gloo's worker threads joined -- now, while Python is fully alive.

    Why: a gloo worker thread can hold the last reference to the tensors of a finished
    collective after the main thread has moved on. If it lets go of them while the
    interpreter is finalizing, releasing them needs the GIL, and a thread that asks for
    the GIL then is ended inside a C++ destructor: "terminate called without an active
    exception" (SIGABRT), rarely, under load, after a successful run. The threads stop
    when the group is destroyed; ``destroy_process_group()`` does not destroy a group
    anything still references.

    If a group is still referenced after step 3 (a model or optimizer alive where
    ``shutdown()`` was called), a :class:`RuntimeWarning` says so: move the training
    into a function and call ``shutdown()`` after it returns.

    Args:
        after_error: this rank is ending because of an exception. Then only
            ``destroy_process_group()`` runs: a barrier could wait forever for a rank
            that is gone. (``try: main() except BaseException:
            ac.distributed.shutdown(after_error=True); raise``.)

    Does nothing when no process group is initialized (a single-process run), so a
    script that runs with and without torchrun can call it unconditionally.
    """
    # Note [Shutdown order]
    #     A gloo worker thread can still hold a finished collective's work, and with it
    #     the last reference to the tensors it read or wrote, after the main thread has
    #     moved on. If the thread lets go of it just as the interpreter starts finalizing,
    #     releasing those tensors' Python objects needs the GIL, and a thread that asks
    #     for the GIL then is ended by pthread_exit inside a C++ destructor: "terminate
    #     called without an active exception" (SIGABRT) at exit, rarely, under load
    #     (torch checks Py_IsInitialized() before taking the GIL, but finalization can
    #     start between the check and the GIL). destroy_process_group() does not stop
    #     those threads while anything still references the group: the model's FSDP
    #     state, and the device mesh, which torch's DTensor sharding caches keep alive for
    #     the life of the process. So: a barrier (no collective in flight on any rank),
    #     destroy the group, detach it from every mesh, and collect (the caller's training
    #     function has returned; gc.collect() frees reference cycles): the group's
    #     destructor joins its threads while the interpreter is fully alive. After an
    #     error only destroy_process_group(): a barrier could wait for a rank that is gone.
    #     tests/test_stress_main_job.py runs the main job, which ends here, many times
    #     under load; with destroy_process_group() alone 1 run in 20 aborted there.
    if not (dist.is_available() and dist.is_initialized()):
        return
    groups = _live_groups()
    if not after_error:
        dist.barrier()
    dist.destroy_process_group()
    if after_error:
        return
    _drop_mesh_groups()
    gc.collect()
    alive = [name for name, ref in groups if ref() is not None]
    if alive:
        warnings.warn(
            f"ac2_dist.distributed.shutdown(): process group(s) {', '.join(alive)} are still referenced after "
            "destroy_process_group() (a model, optimizer or device mesh alive where shutdown() was called), so "
            "their gloo threads stop only while the interpreter exits, which can abort the job (SIGABRT) after "
            "it succeeded; build and train the model inside a function and call shutdown() after it returns",
            RuntimeWarning,
            stacklevel=2,
        )


def _live_groups() -> list[tuple[str, weakref.ref[Any]]]:
    """(name, weak reference) of every gloo process group this rank has made.

    Only gloo groups are watched: their worker threads are what aborts at exit."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = []
    for pg in list(getattr(world, "pg_map", {}) or {}):
        try:
            if dist.get_backend(pg) != "gloo":
                continue
            ref = weakref.ref(pg)
        except (TypeError, ValueError, RuntimeError):  # not weakly referencable, or an unregistered group
            continue
        groups.append((getattr(world, "pg_names", {}).get(pg, "?") or "?", ref))
    return groups


def _drop_mesh_groups() -> None:
    """Empty the process-group registry of every live device mesh (torch >= 2.12 keeps
    a mesh's groups there; older torch keeps none, and this finds nothing to clear)."""
    mesh_mod = sys.modules.get("torch.distributed.device_mesh")
    mesh_type = getattr(mesh_mod, "DeviceMesh", None)
    if not isinstance(mesh_type, type):
        return
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance would run the __instancecheck__ of every
        # object's metaclass in the heap (some warn).
        if issubclass(type(obj), mesh_type):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
