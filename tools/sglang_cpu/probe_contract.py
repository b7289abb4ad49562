"""Probe a running SGLang server and record the exact JSON it returns for the endpoints megatron-flash uses.

    python tools/sglang_cpu/probe_contract.py --url http://127.0.0.1:31000 --model-dir /tmp/tiny_llama \
        [--model-dir-seed1 /tmp/tiny_llama_s1] [--out-json runs/sglang_probe.json] [--out-md runs/sglang_probe.md]

Run it with the project's own venv (torch 2.13 CPU + transformers), not the SGLang one: it plays the
trainer's side (HTTP client, tensor sender, rank 0 of the weight-update process group) and uses
transformers for the teacher-forced logprob check. Every step is recorded as request -> status +
response (trimmed), also when it fails; the transcript is rewritten after each step, so a crash
mid-way still leaves what was seen. The server must have been started with the tiny model at
--model-dir (seed 0); --model-dir-seed1 is a same-shape model with other weights (made if absent).

The steps change server state (weights, pause) and put it back: it ends with the seed-0 weights
loaded and generation running, unless a step failed.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import requests

_TRIM_LIST = 6


def trim(obj: Any, depth: int = 0) -> Any:
    """Shorten long lists/strings so the transcript stays readable."""
    if isinstance(obj, dict):
        return {k: trim(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        if len(obj) > _TRIM_LIST:
            return [trim(v, depth + 1) for v in obj[:_TRIM_LIST]] + [f"... ({len(obj)} items)"]
        return [trim(v, depth + 1) for v in obj]
    if isinstance(obj, str) and len(obj) > 300:
        return obj[:300] + f"... ({len(obj)} chars)"
    return obj


class Recorder:
    def __init__(self, url: str, out_json: str, out_md: str):
        self.url = url.rstrip("/")
        self.out_json = out_json
        self.out_md = out_md
        self.entries: list[dict] = []
        self.notes: list[str] = []
        self.measures: dict[str, Any] = {}

    # -- HTTP ----------------------------------------------------------------------------------
    def call(self, title: str, method: str, path: str, body: Any = None, timeout: float = 120.0,
             record: bool = True, json_body: bool = True) -> dict:
        t0 = time.time()
        entry: dict[str, Any] = {"title": title, "request": f"{method} {path}",
                                 "body": trim(body) if body is not None else None}
        try:
            if json_body:
                r = requests.request(method, self.url + path, json=body, timeout=timeout)
            else:
                r = requests.request(method, self.url + path, data=body, timeout=timeout)
            entry["status"] = r.status_code
            entry["content_type"] = r.headers.get("content-type")
            try:
                entry["response"] = r.json()
            except ValueError:
                entry["response_text"] = r.text
        except Exception as e:  # noqa: BLE001 - record everything
            entry["exception"] = f"{type(e).__name__}: {e}"
        entry["elapsed_s"] = round(time.time() - t0, 3)
        if record:
            self.add(entry)
        return entry

    def add(self, entry: dict) -> None:
        shown = dict(entry)
        if "response" in shown:
            shown["response"] = trim(shown["response"])
        self.entries.append(shown)
        print(f"[probe] {shown['title']}: {shown.get('status', shown.get('exception'))} "
              f"({shown['elapsed_s']} s)", flush=True)
        self.flush()

    def note(self, text: str) -> None:
        print(f"[probe] NOTE {text}", flush=True)
        self.notes.append(text)
        self.flush()

    # -- output --------------------------------------------------------------------------------
    def flush(self) -> None:
        if self.out_json:
            os.makedirs(os.path.dirname(os.path.abspath(self.out_json)), exist_ok=True)
            with open(self.out_json, "w") as f:
                json.dump({"url": self.url, "measures": self.measures, "notes": self.notes,
                           "entries": self.entries}, f, indent=1)
        if self.out_md:
            os.makedirs(os.path.dirname(os.path.abspath(self.out_md)), exist_ok=True)
            lines = [f"# SGLang probe transcript ({self.url})", "", "## Measures", "",
                     "```json", json.dumps(self.measures, indent=1), "```", "", "## Notes", ""]
            lines += [f"- {n}" for n in self.notes]
            lines += ["", "## Transcript", ""]
            for e in self.entries:
                lines.append(f"### {e['title']}")
                lines.append("")
                req = e["request"]
                if e.get("body") is not None:
                    req += "  " + json.dumps(e["body"])
                lines.append(f"`{req}`")
                lines.append("")
                status = e.get("status", "no response")
                lines.append(f"→ status {status}, content-type {e.get('content_type')}, "
                             f"{e['elapsed_s']} s")
                lines.append("")
                if "response" in e:
                    lines += ["```json", json.dumps(e["response"], indent=1), "```"]
                elif "response_text" in e:
                    lines += ["```text", repr(e["response_text"]), "```"]
                if "exception" in e:
                    lines += ["```text", e["exception"], "```"]
                if e.get("extra"):
                    lines += ["", "extra:", "```json", json.dumps(e["extra"], indent=1), "```"]
                lines.append("")
            with open(self.out_md, "w") as f:
                f.write("\n".join(lines))


# ------------------------------------------------------------------------------------------------
# helpers


def run_bg(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict[str, Any] = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            box["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def long_gen_body(rid: str, n: int = 240) -> dict:
    return {"rid": rid, "input_ids": [3, 4, 5, 6],
            "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_rss(port: int) -> dict:
    """Summed RSS of the process listening on PORT and its children (Linux /proc)."""
    try:
        out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
        pid = int(out.split("pid=")[1].split(",")[0])
    except Exception:  # noqa: BLE001
        return {}
    pids = [pid]
    try:
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        pids += [int(k) for k in kids]
    except Exception:  # noqa: BLE001
        pass
    per = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        per[p] = int(line.split()[1]) // 1024
            with open(f"/proc/{p}/comm") as f:
                per[p] = (f.read().strip(), per.get(p))
        except OSError:
            pass
    total = sum(v[1] or 0 for v in per.values())
    return {"rss_total_mib": total, "per_process_mib": {str(k): v for k, v in per.items()}}


class Teacher:
    """Teacher-forced logprobs of given tokens under an HF checkpoint (transformers, fp32)."""

    def __init__(self):
        self.cache: dict[str, Any] = {}

    def model(self, model_dir: str):
        if model_dir not in self.cache:
            import torch
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            m.eval()
            self.cache[model_dir] = m
        return self.cache[model_dir]

    def logprobs(self, model_dir: str, prompt: list[int], output: list[int], temperature: float = 1.0):
        import torch

        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = self.model(model_dir)(ids).logits[0].float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        n = len(prompt)
        return [lp[n - 1 + i, tok].item() for i, tok in enumerate(output)]


def parity(teacher: Teacher, model_dir: str, prompt: list[int], reply: dict, temperature: float = 1.0):
    meta = reply["meta_info"]
    out_ids = reply["output_ids"]
    got = [x[0] for x in meta["output_token_logprobs"]]
    ref = teacher.logprobs(model_dir, prompt, out_ids, temperature)
    return max(abs(a - b) for a, b in zip(got, ref)), len(out_ids)


def make_custom_group(master: str, port: int, world_size: int, rank: int, group_name: str):
    """Rank-0 side of SGLang's init_custom_process_group (same store prefix, gloo)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)

    timeout = timedelta(seconds=120)
    store, rank, world_size = next(rendezvous(f"tcp://{master}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def serialize_named_tensors(named: list, strategy: str) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True): ForkingPickler + base64."""
    import torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler

    tmp.set_sharing_strategy(strategy)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


# ------------------------------------------------------------------------------------------------
# the probe


def probe(args) -> int:
    rec = Recorder(args.url, args.out_json, args.out_md)
    teacher = Teacher()
    prompt = [3, 4, 5, 6]
    if not os.path.isdir(args.model_dir_seed1):
        subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "make_tiny_model.py"),
                        "--out", args.model_dir_seed1, "--arch", args.arch, "--seed", "1"], check=True)

    # --- basic info ---------------------------------------------------------------------------
    rec.call("health", "GET", "/health")
    rec.call("health_generate", "GET", "/health_generate")
    rec.call("ready", "GET", "/ready")
    mi = rec.call("model_info", "GET", "/model_info")
    rec.call("get_model_info (alias)", "GET", "/get_model_info")
    si = rec.call("server_info", "GET", "/server_info", record=False)
    if "response" in si:
        keep = {k: si["response"].get(k) for k in ("weight_version", "version", "max_total_num_tokens",
                                                     "model_path", "device", "attention_backend")}
        si["response"] = keep
        si["title"] = "server_info (subset of keys)"
        rec.add(si)
    rec.call("get_weight_version", "GET", "/get_weight_version")
    rec.call("update_weight_version", "POST", "/update_weight_version",
             {"new_version": "probe-v0", "abort_all_requests": False})
    rec.call("model_info after update_weight_version", "GET", "/model_info")
    rec.measures["rss_idle"] = server_rss(int(args.url.rsplit(":", 1)[1].split("/")[0]))

    # --- generate -----------------------------------------------------------------------------
    body = {"rid": "probe-gen-1", "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}, "return_logprob": True}
    g = rec.call("generate (input_ids, temperature 1, return_logprob, rid)", "POST", "/generate", body)
    if "response" in g and "meta_info" in g["response"]:
        d, n = parity(teacher, args.model_dir, prompt, g["response"])
        rec.measures["logprob_parity_t1"] = {"max_abs_diff": d, "tokens": n}
    maxd, total = 0.0, 0
    for i in range(6):
        b = {"input_ids": prompt + [7 + i], "sampling_params": {"max_new_tokens": 32, "temperature": 1.0},
             "return_logprob": True}
        r = rec.call(f"generate parity batch #{i}", "POST", "/generate", b, record=False)
        if "response" in r:
            d, n = parity(teacher, args.model_dir, b["input_ids"], r["response"])
            maxd, total = max(maxd, d), total + n
    rec.measures["logprob_parity_many"] = {"max_abs_diff": maxd, "tokens": total, "requests": 6}

    b = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0.7},
         "return_logprob": True}
    r = rec.call("generate temperature 0.7 (which distribution do logprobs use?)", "POST", "/generate", b)
    if "response" in r:
        d_raw, _ = parity(teacher, args.model_dir, prompt, r["response"], 1.0)
        d_t, _ = parity(teacher, args.model_dir, prompt, r["response"], 0.7)
        rec.measures["logprob_temperature_0.7"] = {"max_abs_diff_vs_raw_logits": d_raw,
                                                   "max_abs_diff_vs_logits_over_T": d_t}
    r = rec.call("generate greedy (temperature 0)", "POST", "/generate",
                 {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
                  "return_logprob": True})
    if "response" in r:
        d_raw, _ = parity(teacher, args.model_dir, prompt, r["response"], 1.0)
        rec.measures["logprob_greedy_max_abs_diff_vs_raw_logits"] = d_raw
    rec.call("generate with logprob_start_len=0 (input_token_logprobs)", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 1.0},
              "return_logprob": True, "logprob_start_len": 0})
    rec.call("generate batch (list of input_ids, list of rids)", "POST", "/generate",
             {"rid": ["probe-b0", "probe-b1"], "input_ids": [prompt, prompt + [9]],
              "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}, "return_logprob": True})
    # a stop on EOS: stop_token_ids that are very likely + many tokens
    rec.call("generate until a stop token (stop_token_ids = all ids 3..47)", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 1.0,
                                                       "stop_token_ids": list(range(3, 48))},
              "return_logprob": True})
    rec.call("generate with eos (id 2) forced via logit bias? -> stop string instead", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 1.0,
                                                       "stop": ["a", "b", "c", "d", "e", "1", "2", "3"]},
              "return_logprob": True})
    rec.call("generate n=2 (parallel sampling)", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "n": 2},
              "return_logprob": True})
    rec.call("generate too long (prompt + max_new_tokens > context 256)", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_new_tokens": 400, "temperature": 1.0}})
    rec.call("generate without content-type json (raw bytes)", "POST", "/generate",
             json.dumps({"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}), json_body=False)

    # --- slow the engine down so that aborts/pauses hit running requests -------------------------
    rec.call("slow_down 0.05 s per forward (test-only endpoint)", "POST", "/slow_down",
             {"forward_sleep_time": 0.05})

    # --- abort one --------------------------------------------------------------------------------
    t, box = run_bg(rec.call, "generate (long, rid=probe-abort-1) — response after abort_request", "POST",
                    "/generate", long_gen_body("probe-abort-1"), 300.0, False)
    time.sleep(1.5)
    rec.call("abort_request rid", "POST", "/abort_request", {"rid": "probe-abort-1"})
    t.join(60)
    if "result" in box:
        rec.add(box["result"])
    rec.call("abort_request unknown rid", "POST", "/abort_request", {"rid": "no-such-rid"})

    # --- abort all ------------------------------------------------------------------------------
    ts = [run_bg(rec.call, f"generate (long, rid=probe-abortall-{i}) — response after abort_all", "POST",
                 "/generate", long_gen_body(f"probe-abortall-{i}"), 300.0, False) for i in range(2)]
    time.sleep(1.5)
    rec.call("abort_request abort_all", "POST", "/abort_request", {"abort_all": True})
    for t, box in ts:
        t.join(60)
        if "result" in box:
            rec.add(box["result"])

    # --- pause modes ------------------------------------------------------------------------------
    for mode in ("abort", "retract", "in_place"):
        t, box = run_bg(rec.call, f"generate (long, rid=probe-pause-{mode}) — final response", "POST",
                        "/generate", long_gen_body(f"probe-pause-{mode}", 120), 300.0, False)
        time.sleep(1.5)
        rec.call(f"pause_generation mode={mode}", "POST", "/pause_generation", {"mode": mode})
        time.sleep(0.5)
        rec.call(f"flush_cache while paused ({mode})", "POST", "/flush_cache")
        rec.call(f"health while paused ({mode})", "GET", "/health", timeout=60.0)
        rec.call(f"ready while paused ({mode})", "GET", "/ready", timeout=60.0)
        nt, nbox = run_bg(rec.call, f"new generate sent while paused ({mode}) — response", "POST", "/generate",
                          {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}, 300.0, False)
        time.sleep(1.0)
        state = {"long_request_returned_while_paused": not t.is_alive(),
                 "new_request_returned_while_paused": not nt.is_alive()}
        rec.note(f"pause mode={mode}: {state}")
        rec.call(f"continue_generation after {mode}", "POST", "/continue_generation", {})
        t.join(120)
        nt.join(120)
        for b in (box, nbox):
            if "result" in b:
                rec.add(b["result"])
            elif "error" in b:
                rec.note(f"background call failed: {b['error']}")

    rec.call("slow_down off", "POST", "/slow_down", {"forward_sleep_time": None})
    rec.call("flush_cache (idle) POST", "POST", "/flush_cache")
    rec.call("flush_cache (idle) GET", "GET", "/flush_cache")

    # --- update_weights_from_disk -------------------------------------------------------------------
    r = rec.call("update_weights_from_disk (seed-1 dir, weight_version=disk-v1)", "POST",
                 "/update_weights_from_disk", {"model_path": args.model_dir_seed1, "weight_version": "disk-v1"})
    g = rec.call("generate after disk update", "POST", "/generate",
                 {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
                  "return_logprob": True})
    if "response" in g:
        d1, _ = parity(teacher, args.model_dir_seed1, prompt, g["response"])
        d0, _ = parity(teacher, args.model_dir, prompt, g["response"])
        rec.measures["after_disk_update"] = {"max_abs_diff_vs_seed1": d1, "max_abs_diff_vs_seed0": d0}
    rec.call("model_info after disk update", "GET", "/model_info")
    rec.call("update_weights_from_disk bad path", "POST", "/update_weights_from_disk",
             {"model_path": "/nonexistent/dir"})

    # --- update_weights_from_tensor -----------------------------------------------------------------
    import torch
    from safetensors.torch import load_file

    sd0 = load_file(os.path.join(args.model_dir, "model.safetensors"))
    named = [(k, v.contiguous()) for k, v in sd0.items()]
    payload = serialize_named_tensors(named, "file_system")
    tbody = {"serialized_named_tensors": [payload], "weight_version": "tensor-v2", "flush_cache": True}
    rec.call("update_weights_from_tensor WITHOUT begin_weight_update", "POST", "/update_weights_from_tensor",
             tbody)
    rec.call("begin_weight_update", "POST", "/begin_weight_update", {})
    rec.call("begin_weight_update again (session already open)", "POST", "/begin_weight_update", {})
    rec.call("update_weights_from_tensor (seed-0 weights, file_system, weight_version=tensor-v2)", "POST",
             "/update_weights_from_tensor", tbody)
    rec.call("end_weight_update", "POST", "/end_weight_update", {})
    rec.call("end_weight_update again (no session)", "POST", "/end_weight_update", {})
    g = rec.call("generate after tensor update", "POST", "/generate",
                 {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
                  "return_logprob": True})
    if "response" in g:
        d0, _ = parity(teacher, args.model_dir, prompt, g["response"])
        rec.measures["after_tensor_update_max_abs_diff_vs_seed0"] = d0
    rec.call("model_info after tensor update", "GET", "/model_info")
    del payload

    # --- update_weights_from_distributed (gloo, probe is rank 0) ---------------------------------------
    port = free_port()
    group = "probe_group"
    init_body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                 "group_name": group, "backend": "gloo"}
    t, box = run_bg(rec.call, "init_weights_update_group (gloo, server = rank 1)", "POST",
                    "/init_weights_update_group", init_body, 180.0, False)
    pg = make_custom_group("127.0.0.1", port, 2, 0, group)
    t.join(180)
    if "result" in box:
        rec.add(box["result"])
    sd1 = load_file(os.path.join(args.model_dir_seed1, "model.safetensors"))
    names = list(sd1)
    dbody = {"names": names, "dtypes": [str(sd1[n].dtype).replace("torch.", "") for n in names],
             "shapes": [list(sd1[n].shape) for n in names], "group_name": group, "weight_version": "dist-v3"}
    rec.call("update_weights_from_distributed WITHOUT begin (expect refusal, no broadcast done)", "POST",
             "/update_weights_from_distributed", dbody, 60.0)
    rec.call("begin_weight_update (for distributed)", "POST", "/begin_weight_update", {})
    t, box = run_bg(rec.call, "update_weights_from_distributed (seed-1 weights, weight_version=dist-v3)", "POST",
                    "/update_weights_from_distributed", dbody, 180.0, False)
    for n in names:
        torch.distributed.broadcast(sd1[n].contiguous(), src=0, group=pg)
    t.join(180)
    if "result" in box:
        rec.add(box["result"])
    rec.call("end_weight_update (for distributed)", "POST", "/end_weight_update", {})
    g = rec.call("generate after distributed update", "POST", "/generate",
                 {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
                  "return_logprob": True})
    if "response" in g:
        d1, _ = parity(teacher, args.model_dir_seed1, prompt, g["response"])
        rec.measures["after_distributed_update_max_abs_diff_vs_seed1"] = d1
    rec.call("destroy_weights_update_group", "POST", "/destroy_weights_update_group", {"group_name": group})
    try:
        torch.distributed.destroy_process_group(pg)
    except Exception as e:  # noqa: BLE001
        rec.note(f"destroying the probe's own process group failed: {e!r}")

    # --- back to seed 0 (disk) and the file_descriptor strategy experiment -------------------------------
    rec.call("update_weights_from_disk back to seed 0", "POST", "/update_weights_from_disk",
             {"model_path": args.model_dir, "weight_version": "disk-v4"})
    if args.try_file_descriptor:
        payload = serialize_named_tensors(named, "file_descriptor")
        rec.call("begin_weight_update (fd experiment)", "POST", "/begin_weight_update", {})
        rec.call("update_weights_from_tensor with file_descriptor strategy", "POST",
                 "/update_weights_from_tensor", {"serialized_named_tensors": [payload]}, 60.0)
        rec.call("end_weight_update (fd experiment)", "POST", "/end_weight_update", {})
        rec.call("health after fd experiment", "GET", "/health", timeout=30.0)
    rec.measures["rss_end"] = server_rss(int(args.url.rsplit(":", 1)[1].split("/")[0]))
    rec.flush()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model-dir", required=True, help="the dir the server was started with (seed 0)")
    ap.add_argument("--model-dir-seed1", default="/tmp/tiny_llama_s1")
    ap.add_argument("--arch", default="llama", help="arch for making --model-dir-seed1 when absent")
    ap.add_argument("--out-json", default="runs/sglang_probe/transcript.json")
    ap.add_argument("--out-md", default="runs/sglang_probe/transcript.md")
    ap.add_argument("--try-file-descriptor", action="store_true",
                    help="last step: send tensors pickled with the file_descriptor strategy (may kill the server)")
    args = ap.parse_args()
    try:
        return probe(args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: leftover gloo/TCPStore threads of the weight-update group can keep the interpreter alive.
    os._exit(rc)
