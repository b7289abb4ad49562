"""A user reward that misbehaves on purpose, by prompt: rollout.reward=tests.faults.fault_rewards:faulty.

    "raise ..."  raises                  "nan ..."  returns NaN
    "hang ..."   the first call hangs (the pool's deadline must kill it); later calls score normally
    otherwise    the fraction of digits in the response (varies from the first step)

Each call appends {"tag", "outcome"} to $MF_FAULT_DIR/rewards.jsonl (before it misbehaves), so a test
counts what happened independently of the run's own metrics.
"""

import json
import os
import time


def _note(tag: str, outcome: str) -> None:
    with open(os.path.join(os.environ["MF_FAULT_DIR"], "rewards.jsonl"), "a") as f:
        f.write(json.dumps({"tag": tag, "outcome": outcome, "pid": os.getpid()}) + "\n")


def faulty(response_text: str, answer: str, *, finished: bool, prompt: str = "", meta=None) -> float:
    tag = prompt.split(" ", 1)[0] if " " in prompt else "plain"
    if tag == "raise":
        _note(tag, "raise")
        raise RuntimeError("this reward always fails on 'raise' prompts")
    if tag == "nan":
        _note(tag, "nan")
        return float("nan")
    if tag == "hang":
        try:  # exactly one call hangs: whoever creates the marker first
            os.close(os.open(os.path.join(os.environ["MF_FAULT_DIR"], "hung"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            _note(tag, "hang")
            time.sleep(3600)
    _note(tag, "ok")
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)



def drop_every_group(rewards) -> bool:
    """A dynamic filter (rollout.dynamic_filter=tests.faults.fault_rewards:drop_every_group) that keeps nothing."""
    return False
