"""A Hugging Face-format model directory built locally: seeded random weights, the config and a
word-level tokenizer, so an engine that loads such directories (vLLM, transformers) can serve
this project's tiny Llama with no model hub.

``build_checkpoint(out)`` writes ``config.json`` and ``model.safetensors``
(``LlamaModel.save``) and the tokenizer files ``tokenizer.json`` (a ``tokenizers`` WordLevel
model: ids 0-2 are ``<unk>``, ``<s>``, ``</s>``, id ``k`` >= 3 is the word ``w<k>``, words split
on whitespace) and ``tokenizer_config.json`` (``PreTrainedTokenizerFast``). Prompts sent as
token ids need no tokenizer; a text prompt's unknown words all map to ``<unk>``, so text
prompts share prefixes (turn prefix caching off when measuring prefill).

    python -m hardware.model.hf_dir --out models/tiny-llama [--seed 0] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hardware.model.config import LlamaConfig, tiny_config

SPECIAL = ("<unk>", "<s>", "</s>")
BOS_ID, EOS_ID = 1, 2


def vocabulary(vocab_size: int) -> dict[str, int]:
    """Word -> id: the three special tokens, then ``w3`` .. ``w<vocab_size - 1>``."""
    if vocab_size <= len(SPECIAL):
        raise ValueError(f"vocab_size {vocab_size} must exceed the {len(SPECIAL)} special tokens")
    return {**{t: k for k, t in enumerate(SPECIAL)},
            **{f"w{k}": k for k in range(len(SPECIAL), vocab_size)}}


def write_tokenizer(out: str | Path, vocab_size: int, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of a whitespace word-level tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(WordLevel(vocabulary(vocab_size), unk_token=SPECIAL[0]))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": SPECIAL[0],
              "bos_token": SPECIAL[1], "eos_token": SPECIAL[2], "model_max_length": max_length,
              "add_bos_token": False, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_checkpoint(out: str | Path, config: LlamaConfig | None = None, seed: int = 0,
                     dtype: str = "bfloat16") -> Path:
    """A loadable model directory at ``out``: weights, config (with BOS/EOS ids) and tokenizer."""
    import torch

    from hardware.model.llama import LlamaModel

    config = config or tiny_config()
    out = Path(out)
    LlamaModel.random(config, seed=seed, dtype=getattr(torch, dtype), device="cpu").save(out)
    with open(out / "config.json") as f:
        written = json.load(f)
    written.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    write_tokenizer(out, config.vocab_size, config.max_position_embeddings)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hardware.model.hf_dir", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = p.parse_args(argv)
    path = build_checkpoint(args.out, seed=args.seed, dtype=args.dtype)
    print(f"tiny Llama (seed {args.seed}, {args.dtype}) written to {path}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
