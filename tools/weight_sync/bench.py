"""Weight-sync bandwidth: how fast a state gets from the trainer process into an engine's tensors.

    python tools/weight_sync/bench.py --transport ipc --size-mb 1024 --bucket-mb 256
    python tools/weight_sync/bench.py --transport ipc --ipc-mode fresh --size-mb 1024   # the ipc transport today
    python tools/weight_sync/bench.py --transport broadcast --model-path runs/quickstart/tiny_model
    python tools/weight_sync/bench.py --engine --transport ipc --size-mb 256             # WeightBridge → local engine server
    python tools/weight_sync/bench.py --mode stream-memory --size-mb 256 --bucket-mb 16  # hf_buckets peak memory
    python tools/weight_sync/bench.py --device cuda --size-mb 1024 --bucket-mb 256   # GPU tensors → GPU tensors
    python tools/weight_sync/bench.py --device cuda --engine --size-mb 1024          # GPU trainer → engine on the GPU

Transport mode (default): the sender holds a state of HF-named fp32 tensors (a fake Llama of
≈ --size-mb, or the tensors of --model-path) in ordinary memory, as `hf_buckets` produces them; a
receiver process holds its own preallocated tensors of the same names, as an engine does. One sync
= every tensor copied from the sender's state into the receiver's tensors, buckets of --bucket-mb;
it is timed from the first byte handled to the receiver's last acknowledgement.

  ipc  --ipc-mode fresh   the pickled path of the ipc transport (what SGLang engines get): each
                          bucket is copied into one flat tensor per dtype (flattened_bucket) and
                          goes through ForkingPickler (file_system strategy), which moves that
                          storage into a *new* shared-memory segment; the receiver unpickles (the
                          local engine's allowlist unpickler), maps the segment and copies into its
                          tensors.
       --ipc-mode staged  the staged path (what the local engine gets): the transport's own
                          SharedBuffers + Stager (weight_sync/transports/shared_buffers.py):
                          --num-buffers persistent memfd buffers of min(--bucket-mb, state), pages
                          touched at setup; the sender copies tensor bytes into the free buffer (large
                          tensors in pieces) and hands it over while it fills the next one; the
                          receiver maps each buffer once (engines/shared_weights.py) and copies out.
  broadcast               a 2-rank gloo group (process_group.new_weight_update_group, as the
                          bridge); names are announced, then (--broadcast-mode bucket, the bridge)
                          one broadcast of the bucket as one flat uint8 tensor that the receiver
                          copies out of (SGLang's flattened_bucket), or (--broadcast-mode tensor)
                          one broadcast per tensor; both received by the engine's own code
                          (weight_payloads.receive_broadcast) and copied into the receiver's tensors.
  disk                    safetensors files (one per bucket) in --disk-dir, then the receiver loads
                          each file and copies into its tensors (bridge: export, then load).

--device cuda (ipc only): the sender's state and the receiver's tensors live on the GPU (one GPU
serves both processes). `--ipc-mode staged` is the transport's CUDA path (weight_sync/transports/
cuda_ipc.py): each bucket copied into one of two persistent flat device buffers, one CUDA IPC handle
per bucket and dtype, device named by UUID, the receiver copies out and synchronizes before its ack;
`--ipc-mode fresh` pickles every tensor of a bucket as its own CUDA IPC handle (the per-tensor way).
memcpy is then a device-to-device copy of the same bytes (synchronized), and peak_extra_mb the
sender's peak CUDA allocation over the sync. With --engine, `--engine-device` puts the engine on the
GPU (default: --device) or on the CPU (the staged host path).

The same run measures this machine's memcpy (`dst.copy_(src)` of the state's size, one sample
right before each sync) and reports gbps = state bytes / median sync seconds, ratio_to_memcpy
(median sync vs median memcpy; ratio_best: best vs best), and each side's
peak extra memory: VmHWM after the sync minus VmRSS before it, with VmHWM reset through
/proc/self/clear_refs (shared-memory pages a process maps count in its RSS). The receiver sends a
checksum of what it received; `verified` says it equals the sender's.

--engine: a Megatron policy (one process) built from --model-path, or from a Llama of ≈ --size-mb
written with tools/make_tiny_model.py, synced to a real local engine server with WeightBridge; the
time is SyncReport.seconds (pause, buckets, flush, resume, version check) less the bridge's
post-sync logprob probe, reported apart. `--ipc-mode staged` is the bridge as shipped (the local
engine takes staged buffers); `--ipc-mode fresh` makes its ipc transport use the pickled path.
--mode stream-memory: peak extra memory while iterating `hf_buckets` of such a policy, against one
bucket plus one decoder layer (and bucket + 2 × the largest parameter: a bucket closes only once it
reaches --bucket-mb, so it can overshoot by one parameter).

Prints one JSON object as its last stdout line. Run with OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")

MB = 2**20


# ---------------------------------------------------------------------- memory probes
def proc_status(pid: int | str = "self") -> dict[str, float]:
    """VmRSS / VmHWM / RssShmem of a process, in MB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    return out


