"""Tiny Llama-family checkpoints written offline for the generate tests: config.json,
model.safetensors and (optionally) a word-level tokenizer, in a folder like a downloaded model."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
         "his", "her", "an", "are", "were", "which", "be", "this", "it", "not", "or", "have", "had", "one",
         "all", "but", "they", "there", "been", "has", "more", "when", "who", "will", "would", "their",
         "what", "so", "tree", "ring", "attention", "rank", "shard", "page", "token", "cache", "merge",
         "decode", "prefill", "model", "layer", "head", "key", "value"]

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=160, max_position_embeddings=4096,
            initializer_range=0.3)


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over :data:`WORDS` (ids 1..), ``[UNK]`` = 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def write_checkpoint(folder: Path, model_type: str = "llama", seed: int = 0, tokenizer: bool = False,
                     **overrides) -> Path:
    """Build a tiny random model of ``model_type`` (llama, qwen2, mistral) and save it to ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        write_tokenizer(folder)
    return folder


@torch.inference_mode()
def transformers_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers alone: its sdpa attention and DynamicCache, the whole prompt
    in one forward, then one token per forward. Independent of tree-attn's code."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([list(prompt)], device=dev), cache=cache, use_cache=True).logits
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < n:
        logits = model(input_ids=torch.tensor([[tokens[-1]]], device=dev), cache=cache, use_cache=True).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens
