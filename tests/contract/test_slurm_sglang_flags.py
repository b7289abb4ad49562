"""The SGLang command lines launch/slurm/multi_node_disaggregated.sbatch renders are accepted by real
SGLang's own argument parser (ServerArgs.add_cli_args), extra ENGINE_ARGS included.

    make test-sglang    (MF_CONTRACT_BACKENDS=sglang, SGLang 0.5.23 in .cache/sglang-venv)

With the CPU backend only (`make test`) this is skipped: tests/unit/test_slurm_templates.py already
checks the same command lines against EngineCommand.sglang().build().
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.contract.conftest import BACKENDS, REPO
from tests.contract.sglang_backend import _venv, sglang_available

pytestmark = pytest.mark.skipif("sglang" not in BACKENDS or not sglang_available(),
                                reason="real SGLang not selected (MF_CONTRACT_BACKENDS=sglang) or not installed")

PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
out = []
for argv in json.load(sys.stdin):
    a = parser.parse_args(argv)
    out.append([a.model_path, a.host, a.port, a.tp_size, a.api_key, a.mem_fraction_static])
print(json.dumps(out))
"""


def test_rendered_engine_commands_parse_with_sglang() -> None:
    spec = importlib.util.spec_from_file_location("mf_slurm_render", Path(REPO) / "launch" / "slurm" / "render.py")
    render = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = render
    spec.loader.exec_module(render)
    rendering = render.render(Path(REPO) / "launch" / "slurm" / "multi_node_disaggregated.sbatch",
                              nodelist="gpu[01-03]",
                              env={"MODEL_PATH": "/ckpt/Qwen3-32B", "ENGINE_ARGS": "--mem-fraction-static 0.85"})
    engines = rendering.role("engine")
    assert len(engines) == 4
    argvs = [n.argv[n.argv.index("sglang.launch_server") + 1:] for n in engines]
    done = subprocess.run([os.path.join(_venv(), "bin", "python"), "-c", PARSE], input=json.dumps(argvs),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == [["/ckpt/Qwen3-32B", "gpu03", 30000 + i, 2, "$SGLANG_API_KEY", 0.85] for i in range(4)]
