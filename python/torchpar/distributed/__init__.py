"""The torch.distributed backend "torchpar": torchpar's collectives under Python's c10d API.

    import torch.distributed as dist
    import torchpar.distributed  # noqa: F401  (registers the backend "torchpar")

    dist.init_process_group("torchpar", init_method="tcp://127.0.0.1:29500",
                            rank=rank, world_size=world_size)
    dist.all_reduce(tensor)              # shared memory among the ranks of this host
    model = torch.nn.parallel.DistributedDataParallel(model)   # unchanged

Why: on CPU, torch.distributed's own choice is Gloo, which sends even the ranks of one host
through loopback TCP. The process group made here runs on torchpar's CollectiveGroup
instead: shared memory when every rank of the group is on one host, hierarchical (shared
memory inside each host, Gloo between one leader per host) across hosts, Gloo when no host
holds two of its ranks. Host identity comes from the group's own exchange through the store
torch.distributed gives the backend (init_method / store, as with any backend).

What it supports (torch.distributed names): all_reduce (SUM, AVG, PRODUCT, MIN, MAX; BAND,
BOR, BXOR on integer and bool tensors; SUM of sparse COO tensors), all_reduce_coalesced,
broadcast, reduce, all_gather, all_gather_into_tensor (_all_gather_base),
all_gather_coalesced, gather, scatter, reduce_scatter, reduce_scatter_tensor
(_reduce_scatter_base), all_to_all, all_to_all_single (even or given split sizes), barrier,
send, recv (from a rank or any rank), isend, irecv, new_group, and async_op=True with
Work.wait(timeout), is_completed, exception and get_future (which DDP's reducer uses); the
process group's monitored_barrier (torch.distributed.monitored_barrier itself admits gloo
only). CPU tensors, one per call; non-contiguous ones go through contiguous copies.

Units: the group timeout is init_process_group's / new_group's `timeout` (a timedelta; 30
minutes by default, as torch.distributed's): the limit for creating the group and for each
operation. Work.wait(timeout) takes a timedelta too.

Errors: a rank that dies makes the others' operation fail (torchpar.PeerLostError, a
RuntimeError, naming the rank by its rank in the group, and its pid) within the group
timeout, on one host at once; a rank that stops calling makes them fail with
torchpar.TimeoutError (a RuntimeError and a TimeoutError) at the timeout. The error reaches
Work.wait, the call itself when synchronous, and the Future (DDP raises it from backward, as
a RuntimeError with the message). After either the group is broken: later calls fail at
once; destroy it (dist.destroy_process_group) and make a new one. Bad arguments (several
tensors per call, split sizes that do not add up, a bitwise ReduceOp on floats, PREMUL_SUM)
raise ValueError at the call.

Python original: torch.distributed with backend "gloo" (ProcessGroupGloo); the plug-in
mechanism is torch.distributed.Backend.register_backend (the pattern of pytorch's
test/cpp_extensions/cpp_c10d_extension.cpp).
"""
import torch.distributed as _dist

from torchpar import _distributed as _impl

#: The name to pass to torch.distributed.init_process_group and new_group.
BACKEND = "torchpar"


def _create_process_group(backend_options, pg_options=None):
    """torch.distributed's creator for "torchpar" (the extended-API form of 1.13).

    Called by init_process_group / new_group on every member with the group's PrefixStore,
    rank, size, timeout (a timedelta) and the members' global ranks; collective (blocks until
    every member joined, at most the timeout, with the GIL released).

    Errors: ValueError when pg_options is given (the backend has none); torchpar.TimeoutError
    naming the rank that did not join in time.
    """
    if pg_options is not None:
        raise ValueError("the torchpar backend takes no pg_options")
    return _impl.create_process_group(
        backend_options.store,
        backend_options.group_rank,
        backend_options.group_size,
        backend_options.timeout.total_seconds(),
        list(backend_options.global_ranks_in_group),
        backend_options.group_id,
    )


def collective_backend(group=None):
    """Which of torchpar's backends `group` (default: the default group) runs on.

    Returns "shm", "hierarchical" or "gloo". Errors: ValueError when the group is not a
    "torchpar" one. No Python original (torch.distributed.get_backend says "torchpar").
    """
    pg = group if group is not None else _dist.distributed_c10d._get_default_group()
    return _impl.collective_backend(pg)


if BACKEND.upper() not in _dist.Backend._plugins:
    _dist.Backend.register_backend(BACKEND, _create_process_group, extended_api=True)

__all__ = ["BACKEND", "collective_backend"]
