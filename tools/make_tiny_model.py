"""Write a tiny HF causal-LM checkpoint and a locally trained tokenizer, offline and deterministic.

    python tools/make_tiny_model.py --out runs/tiny_model                     # llama, seed 0
    python tools/make_tiny_model.py --out /tmp/q3 --arch qwen3 --seed 3
    python tools/make_tiny_model.py --out /tmp/moe --arch qwen3_moe           # 8 experts, top-2
    python tools/make_tiny_model.py --out /tmp/big --num-layers 4 --hidden-size 256   # for benchmarks
    python tools/make_tiny_model.py --out /tmp/gpu --num-layers 24 --hidden-size 1024 --vocab-size 151936  # ≈0.5B
    python tools/make_tiny_model.py --out /tmp/chat --chat                   # agent gateway: tools, Hermes format

The tokenizer is a character-level BPE model trained with the `tokenizers` library on the symbols of
the built-in synthetic tasks (digits, lower-case letters, a few separators), so one symbol is one
token, which the synthetic tasks rely on. `--vocab-size` pads the model's vocabulary past the
tokenizer's (ids without a token decode to nothing), so that a benchmark's logits, sampling and
embedding cost what a real model's do. The model gets random weights (norm weights and biases
perturbed away from their 1/0 init, so a conversion that drops them shows up in a parity check).
Output: config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json. The same arguments always give the same bytes.

`--chat` makes the variant the agent gateway is tested with: a Qwen/Hermes-style chat template
(`<|im_start|>role ... <|im_end|>`, tools listed in a system block, tool calls rendered as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `<|im_end|>` as end of turn, the symbols
that markup needs, and BPE merges learned from it — so, as with real tokenizers, encoding a text can
give other tokens than a model sampled for it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
ALPHABET = list("0123456789abcdefghijklmnopqrstuvwxyz:=+-,|? ")
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHAT_SYMBOLS = list('<>/_{}".\n')
CHAT_MERGES = 40
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in (m.tool_calls or []) %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_CORPUS = [  # what the chat variant's merges are learned from
    '<|im_start|>user\nwhat is 12+7?<|im_end|>\n<|im_start|>assistant\n',
    '<tool_call>{"name": "calc", "arguments": {"expression": "12+7"}}</tool_call>',
    '<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\nanswer: 19',
]


def build_tokenizer(chat: bool = False) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    if not chat:
        tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        # vocab_size = specials + alphabet: the trainer learns no merges, so the model is per character.
        trainer = trainers.BpeTrainer(
            vocab_size=len(SPECIAL_TOKENS) + len(ALPHABET),
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=ALPHABET,
            show_progress=False,
        )
        corpus = ["".join(ALPHABET)] * 4
    else:
        alphabet = ALPHABET + CHAT_SYMBOLS
        trainer = trainers.BpeTrainer(
            vocab_size=len(SPECIAL_TOKENS) + len(CHAT_SPECIALS) + len(alphabet) + CHAT_MERGES,
            special_tokens=SPECIAL_TOKENS + CHAT_SPECIALS,
            initial_alphabet=alphabet,
            show_progress=False,
        )
        corpus = ["".join(alphabet)] * 4 + CHAT_CORPUS * 8
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def hf_config(*, arch: str, vocab_size: int, tie: bool, num_layers: int = 2, hidden_size: int = 64,
              num_experts: int = 8, top_k: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
              intermediate_size: int = 0, max_positions: int = 256) -> dict[str, Any]:
    if hidden_size % (4 * num_heads) or num_heads % num_kv_heads:
        raise ValueError(f"--hidden-size must be a multiple of 4 × --num-heads (heads of a multiple of 4 dims) and "
                         f"--num-heads a multiple of --num-kv-heads, got {hidden_size}, {num_heads}, {num_kv_heads}")
    head_dim = hidden_size // num_heads
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.05,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "attention_bias": False, "mlp_bias": False}
    if arch == "qwen2":
        return {**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    if arch == "qwen3":
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "head_dim": head_dim, "attention_bias": False}
    # Every layer sparse (as Qwen3-30B-A3B): 8 experts, top-2 by default, probabilities renormalised over the top-k.
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"--top-k must be in [1, --num-experts={num_experts}], got {top_k}")
    return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "head_dim": head_dim, "attention_bias": False, "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": hidden_size, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False}


def make_model(*, out: str, arch: str, seed: int, tie: bool | None, num_layers: int = 2,
               hidden_size: int = 64, num_experts: int = 8, top_k: int = 2, chat: bool = False,
               vocab_size: int = 0, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 0,
               max_positions: int = 256) -> None:
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    tie = (arch != "llama") if tie is None else tie
    tokenizer = build_tokenizer(chat)
    if 0 < vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"--vocab-size {vocab_size} is below the tokenizer's {tokenizer.get_vocab_size()} tokens")
    vocab_size = max(vocab_size, tokenizer.get_vocab_size())
    config_dict = hf_config(arch=arch, vocab_size=vocab_size, tie=tie, num_layers=num_layers, hidden_size=hidden_size,
                            num_experts=num_experts, top_k=top_k, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            intermediate_size=intermediate_size, max_positions=max_positions)
    eos = "<|im_end|>" if chat else "</s>"
    config_dict["eos_token_id"] = tokenizer.token_to_id(eos)

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny_model_", dir=parent)  # renamed into place when complete
    os.chmod(tmp, 0o755)
    try:
        config = transformers.AutoConfig.for_model(**config_dict)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
                elif name.endswith("bias"):
                    param.copy_(0.05 * torch.randn(param.shape, generator=gen))
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(tmp, "tokenizer.json"),
            pad_token="<pad>", bos_token="<s>", eos_token=eos, unk_token="<unk>",
            **({"additional_special_tokens": ["<|im_start|>"]} if chat else {}),
        )
        # A plain chat template for agentic tasks: role header, content, end of turn.
        fast.chat_template = CHAT_TEMPLATE if chat else (
            "{% for m in messages %}{{ m['role'] }}|{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}assistant|{% endif %}"
        )
        fast.save_pretrained(tmp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    parser.add_argument("--arch", default="llama", choices=ARCHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4, help="attention heads (head dim = hidden / heads)")
    parser.add_argument("--num-kv-heads", type=int, default=2, help="key/value heads (GQA groups)")
    parser.add_argument("--intermediate-size", type=int, default=0, help="MLP width (default: 2 × hidden)")
    parser.add_argument("--num-experts", type=int, default=8, help="qwen3_moe: experts per layer")
    parser.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts per token")
    parser.add_argument("--chat", action="store_true", help="the chat/tool-calling variant (see above)")
    parser.add_argument("--vocab-size", type=int, default=0, help="model vocabulary (default: the tokenizer's)")
    parser.add_argument("--max-positions", type=int, default=256, help="max_position_embeddings (context length)")
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument("--tie-embeddings", dest="tie", action="store_true", default=None)
    tie.add_argument("--untie-embeddings", dest="tie", action="store_false")
    args = parser.parse_args(argv)
    if args.arch != "qwen3_moe" and (args.num_experts, args.top_k) != (8, 2):
        parser.error("--num-experts and --top-k apply to --arch qwen3_moe only")
    make_model(out=args.out, arch=args.arch, seed=args.seed, tie=args.tie, num_layers=args.num_layers,
               hidden_size=args.hidden_size, num_experts=args.num_experts, top_k=args.top_k, chat=args.chat,
               vocab_size=args.vocab_size, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
               intermediate_size=args.intermediate_size, max_positions=args.max_positions)
    print(json.dumps({"out": os.path.abspath(args.out), "arch": args.arch, "seed": args.seed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
