"""A fault-injection hook for benchmarks and tests: cut one weight sync of a whole run mid-transfer.

    MF_FAULT_CUT_SYNC_FILE=/path/to/trigger  python launch/pretrain_async_rl.py ...

Unset (every normal run), nothing is installed. Set, rank 0 checks after each bucket it sent whether
the trigger file exists; the first time it does, the file is removed and the first engine in service
has its weight-update session closed behind the bridge's back (its `/end_weight_update` is called),
as if its side of the transfer had been torn down. The rest of that pass then fails on that engine,
which still answers, so the executor re-syncs it from scratch (weight_sync.max_resync): the step's
metrics row shows `engines_resynced` = 1, and the engine serves the new version after the push (with
max_resync = 0 it is taken out of service instead: `engines_out_of_service`). A file, not a step
number, so that a benchmark can cut "the next sync" at a time of its choosing (benchmarks/soak.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

ENV = "MF_FAULT_CUT_SYNC_FILE"


def sync_cut_hook(bridge: Any) -> Optional[Callable[[int], None]]:
    """The bridge's `on_bucket` hook when MF_FAULT_CUT_SYNC_FILE is set on this rank's rank 0, else None."""
    path = os.environ.get(ENV, "")
    if not path or not bridge.rank0:
        return None

    def on_bucket(index: int) -> None:
        try:
            os.remove(path)  # the first bucket after the file appeared cuts; removing it arms nothing more
        except FileNotFoundError:
            return
        url = bridge.urls[0]
        _, errors = bridge.calls.fan("fault injection", [url], lambda c: c.end_weight_update(), session=True,
                                     retries=0)
        logger.warning("%s: weight-update session of %s closed after bucket %d (injected fault)%s", ENV, url, index,
                       f"; closing it failed: {errors[url]}" if errors else "")

    return on_bucket