def reset_peak(pid: int | str = "self") -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0); False where that is not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakProbe:
    """Peak RSS increase over a region: VmHWM at the end minus VmRSS at the start."""

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid
        self.exact = reset_peak(pid)
        self.before = proc_status(pid)["VmRSS"]

    def extra_mb(self) -> float:
        return round(proc_status(self.pid)["VmHWM"] - self.before, 1)


# ---------------------------------------------------------------------- states
def llama_shapes(size_mb: float) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of a fake Llama whose fp32 weights total ≈ size_mb."""
    hidden = 64 if size_mb < 2 else 256 if size_mb < 64 else 512 if size_mb < 256 else 1024
    inter, vocab = hidden * 11 // 4, 32 * hidden if hidden >= 1024 else 8 * hidden
    layer = [("input_layernorm.weight", (hidden,)), ("self_attn.q_proj.weight", (hidden, hidden)),
             ("self_attn.k_proj.weight", (hidden, hidden)), ("self_attn.v_proj.weight", (hidden, hidden)),
             ("self_attn.o_proj.weight", (hidden, hidden)), ("post_attention_layernorm.weight", (hidden,)),
             ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
             ("mlp.down_proj.weight", (hidden, inter))]
    per_layer = sum(math.prod(s) for _, s in layer) * 4 / MB
    fixed = (2 * vocab * hidden + hidden) * 4 / MB
    num_layers = max(1, round((size_mb - fixed) / per_layer))
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    shapes += [(f"model.layers.{i}.{n}", s) for i in range(num_layers) for n, s in layer]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def make_state(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.model_path:
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(args.model_path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"--model-path {args.model_path!r} has no *.safetensors files")
        state = {}
        for name in files:
            state.update(load_file(os.path.join(args.model_path, name)))
        return {k: v.contiguous() for k, v in state.items()}
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in llama_shapes(args.size_mb)}


def checksum(state: dict[str, Any]) -> str:
    """Exact, order-independent per tensor: integer sum of the raw words, hashed with the names."""
    import torch

    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous().view(-1)
        digest.update(f"{name}:{int(t.view(words[t.element_size()]).sum(dtype=torch.int64))};".encode())
    return digest.hexdigest()[:16]


def bucket_plan(state: dict[str, Any], bucket_bytes: int) -> list[list[str]]:
    """Names per bucket, closed as soon as it reaches bucket_bytes (as `hf_buckets`)."""
    plan, current, size = [], [], 0
    for name, t in state.items():
        current.append(name)
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            plan.append(current)
            current, size = [], 0
    return plan + ([current] if current else [])


def device_sync(device: Any) -> Any:
    """A callable that waits for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


