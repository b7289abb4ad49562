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
                     (["distill.topk=2"], "distill.topk"),
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


# ---------------------------------------------------------------- top-K (distill.topk)
def topk_samples() -> list[Sample]:
    a = Sample(prompt_ids=[5, 6], response_ids=[7, 8], behavior_logprobs=[-1.0, -2.0], reward=1.0, group_id=0,
               teacher_logprobs=[-0.5, -2.5], teacher_topk_ids=[[7, 3], [1, 8]],
               teacher_topk_logprobs=[[-0.5, -1.5], [-0.25, -2.5]])
    b = Sample(prompt_ids=[5], response_ids=[4], behavior_logprobs=[-3.0], reward=0.0, group_id=0,
               teacher_logprobs=[-1.0], teacher_topk_ids=[[4, 2]], teacher_topk_logprobs=[[-1.0, -1.25]])
    return [a, b]


def test_topk_reverse_kl_against_numbers_worked_by_hand() -> None:
    from megatron_flash.losses import topk_reverse_kl

    # K = 1, student 0.5 / teacher 0.8 on the token: 0.5·ln(0.5/0.8) + 0.5·ln(0.5/0.2)
    got = topk_reverse_kl(torch.tensor([[0.5]]).log(), torch.tensor([[0.8]]).log())
    assert abs(float(got) - (0.5 * -0.4700036292457356 + 0.5 * 0.9162907318741551)) <= 1e-6
    # K = 2 of a 3-token vocabulary: the rest bucket is the third token, so it is the full reverse KL
    p, q = [0.2, 0.5, 0.3], [0.6, 0.3, 0.1]
    full = sum(pi * (torch.tensor(pi).log() - torch.tensor(qi).log()).item() for pi, qi in zip(p, q))
    got = topk_reverse_kl(torch.tensor(p[:2]).log(), torch.tensor(q[:2]).log())
    assert abs(float(got) - full) <= 1e-6


def test_topk_reverse_kl_gradient_matches_float64() -> None:
    """The gradient w.r.t. the student's K logprobs against autograd of the plain float64 formula."""
    from megatron_flash.losses import topk_reverse_kl

    g = torch.Generator().manual_seed(3)
    s = torch.log_softmax(torch.randn(4, 10, generator=g), -1)[:, :3].clone().requires_grad_()
    t = torch.log_softmax(torch.randn(4, 10, generator=g), -1)[:, :3]
    topk_reverse_kl(s, t).sum().backward()
    s64 = s.detach().double().requires_grad_()
    p, q = s64.exp(), t.double().exp()
    kl = (p * (s64 - t.double())).sum(-1) + (1 - p.sum(-1)) * ((1 - p.sum(-1)).log() - (1 - q.sum(-1)).log())
    kl.sum().backward()
    assert torch.allclose(s.grad.double(), s64.grad, atol=1e-5), (s.grad, s64.grad)


def test_teacher_topk_sits_on_the_response_tokens() -> None:
    from megatron_flash.recipes import teacher_topk

    s = topk_samples()
    batch = collate(s, pad_id=0, advantages=torch.tensor([0.5, -0.5]))
    ids, lps = teacher_topk(s, batch.loss_mask)
    assert ids.tolist() == [[[0, 0], [0, 0], [7, 3], [1, 8]], [[0, 0], [4, 2], [0, 0], [0, 0]]]
    assert lps[0, 3].tolist() == [-0.25, -2.5] and lps[1, 1].tolist() == [-1.0, -1.25] and lps[1, 2].tolist() == [0, 0]
    bare = Sample(prompt_ids=[5], response_ids=[4], behavior_logprobs=[-3.0])
    with pytest.raises(ValueError, match="sample 1 .*no teacher top-k"):
        teacher_topk([s[0], bare], collate([s[0], bare], pad_id=0).loss_mask)


def test_sample_checks_the_teacher_topk_rows() -> None:
    with pytest.raises(ValueError, match="top-k"):
        Sample(prompt_ids=[1], response_ids=[2, 3], behavior_logprobs=[-1.0, -1.0], teacher_topk_ids=[[1]],
               teacher_topk_logprobs=[[-1.0]])
    with pytest.raises(ValueError, match="same width"):
        Sample(prompt_ids=[1], response_ids=[2, 3], behavior_logprobs=[-1.0, -1.0], teacher_topk_ids=[[1], [1, 2]],
               teacher_topk_logprobs=[[-1.0], [-1.0, -2.0]])
    with pytest.raises(ValueError, match="without"):
        Sample(prompt_ids=[1], response_ids=[2], behavior_logprobs=[-1.0], teacher_topk_ids=[[1]])


