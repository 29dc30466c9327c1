"""`EngineStats`: what the engine has done so far and holds now, as `ContinuousBatchGenerator.stats` reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    num_partial_prefills: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    # Speculative decoding: steps that verified guesses of a sequence, guesses verified, guesses kept.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # guesses kept at each position (the first: 0)
    # LoRA (an engine with enable_lora): max_loras, and the names of the adapters of running and of waiting requests.
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        """Kept guesses over verified guesses (None before any)."""
        if not self.spec_decode_num_draft_tokens:
            return None
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens

    @property
    def spec_decode_mean_accepted_length(self) -> float | None:
        """Tokens a sequence gained per step that verified its guesses: the kept guesses and the model's own."""
        if not self.spec_decode_num_drafts:
            return None
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts
