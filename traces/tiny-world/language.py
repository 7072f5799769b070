"""The tiny world's synthetic language: predictable enough that a brief training makes the target
(and then the drafter) confident, and second-order, so that a drafter needs its aux hidden states
(the previous token's context) and not only the current token's embedding.

A sequence is `<s>`, a prompt of random words (loss mask 0), then a response (loss mask 1) where
each word follows `RULE[group(prev2)][prev1]` with probability `P_RULE`, else a random word.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB_SIZE = 512
PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
N_WORDS = 48  # words the language uses; the rest of the vocab exists but never occurs
N_GROUPS = 4
P_RULE = 0.9


def token_strings() -> list[str]:
    return SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB_SIZE)]


@dataclass(frozen=True)
class Language:
    words: torch.Tensor  # [N_WORDS] token ids in use
    group: torch.Tensor  # [VOCAB_SIZE] group of each token (only words matter)
    rule: torch.Tensor  # [N_GROUPS, VOCAB_SIZE] next token for (group(prev2), prev1)

    @classmethod
    def make(cls, seed: int) -> Language:
        g = torch.Generator().manual_seed(seed)
        words = torch.randperm(VOCAB_SIZE - len(SPECIALS), generator=g)[:N_WORDS] + len(SPECIALS)
        words = words.sort().values
        group = torch.zeros(VOCAB_SIZE, dtype=torch.int64)
        group[words] = torch.randint(0, N_GROUPS, (N_WORDS,), generator=g)
        rule = torch.zeros(N_GROUPS, VOCAB_SIZE, dtype=torch.int64)
        rule[:, words] = words[torch.randint(0, N_WORDS, (N_GROUPS, N_WORDS), generator=g)]
        return cls(words=words, group=group, rule=rule)

    def sample(
        self, n: int, length: int, prompt_len: tuple[int, int], g: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` sequences of `length` tokens: (input_ids [n, length], loss_mask [n, length])."""
        ids = torch.empty(n, length, dtype=torch.int64)
        mask = torch.zeros(n, length, dtype=torch.int64)
        ids[:, 0] = BOS
        ids[:, 1:] = self.words[torch.randint(0, N_WORDS, (n, length - 1), generator=g)]
        plen = torch.randint(prompt_len[0], prompt_len[1] + 1, (n,), generator=g)
        follow = torch.rand(n, length, generator=g) < P_RULE
        for t in range(3, length):
            by_rule = self.rule[self.group[ids[:, t - 2]], ids[:, t - 1]]
            response = t > plen
            ids[:, t] = torch.where(response & follow[:, t], by_rule, ids[:, t])
            mask[:, t] = response.to(torch.int64)
        return ids, mask
