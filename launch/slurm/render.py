"""Dry-run a Slurm template: the exact commands each node would run, without Slurm.

    python launch/slurm/render.py launch/slurm/multi_node_disaggregated.sbatch --nodelist 'gpu[01-04]' \\
        --env MODEL_PATH=/ckpt/Qwen3-32B -- data.path=/data/math.jsonl
    python launch/slurm/render.py launch/slurm/single_node_split.sbatch --env TRAIN_GPUS=6 \\
        --env MODEL_PATH=/ckpt/Qwen3-8B --check        # also resolve the trainer's config (--print-config)

How: bash runs the template itself with DRY_RUN=1 and the job's Slurm variables set, with fake
`scontrol` (expands --nodelist), `hostname` (the first node) and `srun` (fails: a dry run must start
nothing) first on PATH. What it prints is what an sbatch'ed copy would print and run, line for line:

    + <command>                  the batch shell's commands (srun steps)
    [<host> <role>] <command>    what runs on that node for that role (trainer, engine0, engine1, ...)
    # <text>                     health waits, what USR1 would do, ...

Only PATH, HOME, LANG and TMPDIR come from your environment: every template variable is an --env,
so a rendering does not depend on the shell it was made in. The API key is never expanded into the
output (commands refer to $SGLANG_API_KEY); --env SGLANG_API_KEY=... lets you check that.
Exit codes: 0 rendered (and checked), 1 the template or the config check failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
ENTRY = "launch/pretrain_async_rl.py"
_NODE_LINE = re.compile(r"^\[(?P<host>\S+) (?P<role>\S+)\] (?P<text>.*)$")
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PASSED_ENV = ("PATH", "HOME", "LANG", "TMPDIR")


class RenderError(RuntimeError):
    """The template exited non-zero (a bad variable, a failed check); the message holds its stderr."""


def expand_hostlist(spec: str) -> List[str]:
    """Slurm hostlist syntax → hostnames, in order: ``gpu[01-02,07],login1`` → gpu01 gpu02 gpu07 login1;
    several bracket groups in one name multiply (``r[1-2]n[1-2]`` → r1n1 r1n2 r2n1 r2n2)."""
    names: List[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", spec):
        parts = re.split(r"\[([^\]]*)\]", item)  # text, range list, text, range list, ..., text
        choices: List[List[str]] = []
        for index, part in enumerate(parts):
            choices.append(_expand_ranges(part, spec) if index % 2 else [part])
        names += ["".join(combo) for combo in itertools.product(*choices)]
    if not names:
        raise ValueError(f"empty host list: {spec!r}")
    return names


def _expand_ranges(ranges: str, spec: str) -> List[str]:
    out: List[str] = []
    for piece in ranges.split(","):
        first, sep, last = piece.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"bad range {piece!r} in host list {spec!r}")
        width = len(first)  # zero padding: gpu[08-10] → gpu08 gpu09 gpu10
        out += [str(n).zfill(width) for n in range(int(first), int(last or first) + 1)]
    return out


@dataclasses.dataclass(frozen=True)
class NodeCommand:
    """One ``[host role] command`` line: what `host` runs for `role`."""

    host: str
    role: str
    text: str
    """The command exactly as the node's shell gets it."""
    env: Dict[str, str]
    """Leading NAME=value words (e.g. CUDA_VISIBLE_DEVICES)."""
    argv: List[str]
    """The rest, split as bash would (variables such as $SGLANG_API_KEY stay unexpanded)."""

    @property
    def script_args(self) -> List[str]:
        """The trainer entry point's arguments (--config ... and overrides); [] for other commands."""
        for index, word in enumerate(self.argv):
            if word.endswith(ENTRY):
                return self.argv[index + 1:]
        return []


@dataclasses.dataclass(frozen=True)
class Rendering:
    output: str
    """Everything the template printed (stdout)."""
    stderr: str
    steps: List[str]
    """The batch shell's commands (``+`` lines, without the marker)."""
    nodes: List[NodeCommand]

    def role(self, prefix: str) -> List[NodeCommand]:
        """Node commands whose role starts with `prefix` (``trainer``, ``engine``)."""
        return [n for n in self.nodes if n.role.startswith(prefix)]


