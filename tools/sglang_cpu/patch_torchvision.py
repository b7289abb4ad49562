"""Make torchvision 0.28.0's op-registration imports non-fatal on a CPU-only torch 2.13.0.

torchvision 0.28.0's compiled ops (``torchvision._C``) do not load against the CPU build of torch
2.13.0, so ``torch.ops.torchvision.nms`` etc. never get defined, and ``import torchvision`` dies in
``torchvision/_meta_registrations.py`` with ``RuntimeError: operator torchvision::nms does not exist``.
SGLang imports torchvision (image processors) on its import path, but never calls those ops for a
text-only model.

This script edits the INSTALLED ``torchvision/__init__.py`` of the given site-packages in place:
the two registration modules are imported in their own ``try: ... except RuntimeError: pass`` and
the rest of the original import list stays as is. It is idempotent (a marker comment) and refuses
to touch a file whose text it does not recognise.

    python patch_torchvision.py SITE_PACKAGES_DIR
"""

import pathlib
import sys

MARKER = "# megatron-flash sglang_cpu patch"

ORIGINAL = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,"""

PATCHED = f"""{MARKER}: torchvision._C cannot load against CPU torch; op registrations are optional here.
try:
    from torchvision import _autograd_registrations  # noqa: F401
except RuntimeError:
    pass
try:
    from torchvision import _meta_registrations  # noqa: F401
except RuntimeError:
    pass
from torchvision import (
    datasets,"""


def main(site: str) -> int:
    init = pathlib.Path(site) / "torchvision" / "__init__.py"
    text = init.read_text()
    if MARKER in text:
        print(f"already patched: {init}")
        return 0
    if text.count(ORIGINAL) != 1:
        print(f"unexpected torchvision/__init__.py (version changed?): {init}", file=sys.stderr)
        return 1
    init.write_text(text.replace(ORIGINAL, PATCHED))
    print(f"patched: {init}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
