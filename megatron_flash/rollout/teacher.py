"""On-policy distillation's teacher on the rollout side (`distill.teacher`).

The student samples its own response; the moment it ends (beside its reward), the teacher engines
score exactly those tokens, teacher-forced: one `/generate` with `return_logprob`, `logprob_start_len`
= prompt length − 1 and no new tokens worth keeping (SGLang's prompt-logprob scoring), sent through
an `LLMProxy` of the teacher engines, so retries, health and take-outs are the student proxy's. The
logprobs travel with the sample (`Sample.teacher_logprobs`) through the buffer, dumps and checkpoints;
the trainer turns them into the advantage (losses/distill.py).

    prompt p_1..p_P, response y_1..y_R  →  send p_1..p_P y_1..y_R, logprob_start_len = P − 1
    ←  input_token_logprobs for positions P−1 … P+R−1: the first is null (no logits before it), the
       rest are log π_teacher(y_t | p, y_<t), t = 1..R

With `distill.topk` = K > 0 the same request asks `top_logprobs_num` = K: `input_top_logprobs`
adds, per response token, the teacher's K most likely tokens and their logprobs
(`Sample.teacher_topk_ids` / `teacher_topk_logprobs`, [R][K]), what the trainer's top-K reverse KL
needs (losses/distill.py).

Teacher and student must share a tokenizer (`check_same_tokenizer`): the teacher scores the
student's token ids as they are.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


class TeacherScorer:
    """`await score(prompt_ids, response_ids)` → (log π_teacher of each response token, and with
    `top_k` > 0 the teacher's top-k ids and logprobs per response token, else None, None)."""

    def __init__(self, proxy: Any, *, top_k: int = 0) -> None:
        self.proxy = proxy
        self.top_k = top_k
        self.requests = 0
        self.tokens = 0

    async def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int], *, rid: str
                    ) -> tuple[list[float], Optional[list[list[int]]], Optional[list[list[float]]]]:
        if not response_ids:
            return [], ([] if self.top_k else None), ([] if self.top_k else None)
        values, top_ids, top_lps = await self.proxy.score_top(list(prompt_ids) + list(response_ids),
                                                              start=len(prompt_ids), k=self.top_k, rid=rid)
        if len(values) != len(response_ids) or (self.top_k and len(top_ids) != len(response_ids)):
            # the proxy's parser checked the ids; this is a contract guard
            raise RuntimeError(f"teacher scoring {rid}: {len(values)} logprobs and {len(top_ids)} top-k rows for "
                               f"{len(response_ids)} tokens")
        self.requests += 1
        self.tokens += len(values)
        return values, (top_ids if self.top_k else None), (top_lps if self.top_k else None)


def check_same_tokenizer(student: Any, teacher: Any, *, student_path: str, teacher_path: str) -> None:
    """Refuse a teacher whose tokenizer maps any token differently (or has other special tokens):
    it would score ids that mean something else to it. ValueError names both checkpoints."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab.items()) - set(t_vocab.items()))[:3]
        only_t = sorted(set(t_vocab.items()) - set(s_vocab.items()))[:3]
        raise ValueError(
            f"distill.teacher={teacher_path!r} does not share the student's tokenizer (model.hf_path="
            f"{student_path!r}): vocabularies of {len(t_vocab)} and {len(s_vocab)} tokens differ, e.g. student "
            f"{only_s} vs teacher {only_t}; on-policy distillation scores the student's token ids as they are")
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            raise ValueError(
                f"distill.teacher={teacher_path!r} and model.hf_path={student_path!r} have the same vocabulary but "
                f"different {name} ({getattr(teacher, name, None)} vs {getattr(student, name, None)})")
