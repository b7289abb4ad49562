"""The /generate reply as data: `GenerateResult` (one completion with its behaviour logprobs, finish and
weight versions), `version_number` (a weight-version label as a policy version) and
`parse_generate_reply`, which checks a reply against SGLang 0.5.23's contract (listed in client.py) and
raises `MalformedReply` naming the offending field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from megatron_flash.engines.client_base import MalformedReply, describe_len, is_int, is_number, short_repr
from megatron_flash.types import decode_routes

FINISH_TYPES = ("stop", "length", "abort")


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens [start, end) were sampled under weight ``version`` (SGLang ``weight_versions``)."""

    version: str
    start: int
    end: int


@dataclass
class GenerateResult:
    """One finished (or aborted) generation, parsed from SGLang's /generate reply."""

    rid: str
    output_ids: List[int]
    output_logprobs: Optional[List[float]]
    """Behavior logprob log μ of each output token (``meta_info.output_token_logprobs[i][0]``);
    None when asked with return_logprob=False."""
    finish_reason: str
    """stop | length | abort."""
    finish_matched: Union[int, str, List[int], None] = None
    """The stop token/string that ended a ``stop`` finish (None for eos-less stops and others)."""
    finish_message: Optional[str] = None
    """Why an ``abort`` happened, as the engine (or the proxy) says."""
    weight_version: Optional[str] = None
    """``meta_info.weight_version``: the engine's weight version when the reply was built."""
    weight_version_spans: Optional[List[WeightVersionSpan]] = None
    """Per-token-range versions when the engine reports them (weights changed mid-generation)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    engine_url: str = ""
    """The engine that produced this result ("" for a request the proxy aborted before dispatch)."""
    meta_info: Dict[str, Any] = field(default_factory=dict, repr=False)
    """The raw meta_info, for fields this class does not lift (timings, retractions, ...)."""
    routed_experts: Any = None
    """MoE routes (``meta_info.routed_experts``, asked with return_routed_experts): a tensor
    [prompt + completion - 1, layers * top_k] of expert ids; None when not asked or not returned."""

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    def span_versions(self) -> Optional[List[Optional[int]]]:
        """Per output token, the (integer) weight version of the span it falls in, when the engine's
        spans cover every token; None otherwise (non-integer versions become None)."""
        if not self.weight_version_spans:
            return None
        out: List[Optional[int]] = []
        for span in self.weight_version_spans:
            out += [version_number(span.version)] * (span.end - span.start)
        return out if len(out) == len(self.output_ids) else None

    @property
    def min_weight_version(self) -> Optional[str]:
        """The oldest version any output token was sampled under (staleness is counted from it)."""
        if self.weight_version_spans:
            return self.weight_version_spans[0].version
        return self.weight_version


LORA_NAME_PREFIX = "policy-v"
"""Adapter names are versioned: the policy's version v is pushed as adapter `policy-v{v}`."""


def lora_adapter_name(version: Any) -> str:
    return f"{LORA_NAME_PREFIX}{version}"


def lora_adapter_version(name: str) -> Optional[int]:
    """The policy version an adapter name carries (None for a name that is not one of ours)."""
    if not isinstance(name, str) or not name.startswith(LORA_NAME_PREFIX):
        return None
    return version_number(name[len(LORA_NAME_PREFIX):])


def label_by_adapter(result: "GenerateResult", lora_name: str) -> "GenerateResult":
    """A reply to a request that named adapter `lora_name`. An engine that reports the adapter it ran
    (the local engine echoes `meta_info.lora_path`: it serves one adapter, merged, and continues older
    requests on the newer one) is believed as usual, by its weight_version; one that does not (SGLang)
    ran every token on the adapter the request named, whatever its global weight_version says, so
    that names the version."""
    if "lora_path" in result.meta_info:
        return result
    result.weight_version = str(lora_adapter_version(lora_name))
    result.weight_version_spans = None
    return result


INITIAL_WEIGHT_VERSION = "default"
"""SGLang's label of the weights an engine started with (--weight-version's default)."""


