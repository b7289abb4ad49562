"""`model.hf_path` as users type it: a local directory, or a Hugging Face Hub id resolved through
huggingface_hub's cache.

    model.hf_path=runs/quickstart/warm_model           a directory with config.json: used as it is
    model.hf_path=HuggingFaceTB/SmolLM2-135M-Instruct  the id's snapshot in the cache (HF_HOME /
                                                       HF_HUB_CACHE), downloaded first when the Hub is
                                                       reachable and HF_HUB_OFFLINE is not set

Every rank and every engine then reads the same resolved directory. An id that is neither cached nor
downloadable is an error naming the id, the cache and whether offline mode was on.

`data.path` (and an eval set's `path`) may likewise be a Hub *dataset* id: `resolve_dataset_path`
turns it into the dataset repository's snapshot directory (repo_type="dataset", the same cache rules),
which the prompt loader reads with `datasets.load_dataset(dir, split=data.split)` (its files laid out
as the Hub's viewer expects: data/train-*.parquet, train.jsonl, ...).
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


def resolve_dataset_path(value: str, *, key: str = "data.path") -> str:
    """A local file or directory for `value`: an existing path as it is, a Hub dataset id ("org/name")
    as its snapshot directory in the cache; ValueError naming `key` when the id is neither cached
    nor downloadable. Anything else is returned unchanged (the loader names a missing file)."""
    if not value or os.path.exists(value) or not _HUB_ID.match(value) or os.path.splitext(value)[1] in _DATA_EXTS:
        return value
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(repo_id=value, repo_type="dataset")
    except Exception as error:  # offline cache miss, unknown repo, no network
        mode = "offline (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "online"
        raise ValueError(f"{key}={value!r}: no local file of that name, and the Hub dataset id is not in the "
                         f"Hugging Face cache {constants.HF_HUB_CACHE} nor downloadable ({mode}): "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None


_DATA_EXTS = (".jsonl", ".json", ".parquet")
