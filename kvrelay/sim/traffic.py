"""Deterministic request generator with heavy prefix sharing.

Prompts = one of a small pool of system prompts (Zipf-ish popularity, shared by every engine built
from the same seed) + a random user suffix; some requests continue an earlier prompt (multi-turn),
some use a loaded LoRA adapter, some carry a cache salt; optionally some resend a recent prompt
cut to whole blocks (``repeat_fraction``: vLLM recomputes the last block of a fully cached prompt)
and some ask for ``parallel_n`` samples (``parallel_fraction``: sibling requests of one prompt).
All draws come from a seeded RNG (the optional ones only when their fraction is not 0).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrafficConfig:
    n_system_prompts: int = 8
    system_len: tuple[int, int] = (32, 256)
    user_len: tuple[int, int] = (4, 96)
    max_new_tokens: tuple[int, int] = (4, 48)
    arrivals_per_step: float = 1.0
    multi_turn_fraction: float = 0.25
    lora_fraction: float = 0.2
    salt_fraction: float = 0.1
    salts: tuple[str, ...] = ("tenant-a", "tenant-b")
    vocab: tuple[int, int] = (1000, 150000)
    max_prompt_tokens: int = 1024  # multi-turn prompts stop growing past this
    repeat_fraction: float = 0.0  # resend a recent prompt cut to a multiple of the block size
    parallel_fraction: float = 0.0  # requests sampled n > 1 times (parallel_n siblings)
    parallel_n: int = 2


@dataclass(slots=True)
class RequestSpec:
    prompt: list[int]
    lora_name: str | None
    cache_salt: str | None
    max_new_tokens: int


def _tokens(rng: random.Random, n: int, vocab: tuple[int, int]) -> list[int]:
    return [rng.randint(vocab[0], vocab[1]) for _ in range(n)]


class TrafficGenerator:
    """Draws ``RequestSpec``s; the system-prompt pool depends only on ``pool_seed``."""

    def __init__(self, cfg: TrafficConfig, pool_seed: int, stream_seed: int) -> None:
        self.cfg = cfg
        pool_rng = random.Random(pool_seed)
        self.system_prompts = [
            _tokens(pool_rng, pool_rng.randint(*cfg.system_len), cfg.vocab)
            for _ in range(cfg.n_system_prompts)
        ]
        self.weights = [1.0 / (i + 1) for i in range(cfg.n_system_prompts)]
        self.rng = random.Random(stream_seed)
        self.recent: deque[tuple[list[int], str | None, str | None]] = deque(maxlen=16)

    def hot_prefix(self, n_tokens: int) -> list[int]:
        """The first ``n_tokens`` of the most popular system prompt: under traffic its blocks are
        almost always cached, so a query for it shows a hit (``kvrelay sim`` / ``demo`` print
        it)."""
        return self.system_prompts[0][:n_tokens]

    def arrivals(self) -> int:
        """Number of new requests this step (integer part + Bernoulli fractional part)."""
        a = self.cfg.arrivals_per_step
        n = int(a)
        return n + (1 if self.rng.random() < a - n else 0)

    def siblings(self) -> int:
        """How many samples the next request asks for (its sibling requests)."""
        cfg = self.cfg
        if cfg.parallel_fraction and self.rng.random() < cfg.parallel_fraction:
            return max(1, cfg.parallel_n)
        return 1

    def next_request(self, loras: list[str], block_size: int = 0) -> RequestSpec:
        cfg, rng = self.cfg, self.rng
        repeat = cfg.repeat_fraction and self.recent and block_size
        if repeat and rng.random() < cfg.repeat_fraction:
            base, lora, salt = self.recent[rng.randrange(len(self.recent))]
            cut = len(base) // block_size * block_size
            if cut:
                return RequestSpec(base[:cut], lora, salt, rng.randint(*cfg.max_new_tokens))
        turn = rng.random() < cfg.multi_turn_fraction
        user = rng.randint(*cfg.user_len)
        base, lora, salt = (
            self.recent[rng.randrange(len(self.recent))] if self.recent else ([], None, None)
        )
        if turn and base and len(base) + user <= cfg.max_prompt_tokens:
            prompt = base + _tokens(rng, user, cfg.vocab)
        else:
            sys_prompt = rng.choices(self.system_prompts, weights=self.weights)[0]
            prompt = sys_prompt + _tokens(rng, user, cfg.vocab)
            lora = rng.choice(loras) if loras and rng.random() < cfg.lora_fraction else None
            salt = rng.choice(cfg.salts) if cfg.salts and rng.random() < cfg.salt_fraction else None
        self.recent.append((prompt, lora, salt))
        return RequestSpec(prompt, lora, salt, rng.randint(*cfg.max_new_tokens))
