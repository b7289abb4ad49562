"""Engine operations on the local engine server: memory given back by /release_memory_occupation
(colocated mode) and the time a killed engine takes to be serving again (launcher restart).

    python benchmarks/engine_memory.py [--hidden-size 512] [--num-layers 8] [--restarts 3]

A model of the given size is built locally (tools/make_tiny_model.py), one local engine server is
launched by EngineLauncher with a supervisor; then: server RSS and served weight bytes before a
release of every tag, after it, after resuming the weights and after resuming the KV cache (seconds
of each call), and `--restarts` times kill -9 → healthy again (seconds, from the launcher's record).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--out", default="", help="working directory (default: a temporary one)")
    args = p.parse_args(argv)

    from benchmarks.benchlib import env, free_ports
    from megatron_flash.engines.launcher import EngineLauncher
    import subprocess

    work = args.out or tempfile.mkdtemp(prefix="mf_engine_memory_")
    model = os.path.join(work, "model")
    subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", model,
                    "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers)],
                   check=True, env=env(), stdout=subprocess.DEVNULL)
    launcher = EngineLauncher(backend="local", model_path=model, num_engines=1, base_port=free_ports(1),
                              run_dir=work, startup_timeout_s=300, env={"OMP_NUM_THREADS": "1"})
    out: dict = {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "memory": {}, "restart_s": []}
    with launcher:
        url = launcher.urls[0]
        launcher.supervise(max_restarts=args.restarts, interval_s=0.1)

        def snap(name: str, seconds: float | None = None) -> None:
            info = call(url, "/get_server_info")
            out["memory"][name] = {"rss_mb": info["rss_bytes"] / 2**20, "weights_mb": info["weights_bytes"] / 2**20,
                                   "seconds": seconds}
            print(f"{name:>16}: RSS {info['rss_bytes'] / 2**20:8.1f} MiB  weights {info['weights_bytes'] / 2**20:8.1f} MiB"
                  + (f"  ({seconds:.3f} s)" if seconds is not None else ""), flush=True)

        call(url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}})  # warm
        snap("serving")
        call(url, "/pause_generation", {"mode": "abort"})
        for name, path, tags in (("released", "/release_memory_occupation", None),
                                 ("weights resumed", "/resume_memory_occupation", ["weights"]),
                                 ("kv resumed", "/resume_memory_occupation", ["kv_cache", "cuda_graph"])):
            t0 = time.perf_counter()
            call(url, path, {} if tags is None else {"tags": tags})
            snap(name, time.perf_counter() - t0)
        call(url, "/update_weights_from_disk", {"model_path": model})
        call(url, "/continue_generation", {})
        for _ in range(args.restarts):
            pid = launcher.pids[0]
            os.kill(pid, signal.SIGKILL)
            while not launcher.take_restarted():
                time.sleep(0.05)
            out["restart_s"].append(launcher.restarts[-1]["restart_s"])
            print(f"killed {pid}: serving again after {out['restart_s'][-1]:.2f} s", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
