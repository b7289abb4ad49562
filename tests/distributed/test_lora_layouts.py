"""LoRA adapters train the same under every layout, and leave the trainer in PEFT's format (gloo, CPU, fp32).

  model     case             procs  layout / batching               compared to   what it exercises
  --------  ---------------  -----  ------------------------------  ------------  ------------------------------
  2 layers  base               1    TP1, no adapters                 —             the base model's numbers
  2 layers  fresh              1    TP1, fresh adapters (B = 0)      base          logprobs = base, merged export = source
  2 layers  ref                1    TP1, packed ≤ 24 tokens          (reference)   B ~ N(0, 0.05): A's gradient is live
  2 layers  tp2                2    TP2 (+ export → import)          ref           A whole / B split (column), A split (row)
  2 layers  tp2sp              2    TP2 + sequence parallel          ref           all-gather / reduce-scatter of A·x
  2 layers  pp2                2    PP2                              ref           per-stage adapters, frozen embedding
  2 layers  recompute_full     1    full recompute                   ref           checkpointed layers with a frozen input
  2 layers  padded             1    padded micro-batches             ref           packed = padded
  2 layers  ref_adam / dp2   1 / 2  Adam; DP2 distributed optimizer  ref_adam      the optimizer shards only adapters
  4 layers  pp1 / vpp2       1 / 2  PP2 × VPP2 (interleaved)         pp1           adapters in every virtual chunk
  MoE       moe_ref / moe_ep2 1 / 2  qkv, proj only; EP2             moe_ref       attention adapters on a MoE model
  2 layers  <loss>_packed/_padded 1 every registered loss           its packed    same step packed or padded

One SGD step with lr = 1 and no clipping moves each adapter weight by exactly its gradient, so equal
adapter weights after the step (1e-6) mean equal adapter gradients; loss and gradient norm agree too.
The base weights never move. PEFT: `peft.PeftModel.from_pretrained` on the transformers base with the
exported adapter gives the logprobs the trainer computed with it (1e-5), before and after the step.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import hf_weights
from tests.distributed.grouped_cases import run_layout_cases
from tests.distributed.layout_worker import fixed_batch

LORA = ["--lora-rank", "4", "--lora-b-std", "0.05", "--lr", "1"]
BUDGET = ["--max-tokens", "24"]
# Adam's first step moves a weight by lr·g/(|g| + eps). At eps = 1e-8 an adapter gradient that sums to 0 in
# one layout and to 1e-14 in another (another summation order) moves by 0 vs 1e-6 (seen: 1.5e-6 at DP2);
# at eps = 1 the step is ≈ g, so the weights compare gradients at 1e-6 as the SGD cases do, and a
# moment or shard the distributed optimizer got wrong still shows at full size.
ADAM = ["--optimizer", "adam", "--adam-eps", "1"]
LOSSES = ("cispo", "decoupled_ppo", "gspo", "ppo", "reinforce", "tis", "topr")  # = losses.list_losses()
CASES = {
    "base": ("two", 1, ["--lr", "1"] + BUDGET, None),
    "fresh": ("two", 1, ["--lora-rank", "4", "--lr", "1"] + BUDGET, None),
    "ref": ("two", 1, LORA + BUDGET, None),
    "tp2": ("two", 2, LORA + BUDGET + ["--tp", "2", "--reimport"], "ref"),
    "tp2sp": ("two", 2, LORA + BUDGET + ["--tp", "2", "--sp"], "ref"),
    "pp2": ("two", 2, LORA + BUDGET + ["--pp", "2", "--reimport", "--reimport-unused"], "ref"),
    "recompute_full": ("two", 1, LORA + BUDGET + ["--recompute", "full"], "ref"),
    "padded": ("two", 1, LORA + ["--no-pack"], "ref"),
    "ref_adam": ("two", 1, LORA + BUDGET + ADAM, None),
    "dp2": ("two", 2, LORA + BUDGET + ADAM + ["--distributed-optimizer"], "ref_adam"),
    "pp1": ("four", 1, LORA + BUDGET, None),
    "vpp2": ("four", 2, LORA + BUDGET + ["--pp", "2", "--vpp", "2"], "pp1"),
    "moe_ref": ("moe", 1, LORA + ["--lora-targets", "qkv,proj", "--moe-aux", "0"], None),
    "moe_ep2": ("moe", 2, LORA + ["--lora-targets", "qkv,proj", "--moe-aux", "0", "--ep", "2"], "moe_ref"),
    "drop_tp2": ("two", 2, LORA + BUDGET + ["--tp", "2", "--lora-dropout", "0.5", "--steps", "2", "--record-dropout"],
                 None),
    "drop_tp2sp": ("two", 2, LORA + BUDGET + ["--tp", "2", "--sp", "--lora-dropout", "0.5", "--record-dropout"], None),
}
for _loss in LOSSES:
    CASES[f"{_loss}_packed"] = ("two", 1, LORA + BUDGET + ["--loss", _loss], None)
    CASES[f"{_loss}_padded"] = ("two", 1, LORA + ["--loss", _loss, "--no-pack"], f"{_loss}_packed")
PAIRS = [c for c, spec in CASES.items() if spec[3] is not None]


@pytest.fixture(scope="module")
def runs(tiny_models, four_layer_model, tmp_path_factory) -> dict[str, str]:
    models = {"two": tiny_models["llama"], "four": four_layer_model, "moe": tiny_models["qwen3_moe"]}
    cases = {case: (nproc, ["--hf-dir", models[model], "--micro-batch-size", "2"] + extra)
             for case, (model, nproc, extra, _) in CASES.items()}
    return run_layout_cases(cases, str(tmp_path_factory.mktemp("lora_layouts")))


def adapter(path: str) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors by HF module name (PEFT's `base_model.model.` prefix checked, then dropped)."""
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    assert tensors and all(k.startswith("base_model.model.model.layers.") for k in tensors), list(tensors)[:2]
    return {k.removeprefix("base_model.model."): v for k, v in tensors.items()}


def metrics(path: str) -> dict[str, float]:
    with open(os.path.join(path, "metrics.json")) as f:
        return json.load(f)


def test_lora_losses_match_the_registry() -> None:
    from megatron_flash.losses import list_losses

    assert sorted(LOSSES) == list_losses()


@pytest.mark.parametrize("case", PAIRS)
def test_same_adapter_step_in_every_layout(runs, case: str) -> None:
    ref = CASES[case][3]
    got_m, want_m = metrics(runs[case]), metrics(runs[ref])
    assert abs(got_m["loss"] - want_m["loss"]) <= 1e-6, (got_m["loss"], want_m["loss"])
    assert got_m["grad_norm"] == pytest.approx(want_m["grad_norm"], rel=1e-6)
    before = adapter(os.path.join(runs[ref], "export0", "adapter"))
    want, got = adapter(os.path.join(runs[ref], "export1", "adapter")), adapter(os.path.join(runs[case], "export1", "adapter"))
    assert set(got) == set(want) == set(before)
    for part in ("lora_A", "lora_B"):  # both factors moved: B starts random, so A's gradient is not 0
        assert max((want[k] - before[k]).abs().max().item() for k in want if part in k) > 1e-3, part
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, f"{case}: an adapter gradient differs from {ref} by {worst}"


@pytest.mark.parametrize("case", ["ref", "tp2", "dp2", "vpp2", "moe_ep2"])
def test_base_weights_stay_frozen(runs, case: str) -> None:
    """The merged export after the step = the source's base + s·B·A of the stepped adapters: the
    base itself did not move (a frozen weight that got an update would break this)."""
    merged = hf_weights(os.path.join(runs[case], "export1"))
    ad = adapter(os.path.join(runs[case], "export1", "adapter"))
    with open(os.path.join(runs[case], "export1", "adapter", "adapter_config.json")) as f:
        config = json.load(f)
    scaling = config["lora_alpha"] / config["r"]
    base = hf_weights(config["base_model_name_or_path"])
    assert merged.keys() == base.keys()
    for name, weight in base.items():
        module = name[: -len(".weight")]
        a, b = ad.get(f"{module}.lora_A.weight"), ad.get(f"{module}.lora_B.weight")
        expected = weight if a is None else weight + scaling * (b @ a)
        assert (merged[name] - expected).abs().max().item() <= 1e-6, name
    assert any(".lora_A." in k for k in ad)


def test_fresh_adapters_give_the_base_model(runs, tiny_models) -> None:
    """B = 0: the logprobs are the base model's, the merged export is the source checkpoint bit for bit."""
    base = torch.load(os.path.join(runs["base"], "logprobs.pt"))
    fresh = torch.load(os.path.join(runs["fresh"], "logprobs.pt"))
    assert (fresh - base).abs().max().item() <= 1e-6
    source, exported = hf_weights(tiny_models["llama"]), hf_weights(os.path.join(runs["fresh"], "export0"))
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[k], source[k]) for k in source)
    b = [v for k, v in adapter(os.path.join(runs["fresh"], "export0", "adapter")).items() if "lora_B" in k]
    assert b and all(not v.any() for v in b)


def test_moe_adapters_sit_on_attention_only(runs) -> None:
    names = adapter(os.path.join(runs["moe_ref"], "export0", "adapter"))
    assert names and all(".self_attn." in k for k in names)
    assert {k.split(".")[-3] for k in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize("case", ["tp2", "pp2"])
def test_export_then_import_is_bit_exact(runs, case: str) -> None:
    """The exported PEFT adapter, loaded back (model.lora.adapter_path) and exported again; under PP2
    each stage loads its own layers' tensors."""
    first = adapter(os.path.join(runs[case], "export0", "adapter"))
    again = adapter(os.path.join(runs[case], "reimport0"))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("case,export", [("tp2", "export0"), ("ref", "export1")])
def test_peft_gives_the_trainers_logprobs(runs, tiny_models, case: str, export: str) -> None:
    """transformers' base + peft.PeftModel.from_pretrained(exported adapter) scores the fixed batch as
    the trainer did (export0: logprobs.pt, taken with those adapters) or as the merged export does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, os.path.join(runs[case], export, "adapter")).eval()
    batch = fixed_batch(base.config.vocab_size)
    if export == "export0":
        want = torch.load(os.path.join(runs[case], "logprobs.pt"))
    else:
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(runs[case], export), dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for i, n in enumerate(batch.lengths.tolist()):
            ids = batch.tokens[i: i + 1, :n]
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            if export == "export0":
                ref = want[i, 1:n]
            else:
                ref = torch.log_softmax(merged(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            worst = max(worst, (lp - ref).abs().max().item())
    assert worst <= 1e-5, worst


def test_an_adapter_tensor_no_module_takes_is_refused_under_pp(runs) -> None:
    """PP2: each stage reads only its own layers' tensors; the check runs on their union, so a tensor no
    stage takes is refused by name on both ranks (and the tensors each stage does take are not)."""
    for rank in (0, 1):
        with open(os.path.join(runs["pp2"], f"unused_rank{rank}.txt")) as f:
            message = f.read()
        assert "layers.99.self_attn.o_proj.lora_A.weight" in message and "match no adapted module" in message, message


def dropout_masks(path: str, rank: int = 0) -> list[torch.Tensor]:
    return torch.load(os.path.join(path, f"dropout_rank{rank}.pt"))


def test_lora_dropout_draws_new_masks_each_step_and_never_when_scoring(runs) -> None:
    """model.lora.dropout=0.5 (TP2): scoring (no gradient: logprobs, π_prox, the reference) is
    deterministic and dropout-free, so its logprobs are those of the same adapters without dropout (the
    tp2 case); each training forward draws masks of its own (about half the inputs kept), different at
    the second step; and the training loss is not the dropout-free one. (Every other case runs the
    default dropout 0, exact against its reference.)"""
    assert torch.equal(torch.load(os.path.join(runs["drop_tp2"], "logprobs.pt")),
                       torch.load(os.path.join(runs["tp2"], "logprobs.pt")))
    masks = dropout_masks(runs["drop_tp2"])
    half = len(masks) // 2
    assert len(masks) == 2 * half and half >= 4 * 2  # 4 adapted linears × 2 layers per micro-batch forward
    assert all(a.shape == b.shape for a, b in zip(masks[:half], masks[half:]))
    assert not any(torch.equal(a, b) for a, b in zip(masks[:half], masks[half:]))
    kept = torch.cat([m.flatten().float() for m in masks]).mean().item()
    assert 0.45 <= kept <= 0.55, kept
    assert abs(metrics(runs["drop_tp2"])["losses"][0] - metrics(runs["tp2"])["loss"]) > 1e-4


@pytest.mark.parametrize("case, column_same", [("drop_tp2", True), ("drop_tp2sp", False)])
def test_lora_dropout_masks_across_tensor_parallel_ranks(runs, case: str, column_same: bool) -> None:
    """A column-parallel adapter (qkv, fc1) sees the same input on every TP rank, so its mask must be the
    same there; under sequence parallelism, and for a row-parallel adapter (proj, fc2, each rank its own
    slice of the input), each rank draws its own. Calls come per layer as qkv, proj, fc1, fc2."""
    ranks = [dropout_masks(runs[case], r) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) and len(ranks[0]) % 4 == 0 and ranks[0]
    for i, (a, b) in enumerate(zip(*ranks)):
        column = i % 4 in (0, 2)
        same = a.shape == b.shape and torch.equal(a, b)
        assert same == (column and column_same), (case, i, "column" if column else "row")
