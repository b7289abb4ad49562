"""On-policy distillation pieces: the advantage against numbers worked by hand (from the engine's
logprobs, and from the training forward inside the loss), the teacher logprobs' layout, the metrics,
the config rules and the tokenizer check."""

from __future__ import annotations

import pytest
import torch

from megatron_flash.config import load_config
from megatron_flash.losses import distill_advantages, get_loss
from megatron_flash.recipes import distill_metrics, teacher_logprobs
from megatron_flash.rollout.teacher import check_same_tokenizer
from megatron_flash.types import Sample, collate


def samples() -> list[Sample]:
    a = Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], behavior_logprobs=[-1.0, -2.0, -0.5], reward=1.0,
               group_id=0, teacher_logprobs=[-0.5, -2.5, -0.5])
    b = Sample(prompt_ids=[5], response_ids=[4, 3], behavior_logprobs=[-3.0, -0.25], reward=0.0, group_id=0,
               teacher_logprobs=[-1.0, -0.75])
    return [a, b]


def test_teacher_logprobs_sit_on_the_response_tokens() -> None:
    s = samples()
    batch = collate(s, pad_id=0, advantages=torch.tensor([0.5, -0.5]))
    got = teacher_logprobs(s, batch.loss_mask)
    assert got.tolist() == [[0, 0, -0.5, -2.5, -0.5], [0, -1.0, -0.75, 0, 0]]


@pytest.mark.parametrize("mode", ["add", "only"])
def test_advantage_is_the_task_advantage_minus_coef_times_the_reverse_kl(mode: str) -> None:
    s = samples()
    batch = collate(s, pad_id=0, advantages=torch.tensor([0.5, -0.5]))
    got = distill_advantages(advantages=batch.advantages, student_logprobs=batch.behavior_logprobs,
                             teacher_logprobs=teacher_logprobs(s, batch.loss_mask), loss_mask=batch.loss_mask,
                             coef=2.0, mode=mode)
    # k = log μ − log π_teacher per token: a: (−0.5, 0.5, 0), b: (−2, 0.5); Â = A − 2k (add) or −2k (only)
    a, b = (0.5, -0.5) if mode == "add" else (0.0, 0.0)
    want = [[0, 0, a + 1.0, a - 1.0, a + 0.0], [0, b + 4.0, b - 1.0, 0, 0]]
    assert torch.allclose(got, torch.tensor(want), atol=1e-6), got


def test_a_sample_without_teacher_logprobs_is_named() -> None:
    s = samples()
    s[1].teacher_logprobs = None
    batch = collate(s, pad_id=0)
    with pytest.raises(ValueError, match="sample 1"):
        teacher_logprobs(s, batch.loss_mask)


def test_metrics_average_over_model_tokens() -> None:
    s = samples()
    s[1].response_mask = [1, 0]  # the second token of b is an observation: not the model's
    got = distill_metrics(s)
    # tokens: a (−1 vs −.5), (−2 vs −2.5), (−.5 vs −.5), b (−3 vs −1) → k = −.5, .5, 0, −2
    assert got["distill/reverse_kl"] == pytest.approx(-2.0 / 4)
    assert got["distill/teacher_logprob"] == pytest.approx((-0.5 - 2.5 - 0.5 - 1.0) / 4)
    assert distill_metrics([Sample(prompt_ids=[1], response_ids=[2], behavior_logprobs=[-1.0])]) == {}


def test_sample_checks_the_teacher_logprob_count() -> None:
    with pytest.raises(ValueError, match="teacher logprobs"):
        Sample(prompt_ids=[1], response_ids=[2, 3], behavior_logprobs=[-1.0, -1.0], teacher_logprobs=[-1.0])


def test_config_rules() -> None:
    on = load_config(None, ["distill.teacher=/t", "distill.coef=0.5", "distill.mode=only"])
    assert on.distill.enabled and on.distill.coef == 0.5
    assert not load_config(None, []).distill.enabled
    for bad, key in ((["distill.coef=0.5"], "distill.coef"), (["distill.teacher=/t", "distill.mode=mix"], "distill.mode"),
                     (["distill.teacher=/t", "distill.coef=0"], "distill.coef"),
                     (["distill.teacher=/t", "distill.student_logprobs=engine"], "distill.student_logprobs"),
                     (["distill.student_logprobs=behavior"], "distill.student_logprobs"),
                     (["distill.teacher=/t", "distill.urls=[http://a:1,http://b:2]"], "distill.num_engines"),
                     (["distill.teacher=/t", "distill.urls=[http://a:1]", "distill.server_args={x: 1}"],
                      "distill.server_args"),
                     (["distill.teacher=/t", "agentic.env=frozenlake"], "distill.teacher"),
                     (["distill.teacher=/t", "engines.backend=attach", "engines.urls=[http://e:1]"], "distill.urls")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_config(None, bad)


class Tok:
    def __init__(self, vocab: dict[str, int], eos: int = 1) -> None:
        self.vocab, self.eos_token_id, self.bos_token_id, self.pad_token_id = vocab, eos, None, 0

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_tokenizer_check_names_both_checkpoints() -> None:
    check_same_tokenizer(Tok({"a": 0, "b": 1}), Tok({"a": 0, "b": 1}), student_path="S", teacher_path="T")
    with pytest.raises(ValueError, match="'T'.*'S'"):
        check_same_tokenizer(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}), student_path="S", teacher_path="T")
    with pytest.raises(ValueError, match="eos_token_id"):
        check_same_tokenizer(Tok({"a": 0}), Tok({"a": 0}, eos=0), student_path="S", teacher_path="T")


@pytest.mark.parametrize("mode", ["add", "only"])
def test_in_the_loss_the_reverse_kl_is_taken_against_the_training_forward(mode: str) -> None:
    """distill.student_logprobs=current: the loss adapter forms Â_t from the logprobs of its own forward
    (detached), not from the engine's μ. With reinforce (per-token loss −Â·log π, token mean) the
    gradient on each trained token's logprob is −Â_t / (trained tokens)."""
    from megatron_flash.trainer.loss_adapter import make_loss_fn

    s = samples()
    batch = collate(s, pad_id=0, advantages=torch.tensor([0.5, -0.5]))
    batch = batch.replace(teacher_logprobs=teacher_logprobs(s, batch.loss_mask))
    current = torch.tensor([[0, 0, -0.5, -2.0, -1.5], [0, -1.0, -0.25, 0, 0]], requires_grad=True)
    fn = make_loss_fn(get_loss("reinforce"), distill=(2.0, mode))
    loss_sum, denominator, _ = fn(batch, current, None)
    (loss_sum / denominator).backward()
    # k = log π_current − log π_teacher: a (0, 0.5, −1), b (0, 0.5); Â = A − 2k (add) or −2k (only)
    a, b = (0.5, -0.5) if mode == "add" else (0.0, 0.0)
    want = torch.tensor([[0, 0, a - 0.0, a - 1.0, a + 2.0], [0, b - 0.0, b - 1.0, 0, 0]])
    assert int(denominator) == 5
    assert torch.allclose(current.grad, -want / 5, atol=1e-6), current.grad
    with pytest.raises(ValueError, match="distill"):  # teacher logprobs but no distill settings: refused
        make_loss_fn(get_loss("reinforce"))(batch, current, None)