class DevicePeak:
    """Peak CUDA allocation of this process over a region, in MB (the host probe misses device memory)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        self.before = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)

    def extra_mb(self) -> Optional[float]:
        import torch

        if self.device.type != "cuda":
            return None
        return round((torch.cuda.max_memory_allocated(self.device) - self.before) / MB, 1)


class Memcpy:
    """This machine's copy bandwidth for `nbytes` (`dst.copy_(src)`, one thread, pages already
    present), sampled right before every sync so both see the same load on a shared box: the
    ratio compares the median sync with the median of these samples."""

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        import torch

        self.nbytes, self.device = nbytes, torch.device(device)
        self.src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0)
        self.dst.copy_(self.src)  # warm-up
        self.seconds: list[float] = []

    def sample(self) -> None:
        sync = device_sync(self.device)
        sync()
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        sync()
        self.seconds.append(time.perf_counter() - t0)

    def gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9

    def gbps_best(self) -> float:
        return self.nbytes / min(self.seconds) / 1e9

    def release(self) -> None:
        del self.src, self.dst


# ---------------------------------------------------------------------- receiver process
def receiver_main(conn: Any, shapes: list[tuple[str, tuple[int, ...], str]], transport: str, options: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from megatron_flash.engines.shared_weights import SharedBufferMaps, copy_pieces
    from megatron_flash.engines.weight_payloads import read_tensor_payload

    torch.set_num_threads(1)
    mp.set_sharing_strategy("file_system")
    device = options.get("device", "cpu")
    sync = device_sync(device)
    tensors = {n: torch.zeros(s, dtype=getattr(torch, d), device=device) for n, s, d in shapes}  # pages exist
    group, maps, probe, split = None, SharedBufferMaps(), None, {}
    if transport == "broadcast":
        from megatron_flash.engines.process_group import new_weight_update_group

        group = new_weight_update_group(master_address="127.0.0.1", master_port=options["port"], rank=1,
                                        world_size=2, group_name="mf_bench")
    conn.send(("ready", os.getpid()))
    while True:
        kind, *body = conn.recv()
        if kind == "begin":
            probe, split = PeakProbe(), {}
        elif kind == "fresh":  # bridge.py / local engine: unpickle the flattened bucket, copy each tensor
            t0 = time.perf_counter()
            items = list(read_tensor_payload(body[0], body[1] if len(body) > 1 else "flattened_bucket"))
            t1 = time.perf_counter()
            for name, t in items:
                tensors[name].copy_(t)
            t2 = time.perf_counter()
            sync()  # as the engine: the sender may reuse its CUDA buffers after the ack
            del items
            t3 = time.perf_counter()
            for part, dt in (("open", t1 - t0), ("copy", t2 - t1), ("sync", t3 - t2)):
                split[part] = split.get(part, 0.0) + dt
            conn.send(("ack",))
        elif kind == "staged":  # the local engine's receiving side: buffers mapped once, pieces copied out
            spec, entries = body
            copy_pieces(maps.pieces({"buffer": spec, "tensors": entries}), tensors.get)
            conn.send(("ack",))
        elif kind == "broadcast":  # the engine's receive_broadcast (either format), then its copy into the weights
            from megatron_flash.engines.weight_payloads import receive_broadcast

            names, dtypes, shapes_, load_format = body
            for name, t in receive_broadcast(group, names=names, dtypes=dtypes, shapes=shapes_,
                                             load_format=load_format):
                tensors[name].copy_(t)
            conn.send(("ack",))
        elif kind == "disk":
            from safetensors.torch import load_file

            for path in body[0]:
                for name, t in load_file(path).items():
                    tensors[name].copy_(t)
            conn.send(("ack",))
        elif kind == "end":
            conn.send(("stats", {"peak_extra_mb": probe.extra_mb() if probe else None, "checksum": checksum(tensors),
                                 "split": split}))
        elif kind == "stop":
            break
    if group is not None:
        dist.destroy_process_group(group)


# ---------------------------------------------------------------------- sender side of each transport
class Sender:
    def __init__(self, args: argparse.Namespace, conn: Any) -> None:
        self.args, self.conn = args, conn
        self.bucket_bytes = max(1, int(args.bucket_mb * MB))
        self.group: Any = None
        self.buffers: Any = None
        self.stager: Any = None
        self.flat_buffers: Any = None
        self.flat: Any = None
        self.disk_dir = ""

    def setup(self, state: dict[str, Any], port: int) -> None:
        if self.args.transport == "broadcast":
            from megatron_flash.engines.process_group import new_weight_update_group

            self.group = new_weight_update_group(master_address="127.0.0.1", master_port=port, rank=0,
                                                 world_size=2, group_name="mf_bench")
        elif self.args.transport == "ipc" and self.args.ipc_mode == "staged":
            from megatron_flash.weight_sync.transports.shared_buffers import SharedBuffers, Stager

            size = min(self.bucket_bytes, sum(t.numel() * t.element_size() for t in state.values()))
            self.buffers = SharedBuffers(size, self.args.num_buffers)
            self.stager = Stager(self._deliver, self.buffers)
        elif self.args.transport == "disk":
            self.disk_dir = tempfile.mkdtemp(prefix="mf_bench_", dir=self.args.disk_dir or None)

    def _wait_ack(self) -> Any:
        reply = self.conn.recv()
        assert reply[0] == "ack", reply
        return reply

    def sync(self, state: dict[str, Any]) -> None:
        transport = self.args.transport
        if self.args.device != "cpu":
            return self._sync_cuda(state)
        if transport == "ipc" and self.args.ipc_mode == "staged":
            return self._sync_staged(state)
        plan = bucket_plan(state, self.bucket_bytes)
        if transport == "disk":
            from safetensors.torch import save_file

            paths = []
            for i, names in enumerate(plan):
                paths.append(os.path.join(self.disk_dir, f"bucket-{i:05d}.safetensors"))
                save_file({n: state.pop(n) for n in names}, paths[-1])
            self.conn.send(("disk", paths))
            self._wait_ack()
            return None
        for names in plan:
            bucket = [(n, state.pop(n)) for n in names]  # dropped after the ack, as the bridge does
            if transport == "broadcast" and self.args.broadcast_mode == "bucket":
                import torch
                import torch.distributed as dist

                from megatron_flash.weight_sync.transports.broadcast import broadcast_order
                from megatron_flash.weight_sync.transports.flat_bucket import nbytes_of, pack

                ordered = broadcast_order(bucket)  # as the bridge: one flat tensor per bucket
                self.conn.send(("broadcast", [n for n, _ in ordered],
                                [str(t.dtype).removeprefix("torch.") for _, t in ordered],
                                [list(t.shape) for _, t in ordered], "flattened_bucket"))
                if self.flat is None or self.flat.numel() < nbytes_of(ordered):
                    self.flat = torch.empty(nbytes_of(ordered), dtype=torch.uint8)
                flat = self.flat[:nbytes_of(ordered)]
                pack(flat, ordered)
                dist.broadcast(flat, src=0, group=self.group)
            elif transport == "broadcast":
                import torch.distributed as dist

                self.conn.send(("broadcast", names, [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                                [list(t.shape) for _, t in bucket], None))  # announce, one broadcast per tensor
                for _, t in bucket:
                    dist.broadcast(t, src=0, group=self.group)
            else:
                from multiprocessing.reduction import ForkingPickler

                from megatron_flash.weight_sync.transports.flat_bucket import flatten_by_dtype

                for flat, metadata in flatten_by_dtype(bucket, shared=True):  # as the bridge: one shared copy per dtype
                    buf = io.BytesIO()
                    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})  # a new segment
                    self.conn.send(("fresh", base64.b64encode(buf.getvalue()).decode()))
                    self._wait_ack()  # bridge: one blocking request per bucket and dtype
                continue
            self._wait_ack()  # bridge: one blocking request per bucket
        return None

    def _deliver(self, spec: dict, entries: list, urls: list, label: str) -> dict:
        self.conn.send(("staged", spec, entries))  # the bridge: one HTTP request per buffer
        self._wait_ack()
        return {}

    def _sync_cuda(self, state: dict[str, Any]) -> None:
        """The ipc transport's CUDA path (staged: persistent flat buffers) or one handle per tensor (fresh)."""
        from megatron_flash.weight_sync.transports.cuda_ipc import DeviceFlatBuffers, dumps_with_device_uuids

        if self.flat_buffers is None:
            self.flat_buffers = DeviceFlatBuffers()
        for names in bucket_plan(state, self.bucket_bytes):
            bucket = [(n, state.pop(n)) for n in names]
            if self.args.ipc_mode == "staged":
                for flat, metadata in self.flat_buffers.flatten(bucket):
                    payload = dumps_with_device_uuids({"flattened_tensor": flat, "metadata": metadata})
                    self.conn.send(("fresh", base64.b64encode(payload).decode(), "flattened_bucket"))
                    self._wait_ack()
            else:
                self.conn.send(("fresh", base64.b64encode(dumps_with_device_uuids(bucket)).decode(), None))
                self._wait_ack()

    def _sync_staged(self, state: dict[str, Any]) -> None:
        for names in bucket_plan(state, self.bucket_bytes):
            errors = self.stager.add([(n, state.pop(n)) for n in names], ["receiver"], "bucket")
            assert not errors, errors
        errors = self.stager.drain()
        assert not errors, errors

    def cleanup_after_sync(self) -> None:
        if self.disk_dir:
            for name in os.listdir(self.disk_dir):
                os.remove(os.path.join(self.disk_dir, name))

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
        if self.flat_buffers is not None:
            self.flat_buffers.close()
        if self.disk_dir:
            shutil.rmtree(self.disk_dir, ignore_errors=True)
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)


