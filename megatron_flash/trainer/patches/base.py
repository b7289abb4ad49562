"""What a patch raises when the megatron-core it meets is not the one it was written for."""

from __future__ import annotations

from megatron_flash.versions import TESTED, installed


class PatchMismatch(RuntimeError):
    """One line: the megatron-core version, the tested span, the target and what differs."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"megatron-core {installed('megatron-core') or 'unknown'} (tested: "
                         f"megatron-core{TESTED['megatron-core']}): {what}: {detail}")