def version_number(value: Any) -> Optional[int]:
    """A weight version label as the policy version it names (runs label versions 0, 1, …), else None.
    SGLang's initial label names version 0: an engine serves its start checkpoint (model.hf_path) only
    in a fresh run before the first push — a resumed run, and an engine restarted mid-run, are
    re-synced (and so re-labelled) before they serve."""
    if value == INITIAL_WEIGHT_VERSION:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def parse_generate_reply(reply: Any, *, url: str, rid: str, input_len: int,
                         return_logprob: bool, endpoint: str = "/generate",
                         return_routed_experts: bool = False) -> GenerateResult:
    """Check one non-streaming /generate reply against the contract and lift it into a result."""

    def bad(name: str, detail: str) -> MalformedReply:
        return MalformedReply(url, endpoint, name, detail)

    if not isinstance(reply, dict):
        raise bad("<body>", f"reply is a {type(reply).__name__}, expected a JSON object "
                            "(one prompt per request)")
    output_ids = reply.get("output_ids")
    if not isinstance(output_ids, list) or not all(is_int(t) for t in output_ids):
        raise bad("output_ids", f"reply lacks output_ids as a list of ints (got {short_repr(output_ids)})")
    meta = reply.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("meta_info", f"reply lacks meta_info (got {short_repr(meta)})")

    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise bad("meta_info.finish_reason", "meta_info.finish_reason must be an object with type in "
                  f"{'|'.join(FINISH_TYPES)} (got {short_repr(finish)})")

    version = meta.get("weight_version")
    if version is None:
        raise bad("meta_info.weight_version", "reply lacks meta_info.weight_version")
    spans = None
    if meta.get("weight_versions") is not None:
        spans = _parse_spans(meta["weight_versions"], bad)

    logprobs = None
    if return_logprob:
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise bad("meta_info.output_token_logprobs", "reply lacks meta_info.output_token_logprobs "
                      "(asked with return_logprob=true)")
        if not isinstance(entries, list) or len(entries) != len(output_ids):
            raise bad("meta_info.output_token_logprobs",
                      f"meta_info.output_token_logprobs has {describe_len(entries)} entries for "
                      f"{len(output_ids)} output_ids")
        logprobs = []
        for i, (entry, token) in enumerate(zip(entries, output_ids)):
            # Each entry is SGLang's (logprob, token_id, text|None) tuple, a list in JSON.
            if (not isinstance(entry, (list, tuple)) or len(entry) < 2 or not is_number(entry[0])
                    or not is_int(entry[1])):
                raise bad(f"meta_info.output_token_logprobs[{i}]",
                          f"meta_info.output_token_logprobs[{i}] must be [logprob, token_id, text], "
                          f"got {short_repr(entry)}")
            if entry[1] != token:
                raise bad(f"meta_info.output_token_logprobs[{i}]",
                          f"meta_info.output_token_logprobs[{i}] is for token {entry[1]} but "
                          f"output_ids[{i}] is {token}")
            logprobs.append(float(entry[0]))

    counts = {}
    for name, default in (("prompt_tokens", input_len), ("completion_tokens", len(output_ids)),
                          ("cached_tokens", 0)):
        # SGLang omits prompt_tokens and cached_tokens on a request aborted while still waiting
        # (tokenizer_manager.py 3602-3628): the defaults are what they must be then.
        value = meta.get(name, default)
        if not is_int(value):
            raise bad(f"meta_info.{name}", f"meta_info.{name} must be an int, got {short_repr(value)}")
        counts[name] = int(value)

    routes = None
    raw_routes = meta.get("routed_experts") if return_routed_experts else None
    if raw_routes is not None:
        rows = counts["prompt_tokens"] + counts["completion_tokens"] - 1
        if not isinstance(raw_routes, str):
            raise bad("meta_info.routed_experts", f"meta_info.routed_experts must be a base64 string, got "
                      f"{short_repr(raw_routes)}")
        try:
            routes = decode_routes(raw_routes, rows)
        except ValueError as error:  # binascii.Error is a ValueError
            raise bad("meta_info.routed_experts", f"meta_info.routed_experts: {error}") from error

    text = reply.get("text", "")
    return GenerateResult(
        rid=str(meta.get("id", rid)), output_ids=[int(t) for t in output_ids], output_logprobs=logprobs,
        finish_reason=finish["type"], finish_matched=finish.get("matched"),
        finish_message=finish.get("message"), weight_version=str(version),
        weight_version_spans=spans, text=text if isinstance(text, str) else "", engine_url=url,
        meta_info=meta, routed_experts=routes, **counts)