def parse(output: str, stderr: str = "") -> Rendering:
    steps, nodes = [], []
    for line in output.splitlines():
        if line.startswith("+ "):
            steps.append(line[2:])
            continue
        match = _NODE_LINE.match(line)
        if match:
            words = shlex.split(match["text"])
            env: Dict[str, str] = {}
            while words and _ENV_WORD.match(words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            nodes.append(NodeCommand(host=match["host"], role=match["role"], text=match["text"], env=env,
                                     argv=words))
    return Rendering(output=output, stderr=stderr, steps=steps, nodes=nodes)


_FAKE_SCONTROL = """#!/bin/bash
# fake scontrol (launch/slurm/render.py): only `scontrol show hostnames [LIST]`
if [[ "$1 $2" != "show hostnames" ]]; then echo "fake scontrol: only 'show hostnames' exists here" >&2; exit 1; fi
if [[ "${3:-$SLURM_JOB_NODELIST}" != "$SLURM_JOB_NODELIST" ]]; then echo "fake scontrol: unknown list $3" >&2; exit 1; fi
cat <<'HOSTS'
%s
HOSTS
"""
_FAKE_HOSTNAME = "#!/bin/bash\necho %s\n"
_FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$MF_RENDER_SRUN_CALLS"
echo 'fake srun: a dry run must not start anything' >&2
exit 97
"""


def _write_tool(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def render(template: os.PathLike | str, *, nodelist: str = "node[01-04]", gpus_per_node: int = 8,
           cpus_per_node: int = 64, job_id: str = "4242", job_name: str = "", env: Optional[Mapping[str, str]] = None,
           overrides: Sequence[str] = (), repo: os.PathLike | str = REPO, timeout_s: float = 30.0) -> Rendering:
    """Run `template` under bash with DRY_RUN=1 in a fake job on `nodelist`; RenderError if it fails."""
    hosts = expand_hostlist(nodelist)
    template = Path(template).resolve()
    with tempfile.TemporaryDirectory(prefix="mf-render-") as tmp:
        bin_dir = Path(tmp)
        _write_tool(bin_dir, "scontrol", _FAKE_SCONTROL % "\n".join(hosts))
        _write_tool(bin_dir, "hostname", _FAKE_HOSTNAME % shlex.quote(hosts[0]))
        _write_tool(bin_dir, "srun", _FAKE_SRUN)
        job_env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
        job_env.update(
            PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            DRY_RUN="1", SLURM_JOB_ID=job_id, SLURM_JOB_NAME=job_name or template.stem,
            SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(len(hosts)), SLURM_GPUS_PER_NODE=str(gpus_per_node),
            SLURM_CPUS_ON_NODE=str(cpus_per_node), SLURM_SUBMIT_DIR=str(repo),
            # the interpreter a template reads the config with (the multi-node one: its engines'
            # flags); in a job that is $PYTHON after VENV, here the one rendering
            MF_CONFIG_PYTHON=sys.executable,
        )
        job_env.update(env or {})
        job_env["MF_RENDER_SRUN_CALLS"] = str(bin_dir / "srun.calls")
        done = subprocess.run(["bash", str(template), *overrides], cwd=repo, env=job_env, capture_output=True,
                              text=True, timeout=timeout_s)
        calls = bin_dir / "srun.calls"
        if calls.exists():  # a background srun's failure would not fail the template
            raise RenderError(f"{template.name} called srun in a dry run:\n{calls.read_text().strip()}")
    if done.returncode != 0:
        raise RenderError(f"{template.name} exited with {done.returncode}:\n{done.stderr.strip()}")
    return parse(done.stdout, done.stderr)


def check_trainer_config(node: NodeCommand, *, python: str = sys.executable, repo: os.PathLike | str = REPO,
                         api_key: str = "render-check-key", timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """Resolve a trainer command's config the way the entry point does (``--print-config``: no torch
    import, nothing started); returns the finished process (returncode 0 = the config is valid)."""
    args = node.script_args
    if not args:
        raise ValueError(f"[{node.host} {node.role}] does not run {ENTRY}: {node.text}")
    env = {**os.environ, "SGLANG_API_KEY": api_key}  # what the node's environment provides
    return subprocess.run([python, ENTRY, "--print-config", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def _parse_env(items: Sequence[str]) -> Dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_WORD.match(item):
            raise ValueError(f"--env takes NAME=VALUE, got {item!r}")
        env[name] = value
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("template", help="an .sbatch file, e.g. launch/slurm/single_node_split.sbatch")
    parser.add_argument("--nodelist", default=None,
                        help="the job's nodes in Slurm syntax (default: node01, or node[01-04] for multi-node)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--cpus-per-node", type=int, default=64)
    parser.add_argument("--job-id", default="4242")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a template variable (CONFIG, MODEL_PATH, TRAIN_NODES, TRAIN_GPUS, ...); repeatable")
    parser.add_argument("--check", action="store_true",
                        help="also run the trainer's config through launch/pretrain_async_rl.py --print-config")
    parser.add_argument("--json", action="store_true", help="print the parsed commands as JSON")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as after sbatch FILE")
    args = parser.parse_intermixed_args(argv)
    try:
        env = _parse_env(args.env)
        nodelist = args.nodelist or ("node[01-04]" if "multi_node" in Path(args.template).name else "node01")
        rendering = render(args.template, nodelist=nodelist, gpus_per_node=args.gpus_per_node,
                           cpus_per_node=args.cpus_per_node, job_id=args.job_id, env=env, overrides=args.overrides)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RenderError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"steps": rendering.steps, "nodes": [dataclasses.asdict(n) for n in rendering.nodes]},
                         indent=2))
    else:
        sys.stdout.write(rendering.output)
    if args.check:
        checked: Dict[Tuple[str, ...], bool] = {}
        for node in rendering.role("trainer"):
            if tuple(node.script_args) in checked:
                continue
            done = check_trainer_config(node)
            checked[tuple(node.script_args)] = done.returncode == 0
            if done.returncode:
                print(f"error: [{node.host} trainer] the config does not resolve: {done.stderr.strip()}",
                      file=sys.stderr)
        if not checked or not all(checked.values()):
            return 1
        print(f"# check: the trainer config resolves ({len(checked)} distinct trainer command(s))", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
