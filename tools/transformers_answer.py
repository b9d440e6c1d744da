"""transformers' own greedy answer to a chat prompt on a GGUF file: the referee's line beside the
ports' in the README. transformers dequantizes the file (GgufConfig(dequantize=True); without it
it multiplies the packed blocks in float32 whatever dtype is asked) and renders the file's chat
template itself.

    python tools/transformers_answer.py "${KVPORTS_HOME:-$HOME/.cache/kvports}/SmolLM2-135M-Instruct.Q4_1.gguf" \
        "What is the capital of France?"
"""

from __future__ import annotations

import argparse
from pathlib import Path


def answer(path: Path, question: str, new_tokens: int) -> tuple[list[int], str]:
    import torch
    import transformers

    from kvports.baselines.hf_transformers import load_gguf

    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = load_gguf(path)
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])  # [1, P]
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )  # [1, P + N]
    generated = out[0, prompt.shape[1] :].tolist()
    return generated, tokenizer.decode(generated, skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("question")
    parser.add_argument("--new-tokens", type=int, default=100)
    args = parser.parse_args()
    generated, text = answer(args.gguf, args.question, args.new_tokens)
    print(f"transformers greedy float32 (GGUF dequantized), {len(generated)} tokens")
    print("  generated", " ".join(map(str, generated)))
    print("  answer   ", text)


if __name__ == "__main__":
    main()
