"""The tiny world's target: a small HF Llama (8 layers, so the default aux layers HF hs[2], hs[4],
hs[5] and the one-layer-shifted ones differ), trained briefly on the synthetic language, saved
with `save_pretrained` in bf16 next to a word-level tokenizer that SGLang can load."""

from __future__ import annotations

from pathlib import Path

import torch
from language import BOS, EOS, PAD, UNK, VOCAB_SIZE, Language, token_strings
from transformers import LlamaConfig, LlamaForCausalLM

NUM_LAYERS = 8


def target_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        # head_dim 32: vLLM's CPU attention and rotary op refuse head_dim 16 (sizes 32, 64, ...)
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        attn_implementation="sdpa",
    )


def train_target(lang: Language, seed: int, steps: int, batch: int, length: int):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(target_config()).float()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=6e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        ids, _ = lang.sample(batch, length, (4, 12), g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return model, float(loss.detach())


def save_target(model, out: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)


def save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(token_strings())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS_UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=SPECIALS_UNK,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}{% endif %}"
    )
    fast.save_pretrained(out)


SPECIALS_UNK = token_strings()[UNK]
