"""trainer/megatron_compat.py and trainer/patches/packed_rope.py's signature checks: a megatron-core whose internals
differ from what the trainer replaces is refused at start-up with one line naming the version and
the target; the packed RoPE passes the MLA flag under the name each version takes."""

from __future__ import annotations

import inspect

import pytest
import torch


class _Group:  # a context-parallel group of one
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def test_the_installed_megatron_passes_every_check() -> None:
    from megatron_flash.trainer import megatron_compat

    megatron_compat.check(cpu=True)


def test_an_unknown_rope_argument_is_refused_naming_version_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_flash.trainer import megatron_compat
    from megatron_flash.trainer.patches import packed_rope as rope

    def bshd(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0, yarn_factor=1.0):
        return t

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", bshd)
    with pytest.raises(RuntimeError) as err:
        megatron_compat.check(cpu=False)
    message = str(err.value)
    assert "megatron-core " + megatron_compat.version() in message and "yarn_factor" in message
    assert "_apply_rotary_pos_emb_bshd" in message and "\n" not in message


def test_a_changed_optimizer_load_signature_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.optimizer import distrib_optimizer

    from megatron_flash.trainer import megatron_compat

    monkeypatch.setattr(distrib_optimizer.DistributedOptimizer, "_set_main_param_and_optimizer_states",
                        lambda self, model_param, tensors, strict: None)
    with pytest.raises(RuntimeError, match=r"_set_main_param_and_optimizer_states.*'strict'"):
        megatron_compat.check(cpu=False)


def test_missing_rng_internals_are_refused_on_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_flash.trainer import megatron_compat

    monkeypatch.delattr(mrandom, "_set_cuda_rng_state")
    megatron_compat.check(cpu=False)
    with pytest.raises(RuntimeError, match="_set_cuda_rng_state"):
        megatron_compat.check(cpu=True)


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_mla_flag_reaches_megatrons_rotation_under_this_versions_name(interleaved: bool) -> None:
    from megatron_flash.trainer.patches import packed_rope as rope

    original = rope.original()
    mla_name = next(n for n in ("mla_rotary_interleaved", "multi_latent_attention")
                    if n in inspect.signature(original).parameters)
    g = torch.Generator().manual_seed(1)
    lengths = [4, 2, 6]
    t = torch.randn(sum(lengths), 2, 8, generator=g)
    cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    freqs = torch.randn(max(lengths), 1, 1, 8, generator=g)
    theirs = original(t, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group(), **{mla_name: True})
    plain = original(t, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group())
    assert not torch.allclose(theirs, plain)  # the flag changes the rotation: a dropped flag would show
    for name in ("mla_rotary_interleaved", "multi_latent_attention"):  # 0.17+ and 0.16 call it so
        ours = rope.apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group(),
                                             **{name: True})
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=0), name
