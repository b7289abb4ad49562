"""MoE routes through the pure pieces: SGLang's wire format, samples, collate, the micro-batch layout
the routers see, group dumps, the client's reply checks, config and launcher switches."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from megatron_flash.config import load_config
from megatron_flash.engines.client import MalformedReply, parse_generate_reply
from megatron_flash.engines.launcher import EngineLauncher
from megatron_flash.rollout.group_dump import GroupDump, read_group_dump
from megatron_flash.trainer.micro_batches import BatchingOptions, build_micro_batches
from megatron_flash.trainer.routing_replay import fill_unrouted
from megatron_flash.types import Group, Sample, collate, decode_routes, encode_routes


def sglang_b64(routes: np.ndarray) -> str:
    """What SGLang sends: the int32 array's little-endian bytes, base64 (written independently)."""
    return base64.b64encode(routes.astype("<i4").tobytes()).decode()


def sample(prompt: int, response: int, seed: int, width: int = 4) -> Sample:
    gen = torch.Generator().manual_seed(seed)
    rows = prompt + response - 1
    return Sample(prompt_ids=list(range(1, prompt + 1)), response_ids=list(range(10, 10 + response)),
                  behavior_logprobs=[-1.0] * response,
                  routed_experts=torch.randint(0, 8, (rows, width), generator=gen).to(torch.uint8))


def test_decode_matches_sglang_layout_and_round_trips() -> None:
    routes = np.arange(5 * 2 * 3).reshape(5, 2, 3) * 11  # [rows, layers, top_k], ids past 255
    got = decode_routes(sglang_b64(routes), 5)
    assert got.dtype == torch.int16 and got.tolist() == routes.reshape(5, 6).tolist()
    assert decode_routes(encode_routes(got), 5).tolist() == got.tolist()
    assert decode_routes(sglang_b64(routes % 8), 5).dtype == torch.uint8


def test_decode_rejects_a_length_that_is_not_whole_rows() -> None:
    with pytest.raises(ValueError, match="not a whole number of rows for 4 tokens"):
        decode_routes(sglang_b64(np.zeros(10)), 4)


def test_sample_checks_the_route_rows() -> None:
    with pytest.raises(ValueError, match=r"routed_experts must be \[4, layers \* top_k\]"):
        Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], behavior_logprobs=[0.0] * 3,
               routed_experts=torch.zeros(5, 4, dtype=torch.uint8))


def test_collate_aligns_routes_with_tokens_and_needs_them_all() -> None:
    a, b = sample(3, 4, 0), sample(2, 2, 1)
    batch = collate([a, b], pad_id=0)
    assert batch.routed_experts.shape == (2, 7, 4)
    assert torch.equal(batch.routed_experts[0, :6], a.routed_experts)
    assert torch.equal(batch.routed_experts[1, :3], b.routed_experts)
    assert int(batch.routed_experts[1, 3:].abs().sum()) == 0
    bare = Sample(prompt_ids=[1], response_ids=[2], behavior_logprobs=[0.0])
    with pytest.raises(ValueError, match="sample 1 .* has no routed_experts"):
        collate([a, bare], pad_id=0)


@pytest.mark.parametrize("pack", [True, False])
def test_micro_batches_lay_routes_out_like_the_tokens(pack: bool) -> None:
    samples = [sample(3, 4, 0), sample(2, 2, 1), sample(4, 1, 2)]
    batch = collate(samples, pad_id=0)
    micro = build_micro_batches(batch, BatchingOptions(pack=pack, micro_batch_size=2), dp_rank=0, dp_size=1,
                                device=torch.device("cpu"))
    seen = 0
    for m in micro:
        assert m.routes.shape[:2] == m.tokens.shape and m.routed.shape == m.tokens.shape
        # Every position holding a sample's token t (not its last) carries that sample's route
        # row t; nothing else is marked routed.
        if pack:
            offset = 0
            for i in m.sample_ids.tolist():
                s = samples[i]
                n = len(s.prompt_ids) + len(s.response_ids)
                assert m.tokens[0, offset:offset + n].tolist() == s.prompt_ids + s.response_ids
                assert torch.equal(m.routes[0, offset:offset + n - 1], s.routed_experts.to(m.routes.dtype))
                assert m.routed[0, offset:offset + n].tolist() == [True] * (n - 1) + [False]
                offset += n
                seen += 1
            assert not bool(m.routed[0, offset:].any())
        else:
            for row, i in enumerate(m.sample_ids.tolist()):
                if i < 0:
                    assert not bool(m.routed[row].any())
                    continue
                s = samples[i]
                n = len(s.prompt_ids) + len(s.response_ids)
                assert torch.equal(m.routes[row, :n - 1], s.routed_experts.to(m.routes.dtype))
                assert m.routed[row].tolist() == [True] * (n - 1) + [False] * (m.tokens.shape[1] - n + 1)
                seen += 1
    assert seen == 3


