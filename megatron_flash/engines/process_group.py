"""A process group between a trainer rank and engine ranks, outside the trainer's default group.

Compatible with SGLang's `init_custom_process_group` (store at master_address:master_port hosted by
rank 0, keys prefixed by the group name, group rank = rank), so a trainer rank using this helper can
join SGLang servers and our local engine server alike. Pure torch: the local engine server uses it too.

Why the store is built here and not with `torch.distributed.rendezvous("tcp://…")` (which SGLang
uses on the engine side): under torchrun every worker has TORCHELASTIC_USE_AGENT_STORE=True, and
then rendezvous makes *every* rank, rank 0 included, a TCPStore client that expects torchrun's agent
to host the store. On a port of our choosing nobody hosts it, so the trainer and all engines wait
for the connect timeout (10 min): that was the "broadcast with a multi-rank trainer hangs" bug.
A single-process trainer started with plain `python` does not have the variable, which is why
broadcast only ever worked there.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def new_weight_update_group(*, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                            backend: str = "gloo", timeout_s: float = 600.0) -> Any:
    """Join (rank > 0) or host (rank 0) the group `group_name`; blocks until all `world_size` ranks arrived.

    The group is registered with identity rank mapping, as SGLang does; callers outside a default
    group pass `src=0`, callers inside one (the trainer) must pass `group_src=0` to collectives.
    """
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # is_master decided by our rank, never by the environment (see the module docstring). A client
    # must register with the store's worker count (wait_for_workers=True on a client does exactly
    # that, without waiting): a master made by torch's rendezvous — SGLang's trainer-side helper —
    # waits for world_size registrations and times out otherwise. Our own master does not wait.
    store = TCPStore(host_name=master_address, port=master_port, world_size=world_size, is_master=rank == 0,
                     timeout=timeout, wait_for_workers=rank != 0, multi_tenant=True)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group: Any) -> None:
    """Unregister a group. Its connections close only when the last Python reference to it goes
    (`abort()` does not close them on gloo): callers drop theirs, then peers blocked in one of its
    collectives fail at once ("Connection closed by peer") instead of at the group timeout."""
    torch.distributed.destroy_process_group(group)
