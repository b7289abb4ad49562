"""Finished groups as JSON lines (rollout.dump_path, rollout-only runs) and reading them back for
trainer.replay_path: every sample field, MoE routes compressed."""

from __future__ import annotations

import json
import os
import threading

from megatron_flash.types import Group, decode_routes, encode_routes


class GroupDump:
    """Finished groups as JSON lines (rollout-only mode, or rollout.dump_path): replayable."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._f = open(path, "a")
        self._lock = threading.Lock()

    def write(self, group: Group) -> None:
        record = {"group_id": group.group_id, "prompt_index": group.prompt_index,
                  "version_start": group.version_start,
                  "samples": [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                               "behavior_logprobs": s.behavior_logprobs, "reward": s.reward,
                               "finished": s.finished, "finish_reason": s.finish_reason,
                               "version_start": s.version_start, "version_end": s.version_end,
                               "token_versions": s.token_versions, "response_mask": s.response_mask,
                               **({} if s.teacher_logprobs is None else {"teacher_logprobs": s.teacher_logprobs}),
                               **({} if s.teacher_topk_ids is None else {"teacher_topk_ids": s.teacher_topk_ids,
                                                                         "teacher_topk_logprobs": s.teacher_topk_logprobs}),
                               **({} if s.routed_experts is None else
                                  {"routed_experts": encode_routes(s.routed_experts),
                                   "routed_experts_width": int(s.routed_experts.shape[1])})}
                              for s in group.samples]}
        with self._lock:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def _routes_decoded(sample: dict) -> dict:
    if "routed_experts" not in sample:
        return sample
    rows = len(sample["prompt_ids"]) + len(sample["response_ids"]) - 1
    width = sample.pop("routed_experts_width")
    routes = decode_routes(sample["routed_experts"], rows)
    if routes.shape[1] != width:
        raise ValueError(f"routed_experts has {routes.shape[1]} ids per token, the record says {width}")
    return {**sample, "routed_experts": routes}


def read_group_dump(path: str) -> list[Group]:
    """Groups written by GroupDump; a malformed line names the file and line number."""
    from megatron_flash.types import Sample

    if not os.path.isfile(path):
        raise FileNotFoundError(f"trainer.replay_path: no such file {path!r}")
    groups = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                samples = [Sample(group_id=rec["group_id"], prompt_index=rec["prompt_index"], **_routes_decoded(s))
                           for s in rec["samples"]]
                groups.append(Group(group_id=rec["group_id"], prompt_index=rec["prompt_index"], samples=samples,
                                    version_start=rec["version_start"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a dumped group ({type(e).__name__}: {e})") from e
    return groups
