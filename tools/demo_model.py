"""Build a tiny Llama and a word-level tokenizer with transformers' and tokenizers' own
classes and save them as a Hugging Face directory: docs/GENERATION.md's text demo runs on it
(nothing is downloaded). Its weights are random, so its text is word salad; the point is
that every framework writes the same salad, sampled, streamed and stopped.

    python tools/demo_model.py demo-llama
    kvports convert --from-hf demo-llama --out demo.safetensors
"""

from __future__ import annotations

import argparse
from pathlib import Path

WORDS = (
    "the a one cat dog bird fox sat ran sang slept on under near over mat box tree hill red blue green small big "
    "old young and then but so it he she they was is were happy sad quick slow here there today again home"
).split()
EOS = "<eos>"


def build(directory: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = {EOS: 0, **{word: index + 1 for index, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = Whitespace()
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.2,  # the default 0.02 gives near-uniform logits: every word equally likely
        bos_token_id=None,
        eos_token_id=vocab[EOS],  # kvports convert keeps it: generation stops there by default
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write config.json, model.safetensors, tokenizer.json")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed for the random weights (default 0)")
    args = parser.parse_args()
    print(f"wrote {build(args.directory, args.seed)}")


if __name__ == "__main__":
    main()