@pytest.mark.parametrize("mode", ["add", "only"])
def test_in_the_loss_the_topk_reverse_kl_is_a_term_of_the_student_forward(mode: str) -> None:
    """With the teacher's top-k in the batch the loss is the policy loss (task advantage with add, none
    with only) plus coef · KL_t on each trained token; the KL's gradient reaches the K student logprobs."""
    from megatron_flash.losses import topk_reverse_kl
    from megatron_flash.recipes import teacher_topk
    from megatron_flash.trainer.loss_adapter import make_loss_fn

    s = topk_samples()
    batch = collate(s, pad_id=0, advantages=torch.tensor([0.5, -0.5]))
    ids, lps = teacher_topk(s, batch.loss_mask)
    batch = batch.replace(teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    current = torch.tensor([[0, 0, -0.5, -2.0], [0, -1.0, 0, 0]], requires_grad=True)
    student = torch.log(torch.tensor([[[.3, .3]] * 4, [[.1, .6]] * 4])).requires_grad_()
    fn = make_loss_fn(get_loss("reinforce"), distill=(2.0, mode))
    loss_sum, denominator, metrics = fn(batch, current, None, topk_logprobs=student)
    mask = batch.loss_mask
    kl = topk_reverse_kl(student.detach(), lps) * mask
    adv = batch.advantages if mode == "add" else torch.zeros_like(mask)
    want = (-adv * current.detach() * mask).sum() + 2.0 * kl.sum()
    assert int(denominator) == 3 and abs(float(loss_sum) - float(want)) <= 1e-5
    assert abs(float(metrics["distill/topk_reverse_kl"]) - float(kl.sum() / 3)) <= 1e-6
    loss_sum.backward()
    assert float(student.grad[0, 2].abs().sum()) > 0 and float(student.grad[0, 0].abs().sum()) == 0  # trained only
    with pytest.raises(ValueError, match="topk_logprobs"):
        fn(batch, current, None)


def test_topk_config_rules() -> None:
    assert load_config(None, ["distill.teacher=/t", "distill.topk=8"]).distill.topk == 8
    for bad in (["distill.topk=8"], ["distill.teacher=/t", "distill.topk=-1"],
                ["distill.teacher=/t", "distill.topk=4", "distill.student_logprobs=behavior"],
                ["distill.teacher=/t", "distill.student_logprobs=behavior"]):  # the default K needs the forward
        with pytest.raises(ValueError, match=r"distill\.topk"):
            load_config(None, bad)


def test_distillation_defaults_to_top_k_and_refuses_the_sampled_estimate_on_stale_samples() -> None:
    """The defaults are the safe setting: top-4 at the default α = 2. topk=0 (k_t alone, which collapsed
    on stale samples) runs at α = 0, or at α > 0 only when allowed explicitly; the allowance itself is
    refused where nothing uses it."""
    on = load_config(None, ["distill.teacher=/t", "distill.mode=only"])
    assert on.distill.topk == 4 and on.async_rl.alpha == 2 and not on.distill.allow_sampled_estimate
    with pytest.raises(ValueError, match=r"^distill.topk=0 \(the sampled-token estimate alone\) is refused at "
                                         r"async_rl.alpha=2: .*distill.allow_sampled_estimate=true to measure it"):
        load_config(None, ["distill.teacher=/t", "distill.topk=0"])
    assert load_config(None, ["distill.teacher=/t", "distill.topk=0", "async_rl.alpha=0"]).distill.topk == 0
    allowed = load_config(None, ["distill.teacher=/t", "distill.topk=0", "distill.allow_sampled_estimate=true"])
    assert allowed.distill.allow_sampled_estimate and allowed.distill.topk == 0
    behavior = load_config(None, ["distill.teacher=/t", "distill.topk=0", "distill.student_logprobs=behavior",
                                  "async_rl.alpha=0"])
    assert behavior.distill.student_logprobs == "behavior"
    for unused in (["distill.teacher=/t", "distill.allow_sampled_estimate=true"],
                   ["distill.teacher=/t", "distill.topk=0", "async_rl.alpha=0", "distill.allow_sampled_estimate=true"],
                   ["distill.allow_sampled_estimate=true"]):
        with pytest.raises(ValueError, match=r"distill\.allow_sampled_estimate"):
            load_config(None, unused)


def test_top_logprobs_reply_is_checked() -> None:
    from megatron_flash.engines.client_base import MalformedReply
    from megatron_flash.engines.client_replies import parse_input_top_logprobs

    ids = [1, 2, 3, 4]
    good = {"meta_info": {"input_top_logprobs": [None, [[-0.1, 3, None], [-2.0, 5, None]],
                                                 [[-0.3, 4, None], [-1.5, 1, None]]]}}
    assert parse_input_top_logprobs(good, url="u", ids=ids, start=1, k=2) == ([[3, 5], [4, 1]], [[-0.1, -2.0], [-0.3, -1.5]])
    with pytest.raises(MalformedReply, match="3 entries"):
        parse_input_top_logprobs(good, url="u", ids=ids, start=0, k=2)
    with pytest.raises(MalformedReply, match="position 2 must hold 3"):
        parse_input_top_logprobs(good, url="u", ids=ids, start=1, k=3)
    bad = {"meta_info": {"input_top_logprobs": [None, [[None, 3, None], [-2.0, 5, None]], [[-0.3, 4], [-1.5, 1]]]}}
    with pytest.raises(MalformedReply, match="non-numeric"):
        parse_input_top_logprobs(bad, url="u", ids=ids, start=1, k=2)


def test_local_engine_answers_top_logprobs_for_scoring_requests_only() -> None:
    from types import SimpleNamespace

    from megatron_flash.engines.generate_request import parse_generate

    engine = SimpleNamespace(vocab_size=32, tokenizer=None, validate=lambda ids, spec: None, has_request=lambda r: False,
                             adapter_for_request=lambda name: None)  # serves the base model, no adapter
    item = parse_generate(engine, {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 1,
                                   "top_logprobs_num": 4, "sampling_params": {"max_new_tokens": 1}})[0]
    assert item["top_logprobs_num"] == 4
    with pytest.raises(ValueError, match="scoring requests only"):
        parse_generate(engine, {"input_ids": [1, 2, 3], "top_logprobs_num": 4, "sampling_params": {"max_new_tokens": 8}})
    with pytest.raises(ValueError, match="top_logprobs_num must be"):
        parse_generate(engine, {"input_ids": [1, 2, 3], "top_logprobs_num": -1, "sampling_params": {"max_new_tokens": 1}})
