"""Raw-HTTP helpers and the teacher-forced reference for the contract tier (no project client code)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


# ---------------------------------------------------------------------------- raw HTTP helpers
def http(method: str, url: str, body: Any = None, *, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 120.0) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON or text or None)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as error:
        status, payload = error.code, error.read()
    if not payload:
        return status, None
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:
        return status, payload.decode(errors="replace")


def post(url: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
    return http("POST", url, {} if body is None else body, **kwargs)


def generate(url: str, input_ids: Any, *, expect: int = 200, **fields: Any) -> Any:
    status, out = post(url + "/generate", {"input_ids": input_ids, **fields})
    assert status == expect, (status, out)
    return out


_REFERENCE_MODELS: dict[str, Any] = {}


def teacher_logprobs(model_dir: str, prompt: list[int], output: list[int], *, temperature: float) -> list[float]:
    """Reference: an independent transformers forward of prompt+output, log_softmax(logits / T) at each output
    position (T = 1 for greedy, as SGLang)."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_dir not in _REFERENCE_MODELS:
        _REFERENCE_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = _REFERENCE_MODELS[model_dir]
    t = 1.0 if temperature == 0 else temperature
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / t, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, tok]) for i, tok in enumerate(output)]


def assert_logprobs_match(model_dir: str, prompt: list[int], out: dict, *, temperature: float,
                          tol: float = 1e-4) -> float:
    """The engine's output_token_logprobs equal the teacher-forced ones; returns the max abs diff."""
    meta = out["meta_info"]
    entries = meta["output_token_logprobs"]
    assert len(entries) == len(out["output_ids"]) == meta["completion_tokens"]
    assert [e[1] for e in entries] == out["output_ids"]
    ref = teacher_logprobs(model_dir, prompt, out["output_ids"], temperature=temperature)
    diff = max(abs(e[0] - r) for e, r in zip(entries, ref)) if ref else 0.0
    print(f"logprob parity T={temperature} n={len(ref)}: max |engine - teacher| = {diff:.3g}")
    assert diff <= tol, f"max logprob diff {diff} > {tol}"
    return diff


class StreamingGenerate:
    """A `stream: true` /generate call read on a thread: `started` is set once the first chunk (at least one
    generated token) arrived, `result()` is the last chunk before `data: [DONE]` (SGLang streams cumulative
    outputs, so the last chunk is the whole response)."""

    def __init__(self, url: str, input_ids: list[int], **fields: Any) -> None:
        import threading

        self.started = threading.Event()
        self._chunks: list[dict] = []
        self._error: BaseException | None = None
        body = {"input_ids": input_ids, "stream": True, **fields}
        self._thread = threading.Thread(target=self._run, args=(url + "/generate", body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                for line in resp:
                    line = line.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: "):]
                    if data == b"[DONE]":
                        break
                    self._chunks.append(json.loads(data))
                    self.started.set()
        except BaseException as error:  # re-raised by result()
            self._error = error
        finally:
            self.started.set()

    def wait_started(self, timeout: float = 60.0) -> None:
        assert self.started.wait(timeout), "no streamed chunk arrived"
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def num_chunks(self) -> int:
        """Chunks received so far (each carries at least one new token): the request's progress."""
        return len(self._chunks)

    def result(self, timeout: float = 120.0) -> dict:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "streaming request did not finish"
        if self._error is not None:
            raise self._error
        assert self._chunks, "no chunk received"
        assert "error" not in self._chunks[-1], self._chunks[-1]
        return self._chunks[-1]


def restore_checkpoint(server: Any) -> None:
    """Put the session's shared engine back as it started (the checkpoint's weights, label "default",
    not paused) after a module that changed it, and check that it did: a later module that reads the
    weights, the label or model_info must not see this one's changes."""
    post(server.url + "/continue_generation", {})  # harmless when not paused
    status, body = post(server.url + "/update_weights_from_disk",
                        {"model_path": server.model_dir, "weight_version": "default"})
    assert status == 200 and body["success"] is True, body
    prompt = [1, 8, 9, 10, 11]
    out = generate(server.url, prompt, return_logprob=True,
                   sampling_params={"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True})
    assert out["meta_info"]["weight_version"] == "default"
    assert_logprobs_match(server.model_dir, prompt, out, temperature=1.0)
    status, info = http("GET", server.url + "/model_info")
    assert status == 200 and info["model_path"] == server.model_dir and info["weight_version"] == "default", info
