"""The skeleton the CPU quickstarts share; each launcher keeps its task, its warm-up data and its summary.

    tiny model   tools/make_tiny_model.py → {out}/tiny_model (kept if it is there), and its tokenizer
    warm-up      Megatron SFT with the launcher's samples (nll on the response mask), then
                 export → {out}/warm_model (HF safetensors)
    RL           launch/pretrain_async_rl.py --config CONFIG model.hf_path={out}/warm_model
                 logging.dir={out}/rl OVERRIDES, as a subprocess; its rows of {out}/rl/metrics.jsonl
    finish       {out}/summary.json, a headline log line, then the summary as one JSON line (the
                 last line of the output, which the tests parse)

Used by launch/quickstart_cpu.py, launch/agentic_quickstart_cpu.py and
launch/agent_gateway_quickstart_cpu.py, which import it as a sibling module (their directory is on
sys.path when they run as scripts). Importing it puts the repository on sys.path, silences warnings
and keeps torch to one thread, as each launcher did before its own imports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)

# The warm-up's single-process group leaves these in os.environ: the RL run picks its own.
_PROCESS_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def arg_parser(doc: str, *, out: str, sft_steps: int, sft_steps_help: str | None = None,
               overrides_help: str = "config overrides for the RL run") -> argparse.ArgumentParser:
    """--out, --seed, --sft-steps and the KEY=VALUE overrides; a launcher adds its own options."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=out)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=sft_steps, help=sft_steps_help)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)
    return p


@dataclass
class WarmUp:
    policy: Any
    """The warmed-up MegatronPolicy (its process group is still up until `Quickstart.rl`)."""
    path: str
    """{out}/warm_model, the exported HF checkpoint the RL run starts from."""
    losses: list[float]
    """nll per trained token at each warm-up step."""

    def nll(self) -> dict[str, float]:
        tail = self.losses[-10:]
        return {"sft_nll_first": self.losses[0], "sft_nll_last": sum(tail) / len(tail)}


class Quickstart:
    """One quickstart run under {out}: its name, its clock, and the steps every launcher takes.

    The name starts the failure message ("agentic quickstart: the RL run failed ...") and, hyphenated,
    each log line ("[agentic-quickstart 12:00:00] ..."). The clock starts here.
    """

    def __init__(self, name: str, *, out: str) -> None:
        self.name = name
        self.out = out
        self.started = time.time()
        os.makedirs(out, exist_ok=True)

    @property
    def tiny_path(self) -> str:
        return os.path.join(self.out, "tiny_model")

    @property
    def warm_path(self) -> str:
        return os.path.join(self.out, "warm_model")

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.out, "rl", "metrics.jsonl")

    def log(self, msg: str) -> None:
        print(f"[{self.name.replace(' ', '-')} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def tiny_model(self, *, seed: int, flags: tuple[str, ...] = (), label: str = "tiny model") -> Any:
        """The tokenizer of {out}/tiny_model; tools/make_tiny_model.py `flags` makes the model if it is absent."""
        tiny = self.tiny_path
        if not os.path.isfile(os.path.join(tiny, "config.json")):
            subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", tiny,
                            "--seed", str(seed), *flags], check=True, capture_output=True)
        self.log(f"{label} at {tiny}")
        import transformers

        return transformers.AutoTokenizer.from_pretrained(tiny)

    def warm_up(self, *, seed: int, num_steps: int, batch_size: int, make_samples: Callable[[], list[Any]],
                pad_id: int, loss_label: str, log_every: int, loss_note: str = "") -> WarmUp:
        """`num_steps` Megatron SFT steps on `make_samples()` (called once per step, in order), then export.

        The log line at step 1 and every `log_every` steps reads
        "warm-up step {step}/{num_steps}  {loss_label} {loss:.3f}{loss_note}".
        """
        from megatron_flash.config.schema import OptimizerConfig
        from megatron_flash.trainer.loss_adapter import nll_loss_fn
        from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
        from megatron_flash.types import collate

        policy = MegatronPolicy(PolicySettings(hf_path=self.tiny_path, micro_batch_size=batch_size, seed=seed,
                                               optimizer_steps=num_steps,
                                               optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0)))
        losses = []
        for step in range(1, num_steps + 1):
            metrics = policy.train_step(collate(make_samples(), pad_id=pad_id), nll_loss_fn)
            losses.append(metrics["loss"])
            if step % log_every == 0 or step == 1:
                self.log(f"warm-up step {step:4d}/{num_steps}  {loss_label} {metrics['loss']:.3f}{loss_note}")
        policy.export_hf(self.warm_path)
        return WarmUp(policy=policy, path=self.warm_path, losses=losses)

    def rl(self, *, config: str, overrides: list[str], env: dict[str, str] | None = None,
           nproc: int = 1) -> list[dict[str, Any]]:
        """The product's entry point on {out}/warm_model as a subprocess (under torchrun with `nproc`
        trainer processes when nproc > 1); the rows of its metrics.jsonl."""
        from megatron_flash.trainer.distributed import destroy_distributed

        destroy_distributed()  # the RL run is its own process (its own process group and engines)
        run_dir = os.path.dirname(self.metrics_path)
        if os.path.exists(self.metrics_path):
            os.remove(self.metrics_path)  # one run's curve, not an append of several
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        "--nproc-per-node", str(nproc), "--standalone"]
        cmd = [*launcher, os.path.join(REPO, "launch/pretrain_async_rl.py"), "--config", config,
               f"model.hf_path={self.warm_path}", f"logging.dir={run_dir}", *overrides]
        self.log("RL: " + " ".join(cmd[len(launcher):] if nproc == 1 else ["torchrun", *cmd[3:]]))
        inherited = {k: v for k, v in os.environ.items() if k not in _PROCESS_GROUP_ENV}
        proc = subprocess.run(cmd, env={**inherited, "OMP_NUM_THREADS": "1", **(env or {})})
        if proc.returncode != 0:
            raise SystemExit(f"{self.name}: the RL run failed (exit {proc.returncode}); see the output above")
        with open(self.metrics_path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def finish(self, summary: dict[str, Any], *, headline: str, hide: str) -> None:
        """Time the run, write {out}/summary.json, log `headline` (str.format over the summary), and
        print the summary without its per-step list `hide` as the output's last line."""
        summary["seconds"] = round(time.time() - self.started, 1)
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self.log(headline.format(**summary))
        print(json.dumps({k: v for k, v in summary.items() if k != hide}))

