"""One engine request as the proxy sees it, from dispatch (an engine slot taken, the HTTP call sent) to
its reply: its interval in `trace.ACTIVITY` always (the `pipeline/overlap` metric), and with
logging.trace a span on its engine's track (trace.py). The span's name says how it ended —
`request stop|length|abort|error|cancelled`, `resumed request …` for the continuation of an aborted
sample, `… retracted` when the engine retracted it during a push — and its args carry the rid, the
caller's tags (prompt index, start version, resume count: `trace.tag_requests`), the weight versions at
dispatch and at reply, output tokens and the abort or error message.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from megatron_flash.trace import ACTIVITY, REQUEST_TAGS, TRACER


class RequestWatch:
    __slots__ = ("token", "handle")

    def __init__(self, track: str, rid: str, *, num_samples: int, weight_version: Optional[str],
                 queued_ns: int, activity: bool = True) -> None:
        self.token = ACTIVITY.begin() if activity else None
        self.handle = None
        if TRACER.enabled:
            args: dict[str, Any] = {"rid": rid, **(REQUEST_TAGS.get() or {}),
                                    "weight_version_at_dispatch": weight_version, "queued_ms": round(queued_ns / 1e6, 3)}
            if num_samples > 1:
                args["n"] = num_samples
            self.handle = TRACER.begin("request", "engine", track, **args)

    def close(self, result: Any = None, *, error: Optional[BaseException] = None) -> None:
        """The reply (a GenerateResult or a list of them) or the error that ended the request."""
        if self.token is not None:
            ACTIVITY.end(self.token)
        if self.handle is None:
            return
        args = outcome(result, error)
        name = f"request {args['finish']}" + (" retracted" if args.get("retractions") else "")
        if self.handle.args.get("resume"):
            name = "resumed " + name
        TRACER.end(self.handle, name=name, **args)


def outcome(result: Any, error: Optional[BaseException]) -> dict[str, Any]:
    if error is not None:
        cancelled = isinstance(error, asyncio.CancelledError)
        return {"finish": "cancelled" if cancelled else "error",
                **({} if cancelled else {"error": f"{type(error).__name__}: {error}"[:300]})}
    results = result if isinstance(result, list) else [result]
    finishes = sorted({r.finish_reason for r in results})
    out: dict[str, Any] = {"finish": "+".join(finishes), "output_tokens": sum(len(r.output_ids) for r in results),
                           "weight_version_at_reply": results[0].weight_version if results else None}
    spans = [v for r in results for v in (r.span_versions() or []) if v is not None]
    if spans and min(spans) != max(spans):  # its tokens came from two or more weight versions
        out["token_versions"] = f"{min(spans)}..{max(spans)}"
    retractions = sum(int(r.meta_info.get("num_retractions") or 0) for r in results)
    if retractions:
        out["retractions"] = retractions
    aborted = [r.finish_message for r in results if r.aborted and r.finish_message]
    if aborted:
        out["abort_message"] = aborted[0][:300]
    return out
