"""`model.hf_path` as users type it: a local directory, or a Hugging Face Hub id resolved through
huggingface_hub's cache.

    model.hf_path=runs/quickstart/warm_model           a directory with config.json: used as it is
    model.hf_path=HuggingFaceTB/SmolLM2-135M-Instruct  the id's snapshot in the cache (HF_HOME /
                                                       HF_HUB_CACHE), downloaded first when the Hub is
                                                       reachable and HF_HUB_OFFLINE is not set

Every rank and every engine then reads the same resolved directory. An id that is neither cached nor
downloadable is an error naming the id, the cache and whether offline mode was on.
"""

from __future__ import annotations

import os
import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(value: str, *, key: str = "model.hf_path") -> str:
    """A local model directory for `value` (see the module docstring); ValueError naming `key` otherwise."""
    if os.path.isdir(value) or not _HUB_ID.match(value) or os.path.exists(value):
        return value  # a path: checked (and a missing one named) where the model is read
    from huggingface_hub import constants, snapshot_download

    try:
        path = snapshot_download(repo_id=value)
    except Exception as error:  # offline cache miss, unknown repo, no network: all mean "no model here"
        mode = "offline (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "online"
        raise ValueError(f"{key}={value!r}: no local directory of that name, and the Hub id is not in the "
                         f"Hugging Face cache {constants.HF_HUB_CACHE} nor downloadable ({mode}): "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{key}={value!r} resolved to {path}, which has no config.json")
    return path
