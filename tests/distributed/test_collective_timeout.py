"""parallel.collective_timeout_s reaches every process group the trainer uses: two gloo ranks, one of
which never arrives at a barrier of a Megatron group (a hung or dead peer); the other must fail after
the deadline with torch's timeout error instead of waiting for ever (the default would be 600 s)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.conftest import json_rows, run_tool  # noqa: E402

SCRIPT = os.path.relpath(__file__, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEADLINE_S = 3.0


def test_a_rank_that_never_arrives_fails_the_others_at_the_deadline() -> None:
    proc = run_tool([SCRIPT], nproc=2, timeout=120, check=False)
    lines = json_rows(proc.stdout)
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = lines[-1]
    assert out["raised"] and DEADLINE_S <= out["seconds"] < 4 * DEADLINE_S, out
    assert "timed out" in out["message"].lower() or "timeout" in out["message"].lower(), out


def _main() -> int:
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_flash.trainer.distributed import init_distributed

    init_distributed(tp_size=1, pp_size=1, seed=0, backend="gloo", timeout_s=DEADLINE_S)
    group = ps.get_data_parallel_group()  # a group Megatron made: it must carry the same deadline
    if dist.get_rank() == 1:
        time.sleep(6 * DEADLINE_S)  # never arrives in time
        os._exit(0)
    t0 = time.monotonic()
    try:
        dist.barrier(group=group)
        out = {"raised": False, "seconds": time.monotonic() - t0, "message": ""}
    except Exception as e:  # noqa: BLE001 - what torch raises is the thing under test
        out = {"raised": True, "seconds": time.monotonic() - t0, "message": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_main())