def refreshed(state: dict[str, Any], rep: int) -> dict[str, Any]:
    """New ordinary-memory copies with changed values, made before the timer starts (as `hf_buckets`
    makes new tensors each sync); a sync consumes them. A stale receiver fails the checksum."""
    out = {}
    for name, t in state.items():
        t = t.clone()
        t.view(-1)[rep % t.numel()] += 1.0
        out[name] = t
    return out


def run_transport(args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing

    import torch
    import torch.multiprocessing as mp

    from megatron_flash.ports import free_ports

    torch.set_num_threads(1)
    mp.set_sharing_strategy("file_system")  # as bridge.py (file_descriptor crashes SGLang)
    state = {n: t.to(args.device) for n, t in make_state(args).items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    memcpy = Memcpy(nbytes, args.device)
    shapes = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()]
    port = free_ports(1)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    options = {"port": port, "device": args.device}
    receiver = ctx.Process(target=receiver_main, args=(child, shapes, args.transport, options), daemon=True)
    receiver.start()
    sender = Sender(args, parent)
    seconds, sender_peaks, receiver_peaks, splits, verified = [], [], [], [], True
    try:
        t_setup = time.perf_counter()
        sender.setup(state, port)
        kind, receiver_pid = parent.recv()
        setup_s = time.perf_counter() - t_setup
        for rep in range(args.repeats):
            sending = refreshed(state, rep)
            want = checksum(sending)
            memcpy.sample()
            parent.send(("begin",))
            probe, device_probe = PeakProbe(), DevicePeak(args.device)
            device_sync(args.device)()
            t0 = time.perf_counter()
            sender.sync(sending)
            seconds.append(time.perf_counter() - t0)
            sender_peaks.append(device_probe.extra_mb() if args.device != "cpu" else probe.extra_mb())
            sender.cleanup_after_sync()
            parent.send(("end",))
            _, stats = parent.recv()
            receiver_peaks.append(stats["peak_extra_mb"])
            splits.append(stats["split"])
            verified = verified and stats["checksum"] == want
        parent.send(("stop",))
        receiver.join(60)
    finally:
        sender.close()
        memcpy.release()
        if receiver.is_alive():
            receiver.kill()
    median, memcpy_gbps, memcpy_best = statistics.median(seconds), memcpy.gbps(), memcpy.gbps_best()
    gbps = nbytes / median / 1e9
    return {"mode": "transport", "transport": args.transport, "device": args.device,
            "broadcast_mode": args.broadcast_mode if args.transport == "broadcast" else None,
            "ipc_mode": args.ipc_mode if args.transport == "ipc" else None,
            "num_buffers": args.num_buffers if sender.buffers else None,
            "buffer_mb": round(sender.buffers.nbytes / MB, 2) if sender.buffers else None,
            "size_mb": round(nbytes / MB, 2), "num_tensors": len(state), "bucket_mb": args.bucket_mb,
            "repeats": args.repeats, "seconds": round(median, 4), "seconds_all": [round(s, 4) for s in seconds],
            "setup_seconds": round(setup_s, 3), "gbps": round(gbps, 3), "gbps_best": round(nbytes / min(seconds) / 1e9, 3),
            "memcpy_gbps": round(memcpy_gbps, 3), "memcpy_gbps_best": round(memcpy_best, 3),
            "ratio_to_memcpy": round(gbps / memcpy_gbps, 4),
            "ratio_best": round(nbytes / min(seconds) / 1e9 / memcpy_best, 4), "peak_extra_mb": max(sender_peaks),
            "receiver_peak_extra_mb": max(receiver_peaks),
            # the receiver's seconds per sync (median over repeats) in unpickling (CUDA: opening the IPC
            # handles), copying out, synchronizing; the rest of `seconds` is the sender and the pipe
            "receiver_split_s": {part: round(statistics.median(s.get(part, 0.0) for s in splits), 5)
                                 for part in ("open", "copy", "sync")} if any(splits) else None,
            "peak_source": "VmHWM-VmRSS (clear_refs reset)" if args.device == "cpu" else "sender: CUDA max allocated",
            "checksum": want, "verified": verified}


# ---------------------------------------------------------------------- real policy: engine and stream-memory
def model_for(args: argparse.Namespace, tmp: str) -> str:
    """--model-path, or a Llama of ≈ --size-mb written with tools/make_tiny_model.py."""
    if args.model_path:
        return args.model_path
    import subprocess

    # make_tiny_model: 4 heads, 2 KV heads, MLP 2 × hidden → 9 hidden² parameters per layer.
    hidden = 256 if args.size_mb < 64 else 1024
    layers = max(2, round(args.size_mb * MB / (9 * hidden * hidden * 4)))
    out = os.path.join(tmp, "model")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"), "--out", out,
                    "--hidden-size", str(hidden), "--num-layers", str(layers)], check=True, capture_output=True)
    return out