def _parse_spans(raw: Any, bad) -> List[WeightVersionSpan]:
    if not isinstance(raw, list):
        raise bad("meta_info.weight_versions", f"meta_info.weight_versions must be a list, got {short_repr(raw)}")
    spans = []
    for i, span in enumerate(raw):
        if (not isinstance(span, dict) or "version" not in span or not is_int(span.get("start"))
                or not is_int(span.get("end"))):
            raise bad(f"meta_info.weight_versions[{i}]", f"meta_info.weight_versions[{i}] must be "
                      f"{{version, start, end}}, got {short_repr(span)}")
        spans.append(WeightVersionSpan(str(span["version"]), int(span["start"]), int(span["end"])))
    return spans


def parse_input_logprobs(item: Any, *, url: str, ids: List[int], start: int, what: str = "/generate") -> List[float]:
    """The teacher-forced logprob of each token `ids[start + 1:]` from one item of a scoring reply
    (`/generate` with `return_logprob`, `logprob_start_len=start`): `meta_info.input_token_logprobs`
    holds [[logprob|null, token_id, text|null], ...] for positions start … end, the first always null
    (no logits before it), so it is checked and dropped. Raises MalformedReply naming what is wrong."""
    entries = (item.get("meta_info") or {}).get("input_token_logprobs") if isinstance(item, dict) else None
    expect = ids[start:]
    if not isinstance(entries, list) or len(entries) != len(expect):
        raise MalformedReply(url, what, "meta_info.input_token_logprobs",
                             f"meta_info.input_token_logprobs has {describe_len(entries)} entries, expected {len(expect)} "
                             f"(logprob_start_len={start} of {len(ids)} tokens)")
    if any(not isinstance(e, (list, tuple)) or len(e) < 2 for e in entries):
        raise MalformedReply(url, what, "meta_info.input_token_logprobs", "meta_info.input_token_logprobs entries must be [logprob, token_id, ...]")
    got = [e[1] for e in entries]
    if got != expect:
        raise MalformedReply(url, what, "meta_info.input_token_logprobs",
                             f"meta_info.input_token_logprobs scores ids {short_repr(got)}, sent {short_repr(expect)}")
    values = [e[0] for e in entries[1:]]
    if not all(is_number(v) for v in values):
        raise MalformedReply(url, what, "meta_info.input_token_logprobs", f"meta_info.input_token_logprobs holds non-numeric logprobs {short_repr(values)}")
    return [float(v) for v in values]


def parse_input_top_logprobs(item: Any, *, url: str, ids: List[int], start: int, k: int,
                             what: str = "/generate") -> tuple[List[List[int]], List[List[float]]]:
    """The k most likely tokens and their teacher-forced logprobs at each position predicting
    `ids[start + 1:]`, from one item of a scoring reply asked with `top_logprobs_num=k`:
    `meta_info.input_top_logprobs` holds, for positions start … end, null first (no logits before
    it), then k [logprob, token_id, text|null] each. Returns (ids, logprobs), one row of k per scored
    token. Raises MalformedReply naming what is wrong."""
    field = "meta_info.input_top_logprobs"
    entries = (item.get("meta_info") or {}).get("input_top_logprobs") if isinstance(item, dict) else None
    expect = len(ids) - start
    if not isinstance(entries, list) or len(entries) != expect:
        raise MalformedReply(url, what, field, f"{field} has {describe_len(entries)} entries, expected {expect} "
                             f"(logprob_start_len={start} of {len(ids)} tokens)")
    top_ids: List[List[int]] = []
    top_lps: List[List[float]] = []
    for position, row in enumerate(entries[1:], start=start + 1):
        if (not isinstance(row, list) or len(row) != k
                or any(not isinstance(e, (list, tuple)) or len(e) < 2 for e in row)):
            raise MalformedReply(url, what, field, f"{field} at position {position} must hold {k} "
                                 f"[logprob, token_id, ...] entries, got {short_repr(row)}")
        values, tokens = [e[0] for e in row], [e[1] for e in row]
        if not all(is_number(v) for v in values) or not all(is_int(t) and t >= 0 for t in tokens):
            raise MalformedReply(url, what, field, f"{field} at position {position} holds a non-numeric logprob "
                                 f"or a bad token id: {short_repr(row)}")
        top_ids.append([int(t) for t in tokens])
        top_lps.append([float(v) for v in values])
    return top_ids, top_lps
