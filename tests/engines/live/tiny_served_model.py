"""A tiny model that a real server serves on a CPU, made here (no hub): a byte-level BPE
tokenizer trained on a few sentences, with a chat template, and random bf16 weights. `llama`
(head size 32, the smallest vLLM's CPU attention kernel takes) for vLLM; `gpt2` for SGLang,
whose rotary embedding on a CPU without AMX needs vLLM's compiled ops, which GPT-2's learned
positions do not use. Usage: tiny_served_model.py DIR [llama|gpt2]. Its words are noise:
the tests assert structure, token counts and kvguard's findings."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Tenant A asks about the quarterly report.",
    "Tenant B writes a poem about the sea.",
    "kvguard keeps every page of KV cache with its owner.",
]


def main(out: Path, arch: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(SENTENCES * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(out)
    torch.manual_seed(0)
    if arch == "gpt2":
        gpt2 = GPT2Config(
            vocab_size=len(fast),
            n_positions=1024,
            n_embd=128,
            n_layer=2,
            n_head=4,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            torch_dtype="bfloat16",
        )
        GPT2LMHeadModel(gpt2).to(torch.bfloat16).save_pretrained(out)
        return
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "llama")