def build_policy(model: str) -> Any:
    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings

    return MegatronPolicy(PolicySettings(hf_path=model, micro_batch_size=1, optimizer=OptimizerConfig(name="sgd", lr=0.1)))


def model_bytes(policy: Any) -> int:
    from megatron_flash.weight_sync.plan import hf_buckets

    return sum(t.numel() * t.element_size() for b in hf_buckets(policy, bucket_bytes=1 << 62) for _, t in b)


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.ports import free_ports
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.weight_sync.bridge import WeightBridge

    tmp = tempfile.mkdtemp(prefix="mf_bench_engine_", dir=args.disk_dir or None)
    launcher, memcpy, bridge = None, None, None
    try:
        model = model_for(args, tmp)
        policy = build_policy(model)
        nbytes = model_bytes(policy)
        memcpy = Memcpy(nbytes, args.device)
        engine_device = args.engine_device or args.device
        launcher = EngineLauncher(backend="local", model_path=model, base_port=free_ports(1), run_dir=tmp,
                                  startup_timeout_s=600,
                                  server_args={"device": engine_device, "dtype": "float32",
                                               "decoder": args.engine_decoder})
        launcher.__enter__()
        engine_pid = launcher.pids[0]
        staged = args.transport == "ipc" and args.ipc_mode == "staged"
        bridge = WeightBridge(policy, launcher.urls, transport=args.transport, bucket_mb=args.bucket_mb,
                              disk_dir=os.path.join(tmp, "weights"))
        if args.transport == "ipc" and not staged:  # the pickled path, as SGLang engines get it
            bridge.transport._staged.update({u: False for u in launcher.urls})
        seconds, peaks, engine_peaks, buckets, probe_s, probe_diff, paths = [], [], [], 0, [], None, []
        for rep in range(args.repeats):
            memcpy.sample()
            probe, engine_probe, device_probe = PeakProbe(), PeakProbe(engine_pid), DevicePeak(args.device)
            report = bridge.sync(rep + 1)  # checks the version, and (probe) the engine's logprobs
            # The post-sync probe (a generation + logprobs on both sides) is not transport: reported apart.
            probe_s.append(getattr(report, "probe_seconds", 0.0))
            probe_diff = getattr(report, "max_abs_logprob_diff", None)
            seconds.append(report.seconds - probe_s[-1])
            peaks.append(device_probe.extra_mb() if args.device != "cpu" else probe.extra_mb())
            engine_peaks.append(engine_probe.extra_mb())
            buckets = report.num_buckets
            paths = sorted(set(getattr(bridge.transport, "paths", {}).values()))
    finally:
        if bridge is not None:
            bridge.close()
        if launcher is not None:
            launcher.__exit__(None, None, None)
        if memcpy is not None:
            memcpy.release()
        destroy_distributed()
        shutil.rmtree(tmp, ignore_errors=True)
    median, memcpy_gbps = statistics.median(seconds), memcpy.gbps()
    gbps = nbytes / median / 1e9
    return {"mode": "engine", "transport": args.transport, "device": args.device, "engine_device": engine_device,
            "ipc_mode": ("staged" if staged else "fresh (pickled)") if args.transport == "ipc" else None,
            "ipc_paths": paths if args.transport == "ipc" else None,
            "size_mb": round(nbytes / MB, 2), "bucket_mb": args.bucket_mb,
            "num_buckets": buckets, "repeats": args.repeats, "seconds": round(median, 4),
            "seconds_all": [round(s, 4) for s in seconds], "gbps": round(gbps, 3), "memcpy_gbps": round(memcpy_gbps, 3),
            "ratio_to_memcpy": round(gbps / memcpy_gbps, 4), "peak_extra_mb": max(peaks),
            "receiver_peak_extra_mb": max(engine_peaks), "peak_source": "VmHWM-VmRSS (clear_refs reset)",
            "probe_seconds": round(statistics.median(probe_s), 4), "probe_max_abs_logprob_diff": probe_diff,
            "verified": "bridge: weight_version read back" + (" + logprob probe" if probe_diff is not None else "")}