def test_unrouted_positions_get_distinct_experts_per_layer() -> None:
    routes = torch.tensor([[[5, 6, 7, 1], [5, 6, 7, 1]]])
    out = fill_unrouted(routes, torch.tensor([[True, False]]), top_k=2)
    assert out.tolist() == [[[5, 6, 7, 1], [0, 1, 0, 1]]]


def test_group_dump_keeps_routes(tmp_path) -> None:
    path = str(tmp_path / "groups.jsonl")
    s = sample(3, 2, 0)
    dump = GroupDump(path)
    dump.write(Group(group_id=4, prompt_index=9, samples=[s], version_start=1))
    dump.close()
    (group,) = read_group_dump(path)
    assert torch.equal(group.samples[0].routed_experts, s.routed_experts)


def reply(routes_field, *, prompt: int = 3, output=(7, 8)) -> dict:
    meta = {"id": "r", "finish_reason": {"type": "length"}, "weight_version": "0", "prompt_tokens": prompt,
            "completion_tokens": len(output), "output_token_logprobs": [[-1.0, t, None] for t in output]}
    if routes_field is not None:
        meta["routed_experts"] = routes_field
    return {"output_ids": list(output), "meta_info": meta}


def test_client_lifts_routes_only_when_asked_and_checks_them() -> None:
    good = sglang_b64(np.arange(4 * 2 * 2).reshape(4, 2, 2) % 8)
    kw = dict(url="http://e:1", rid="r", input_len=3, return_logprob=True)
    assert parse_generate_reply(reply(good), **kw).routed_experts is None  # not asked
    assert parse_generate_reply(reply(good), return_routed_experts=True, **kw).routed_experts.shape == (4, 4)
    assert parse_generate_reply(reply(None), return_routed_experts=True, **kw).routed_experts is None
    with pytest.raises(MalformedReply, match="meta_info.routed_experts.*not a whole number of rows"):
        parse_generate_reply(reply(sglang_b64(np.zeros(7))), return_routed_experts=True, **kw)
    with pytest.raises(MalformedReply, match="meta_info.routed_experts must be a base64 string"):
        parse_generate_reply(reply([[1, 2]]), return_routed_experts=True, **kw)


def test_config_switch_values_and_agentic_refusal() -> None:
    assert load_config(None, ["trainer.moe_routing_replay=rollout"]).trainer.moe_routing_replay == "rollout"
    with pytest.raises(ValueError, match="trainer.moe_routing_replay"):
        load_config(None, ["trainer.moe_routing_replay=on"])
    with pytest.raises(ValueError, match="moe_routing_replay=rollout is not built for agentic"):
        load_config(None, ["trainer.moe_routing_replay=rollout", "agentic.env=frozenlake",
                           "agentic.max_episode_tokens=64", "trainer.max_seq_len=128"])


def test_sglang_engines_are_started_with_route_capture_when_replaying(tmp_path) -> None:
    cfg = load_config(None, ["engines.backend=sglang", "engines.gpu_ids=[0]"]).engines
    on = EngineLauncher.from_config(cfg, model_path="/m", run_dir=str(tmp_path), return_routed_experts=True)
    off = EngineLauncher.from_config(cfg, model_path="/m", run_dir=str(tmp_path))
    assert "--enable-return-routed-experts" in on.specs()[0].argv
    assert "--enable-return-routed-experts" not in off.specs()[0].argv
    assert json.dumps(on.server_args)  # plain data, as written to the run's config
