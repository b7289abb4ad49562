"""LoRA adapters on the local engine (SGLang's dynamic LoRA API: /load_lora_adapter,
/load_lora_adapter_from_tensors, /unload_lora_adapter, `lora_path` on requests; `--enable-lora`).

The local engine serves ONE adapter at a time, merged into its weights: W = W_base + (alpha/r)·B·A,
formed in float32 from a pristine copy of each adapted base weight and cast once to the engine's
dtype. Merging keeps the decode step what it is without adapters (no extra matmuls per token, the
CUDA graphs of the static decoder untouched: weights are written in place), and forming every merge
from the pristine base means no rounding accumulates over thousands of pushes (a merge into the
previous merge would). The price is one more copy of the adapted base weights in engine memory.

Names: loading a new adapter supersedes the previous one. A request naming the current adapter or
a superseded one runs on the current weights (a push continues requests in flight on the new weights,
as with full-weight pushes, and meta_info.weight_version says which version produced which tokens);
the reply's `meta_info.lora_path` names the adapter it ran on. A request naming an adapter this
engine never loaded, or unloaded, is refused (400); so is a request naming none while an adapter is
merged in (it cannot get the base model). A full-weight update replaces the base and drops the adapter.

A mixin of `LocalEngine`, which owns `model`, `dtype`, `device` and the update locking it runs under.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

_ADAPTER_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")


def _scaling(config: dict) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"config_dict needs r (a positive int) and lora_alpha, got r={rank!r}, lora_alpha={alpha!r}")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(key):
            raise ValueError(f"config_dict {key}=true is not supported by the local engine (plain LoRA only)")
    return rank, float(alpha) / rank


class EngineAdapters:
    lora_enabled: bool = False
    _lora_current: Optional[str] = None
    _lora_superseded: set[str]
    _lora_base: dict[str, torch.Tensor]  # module → pristine base weight (engine dtype and device)
    _lora_modules: set[str]  # modules the current adapter changed

    def _init_lora(self, enabled: bool) -> None:
        self.lora_enabled = enabled
        self._lora_current, self._lora_superseded = None, set()
        self._lora_base, self._lora_modules = {}, set()

    def _require_lora(self) -> None:
        if not self.lora_enabled:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")

    def loaded_adapters(self) -> dict[str, str]:
        names = ([self._lora_current] if self._lora_current else []) + sorted(self._lora_superseded)
        return {n: "merged" if n == self._lora_current else "superseded" for n in names}

    def adapter_for_request(self, lora_path: Any) -> Optional[str]:
        """The adapter a request naming `lora_path` runs on (None: no adapter); refuses as described above."""
        if lora_path is None:
            if self._lora_current is not None:
                raise ValueError(f"this engine serves LoRA adapter {self._lora_current!r} merged into its weights: "
                                 "a request must name it (lora_path); the base model is not served")
            return None
        self._require_lora()
        # a superseded name runs on its successor; with none merged in, on nothing
        if self._lora_current is None or not isinstance(lora_path, str) or lora_path not in self.loaded_adapters():
            raise ValueError(f"Got LoRA adapter that has never been loaded: {lora_path}\n"
                             f"All loaded adapters: {list(self.loaded_adapters()) if self._lora_current else []}.")
        return self._lora_current

    def check_new_adapter(self, name: Any) -> None:
        """Before a load, outside the update lock: refuse what SGLang refuses."""
        self._require_lora()
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        if name in self.loaded_adapters():
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")

    def merge_adapter(self, name: str, config: dict, named: list[tuple[str, torch.Tensor]]) -> str:
        """Replace the served adapter by `named` (PEFT names, with or without `base_model.model.`).
        Every name and shape is checked before any weight changes. Runs with the CB loop parked."""
        if "weights" in self._released:
            raise ValueError("the weights are released (release_memory_occupation): resume them first")
        _, scaling = _scaling(config)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in named:
            m = _ADAPTER_TENSOR.match(tensor_name)
            if m is None:
                raise ValueError(f"tensor {tensor_name!r} is not a LoRA tensor (<module>.lora_A.weight / lora_B.weight)")
            pairs.setdefault(m.group("module"), {})[m.group("which")] = tensor
        modules = dict(self.model.named_modules())
        updates = {}
        for module, ab in sorted(pairs.items()):
            target = modules.get(module)
            if not isinstance(target, torch.nn.Linear) or set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA module {module!r}: " + ("no such linear layer in the served model"
                                 if not isinstance(target, torch.nn.Linear) else "needs both lora_A and lora_B"))
            a, b = ab["A"], ab["B"]
            out_f, in_f = target.weight.shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
                raise ValueError(f"LoRA module {module!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                                 f"fit its weight {tuple(target.weight.shape)}")
            updates[module] = (target, a, b)
        with torch.no_grad():
            for module in self._lora_modules - set(updates):  # the previous adapter's, absent now: base again
                modules[module].weight.copy_(self._lora_base[module])
            for module, (target, a, b) in updates.items():
                if module not in self._lora_base:
                    self._lora_base[module] = target.weight.detach().clone()
                base = self._lora_base[module]
                delta = b.to(device=base.device, dtype=torch.float32) @ a.to(device=base.device, dtype=torch.float32)
                target.weight.copy_((base.float() + scaling * delta).to(base.dtype))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._lora_modules = set(updates)
        if self._lora_current is not None:
            self._lora_superseded.add(self._lora_current)
        self._lora_current = name
        return f"LoRA adapter {name} merged into {len(updates)} linear layers"

    def unload_adapter(self, name: Any) -> str:
        """Unloading the served adapter puts the base weights back; a superseded name is forgotten."""
        self._require_lora()
        if name not in self.loaded_adapters():
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {list(self.loaded_adapters())})")
        if name != self._lora_current:
            self._lora_superseded.discard(name)
            return f"LoRA adapter {name} unloaded"
        with torch.no_grad():
            modules = dict(self.model.named_modules())
            for module in self._lora_modules:
                modules[module].weight.copy_(self._lora_base[module])
        self._lora_modules, self._lora_current, self._lora_superseded = set(), None, set()
        return f"LoRA adapter {name} unloaded; the base weights are served"

    def forget_base(self) -> None:
        """A full-weight update wrote new base weights: no adapter is merged in them any more."""
        self._lora_base, self._lora_modules = {}, set()
        self._lora_current, self._lora_superseded = None, set()
