"""A process group between a trainer rank and engine ranks, outside the trainer's default group.

Made the way SGLang's `init_custom_process_group` makes it (TCP rendezvous at
master_address:master_port, store keys prefixed by the group name), so a trainer rank using this
helper can join SGLang servers and our CPU server alike. Pure torch: the rollout side uses it too.
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401


def new_weight_update_group(*, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                            backend: str = "gloo") -> Any:
    """A process group outside the default one, made the way SGLang's `init_custom_process_group` makes it
    (TCP rendezvous at master_address:master_port, keys prefixed by group_name), so a trainer using
    SGLang's helper or this one can join. Blocks until all `world_size` ranks arrived."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(minutes=10)
    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