def run_stream_memory(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.weight_sync.plan import hf_buckets

    tmp = tempfile.mkdtemp(prefix="mf_bench_stream_", dir=args.disk_dir or None)
    try:
        policy = build_policy(model_for(args, tmp))
        params = [p for _, p in policy.model.module.named_parameters()]
        largest = max(p.numel() * p.element_size() for p in params) / MB
        total = sum(p.numel() * p.element_size() for p in params) / MB
        layer = sum(p.numel() * p.element_size() for n, p in policy.model.module.named_parameters()
                    if n.startswith("decoder.layers.0.")) / MB
        bucket_bytes = max(1, int(args.bucket_mb * MB))
        peaks, biggest_bucket, seconds = [], 0.0, []
        for _ in range(args.repeats):
            gc.collect()
            probe = PeakProbe()
            t0 = time.perf_counter()
            for bucket in hf_buckets(policy, bucket_bytes=bucket_bytes):
                biggest_bucket = max(biggest_bucket, sum(t.numel() * t.element_size() for _, t in bucket) / MB)
                del bucket  # the bridge drops a bucket once it is sent
            seconds.append(time.perf_counter() - t0)
            peaks.append(probe.extra_mb())
    finally:
        destroy_distributed()
        shutil.rmtree(tmp, ignore_errors=True)
    bound = args.bucket_mb + 2 * largest
    return {"mode": "stream-memory", "model_mb": round(total, 2), "bucket_mb": args.bucket_mb,
            "largest_param_mb": round(largest, 2), "largest_bucket_mb": round(biggest_bucket, 2),
            "layer_mb": round(layer, 2), "peak_extra_mb": max(peaks),
            "hf_buckets_seconds": round(statistics.median(seconds), 4),
            "hf_buckets_gbps": round(total * MB / statistics.median(seconds) / 1e9, 3),
            "bucket_plus_layer_mb": round(args.bucket_mb + layer, 2),
            "within_bucket_plus_layer": max(peaks) <= args.bucket_mb + layer,
            "bound_mb": round(bound, 2), "within_bound": max(peaks) <= bound,
            "peak_source": "VmHWM-VmRSS (clear_refs reset)"}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="transport", choices=["transport", "stream-memory"])
    p.add_argument("--engine", action="store_true", help="WeightBridge → a real local engine server")
    p.add_argument("--transport", default="ipc", choices=["ipc", "broadcast", "disk"])
    p.add_argument("--ipc-mode", default="staged", choices=["staged", "fresh"],
                   help="staged: persistent shared buffers (local engine); fresh: pickled (SGLang engines)")
    p.add_argument("--broadcast-mode", default="bucket", choices=["bucket", "tensor"],
                   help="bucket: one flat broadcast per bucket (the bridge); tensor: one per tensor")
    p.add_argument("--num-buffers", type=int, default=2, help="staged buffers (2: fill one while the other is read)")
    p.add_argument("--size-mb", type=float, default=64.0, help="state size (ignored with --model-path)")
    p.add_argument("--model-path", default="", help="HF model directory: its tensors are the state")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--disk-dir", default="", help="where disk files and temporary models go (default: $TMPDIR)")
    p.add_argument("--device", default="cpu", help="where the sender's state (trainer) lives: cpu, cuda, cuda:N")
    p.add_argument("--engine-device", default="", help="--engine: the engine's device (default: --device)")
    p.add_argument("--engine-decoder", default="static", choices=["static", "cb"], help="--engine: its decoder")
    args = p.parse_args(argv)
    if args.device != "cpu":
        if not args.device.startswith("cuda"):
            p.error(f"--device {args.device!r}: cpu, cuda or cuda:N")
        if args.transport != "ipc" and not args.engine:
            p.error(f"--device {args.device} measures the ipc transport only, not --transport {args.transport}")
        if args.mode != "transport":
            p.error(f"--device {args.device} is not used by --mode {args.mode}")
    if args.size_mb <= 0 or args.bucket_mb <= 0 or args.repeats < 1 or args.num_buffers < 1:
        p.error("--size-mb, --bucket-mb, --repeats and --num-buffers must be positive")
    if args.model_path and not os.path.isdir(args.model_path):
        p.error(f"--model-path {args.model_path!r} is not a directory")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.mode == "stream-memory":
        result = run_stream_memory(args)
    elif args.engine:
        result = run_engine(args)
    else:
        result = run_transport(args)
    print(json.dumps(result))
    return 0 if result.get("verified", True) else 1


if __name__ == "__main__":
    sys.exit(main())
