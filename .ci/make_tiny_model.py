"""Build the tiny model the live tests serve with vLLM on CPU: random weights, a locally trained tokenizer.

    python .ci/make_tiny_model.py OUT_DIR

Runs with the server's venv (transformers, tokenizers, torch; nothing downloaded). The model is a
2-layer Llama (hidden 128, 2 heads of 64: vLLM's CPU attention wants head size 64) with seeded
random weights; the tokenizer a byte-level BPE with ~1000 tokens trained on a generated ASCII text,
so every token is printable ASCII and each one arrives as its own SSE chunk. The output rows of the
special tokens are zero: with random weights greedy decoding then never picks one, so no request
stops early. The same seed gives the same files.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

WORDS = ["the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "as", "with", "be", "by", "at", "this", "are", "or", "from", "an", "was", "not", "but", "all", "can", "has", "one", "have", "had", "you", "we", "will", "more", "so", "if", "no", "up", "out", "do", "any", "may", "new", "time", "two", "use", "way", "its", "see"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    vocab = WORDS + LETTERS
    out = []
    for _ in range(lines):
        out.append(" ".join(rng.choice(vocab) for _ in range(rng.randint(5, 30))))
        out.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.!?0123456789") for _ in range(60)))
    return out


def ascii_alphabet() -> list[str]:
    """The byte-level symbols of printable ASCII (GPT-2's byte-to-character map; space is 'Ġ')."""
    printable = list(range(ord("!"), ord("~") + 1))
    shifted = {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable
                                                    and b not in range(0xA1, 0xAD) and b not in range(0xAE, 0x100))}
    return [chr(b) if b in printable else shifted[b] for b in range(32, 127)]


def main(out_dir: str, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=ascii_alphabet(), limit_alphabet=95)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name in SPECIALS:
            model.lm_head.weight[fast.convert_tokens_to_ids(name)].zero_()
    model.save_pretrained(out)
    print(f"tiny model ({sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(fast)}) in {out}")


if __name__ == "__main__":
    main(sys.argv[1])
