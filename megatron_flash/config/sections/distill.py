"""On-policy distillation from a teacher (`distill`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List

from megatron_flash.config.sections.base import _Section

DISTILL_MODES = ("add", "only")
DEFAULT_DISTILL_TOPK = 4
"""distill.topk's default: the teacher's K most likely tokens per position (docs/benchmarks.md, the K sweep)."""
DISTILL_STUDENT_LOGPROBS = ("current", "behavior")


@dataclass
class DistillConfig(_Section):
    """On-policy distillation (OPD): a teacher scores the student's own sampled tokens, and the per-token
    reverse-KL estimate k_t = log π_student(y_t) − log π_teacher(y_t) enters the advantage:
    Â_t = A_t − coef · k_t with mode=add, −coef · k_t alone with mode=only (losses/distill.py). Off
    while `teacher` is empty."""

    _section: ClassVar[str] = "distill"

    teacher: str = ""
    """The teacher checkpoint (HF dir or Hub id); it must share the student's tokenizer. Launched as
    its own engines (the student's engines.backend, local or sglang) unless `urls` lists running ones."""
    urls: List[str] = field(default_factory=list)
    """Base URLs of teacher engines already serving `teacher` (attached); empty = launch them here."""
    coef: float = 1.0
    """λ: weight of the per-token reverse-KL term in the advantage."""
    mode: str = "add"
    """add (the KL term added to the task advantage) | only (the KL term alone; rewards are still
    computed and logged)."""
    student_logprobs: str = "current"
    """current (log π_student from the training forward, the policy being trained; no extra forward) |
    behavior (the student engine's logprob when it sampled the token, up to async_rl.alpha versions
    old: at α = 2 it pushed a sort4 student into ending its answers early)."""
    topk: int = DEFAULT_DISTILL_TOPK
    """K > 0 (the default): the teacher scores its K most likely tokens at every response position too
    (SGLang `top_logprobs_num`; the local engine answers it on its scoring requests), and the loss gains
    coef · the reverse KL over those K tokens plus the rest of the vocabulary, from the training forward
    (losses/distill.py); the task advantage stays (add) or is dropped (only). Needs
    student_logprobs=current. 0: only the sampled-token estimate k_t in the advantage (above), which
    collapses on stale samples (measured on sort4: the student's reward fell to 0 at async_rl.alpha >= 1
    while top-K learned; docs/benchmarks.md), so at alpha > 0 it needs allow_sampled_estimate."""
    allow_sampled_estimate: bool = False
    """Run topk=0 (the sampled-token estimate alone) at async_rl.alpha > 0 anyway, as loss.allow_uncorrected
    does for an uncorrected loss: measuring it is the only reason to."""
    num_engines: int = 1
    """Teacher engines to launch; with urls, the length of urls."""
    base_port: int = 31000
    """Port of launched teacher engine 0; engine i listens on base_port + i."""
    server_args: Dict[str, Any] = field(default_factory=dict)
    """Flags for the launched teacher engines, as engines.server_args is for the student's."""

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)

    def validate(self) -> None:
        self._one_of("mode", DISTILL_MODES)
        self._one_of("student_logprobs", DISTILL_STUDENT_LOGPROBS)
        self._positive("coef")
        self._at_least("num_engines", 1)
        self._at_least("topk", 0)
        self._require(not (self.topk and self.student_logprobs != "current"), "topk",
                      "must be 0 with distill.student_logprobs=behavior: the top-K reverse KL is taken from the "
                      "training forward (student_logprobs=behavior has only the sampled token's logprob)")
        self._require(1 <= self.base_port and self.base_port + self.num_engines - 1 <= 65535, "base_port",
                      f"must leave room for distill.num_engines={self.num_engines} ports in 1..65535")
        if not self.enabled:
            for name, default in (("urls", []), ("coef", 1.0), ("mode", "add"), ("student_logprobs", "current"),
                                  ("topk", DEFAULT_DISTILL_TOPK), ("allow_sampled_estimate", False),
                                  ("num_engines", 1), ("base_port", 31000), ("server_args", {})):
                if getattr(self, name) != default:
                    raise ValueError(f"distill.{name} is set but distill.teacher is empty: distillation is off "
                                     "(set distill.teacher to the teacher checkpoint)")
            return
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"distill.urls entries must start with http:// or https://, got {url!r}")
        if self.urls:
            self._require(len(self.urls) == self.num_engines, "num_engines",
                          f"must equal len(distill.urls)={len(self.urls)} (set both)")
            self._require(not self.server_args, "server_args",
                          "must be empty with distill.urls (pass flags where the teacher servers start)")
