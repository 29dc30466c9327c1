"""`ServerLimits`: what one HTTP call may ask of the server, checked before any of it reaches the engine.

Every limit is a ``hf-paged serve`` option. A call over a limit is a 400 that names the field (or a 413 for the body,
a 503 with ``Retry-After`` when the server is full), so no single call can stall or exhaust the others.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..generation import InvalidParameter
from .protocol import APIError, GenerationRequest

OPENAI_MAX_N = 128


@dataclass
class ServerLimits:
    """Limits per call and per server; the defaults follow OpenAI's API and TGI's launcher where they have one."""

    max_body_bytes: int = 4 << 20  # a request body, read before anything is parsed
    max_client_batch_size: int = 32  # prompts in one /v1/completions call
    max_embedding_inputs: int = 2048  # inputs in one /v1/embeddings call (OpenAI's limit)
    max_concurrent_requests: int = 512  # generation calls in progress at once
    max_num_waiting: int = 1024  # sequences queued beyond the max_num_seqs that one step runs
    max_n: int | None = None  # samples per prompt; None: half of max_num_seqs, at most OpenAI's 128
    max_stop_sequences: int = 32  # OpenAI's is 4, vLLM has none: evaluation harnesses send more than 4
    max_stop_length: int = 256  # characters of one stop string
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300  # OpenAI's limit
    max_bad_words: int = 64  # each of at most max_stop_length characters
    max_allowed_token_ids: int = 65536
    max_logprobs: int = 20  # alternatives per token (OpenAI's top_logprobs limit, vLLM's max_logprobs; -1: all)
    max_logprob_entries: int = 1 << 20  # n x prompts x (logprobs + 1) x new tokens (a default max_tokens gives way)
    max_chars_per_token: int = 32  # prompts longer than max_model_len x this are refused before tokenizing
    max_constraint_size: int = 128 << 10  # characters of a structured-output constraint (its grammar compiles first)
    tokenizer_workers: int = 2  # threads that tokenize prompts and render chat templates
    stream_write_timeout: int = 60  # seconds a client may read nothing while its outputs wait, then it is cut off
    body_read_timeout: int = 30  # seconds a request body may take to arrive, then it is a 408

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            unset = (value is None and field.name == "max_n") or (value == -1 and field.name == "max_logprobs")
            if not unset and (not isinstance(value, int) or value < 1):
                raise InvalidParameter(field.name, f"{field.name} must be a positive integer, got {value!r}")

    def resolved_max_n(self, max_num_seqs: int) -> int:
        """The most samples per prompt: by default half the batch, so one call never takes every seat."""
        if self.max_n is not None:
            return self.max_n
        return max(1, min(OPENAI_MAX_N, max_num_seqs // 2))

    def check_body(self, body: GenerationRequest, max_num_seqs: int, vocab_size: int,
                   whole: set[str] = frozenset()) -> None:
        """The per-call limits that need only the body (before tokenization); raises a 400 naming the field.
        ``whole``: the fields that asked for the whole vocabulary's logprobs (-1), now counted as ``vocab_size``."""
        max_n = self.resolved_max_n(max_num_seqs)
        if body.n is not None and body.n > max_n:
            _refuse("n", f"n must be at most {max_n} on this server (--max-n; by default half of max_num_seqs="
                         f"{max_num_seqs}, so one call leaves seats for others), got {body.n}")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        _at_most("stop", len(stop), self.max_stop_sequences, "stop strings", "--max-stop-sequences")
        longest = max((len(s) for s in stop), default=0)
        _at_most("stop", longest, self.max_stop_length, "characters in a stop string", "--max-stop-length")
        _at_most("stop_token_ids", len(body.stop_token_ids or ()), self.max_stop_token_ids, "stop_token_ids",
                 "--max-stop-token-ids")
        _at_most("logit_bias", len(body.logit_bias or ()), self.max_logit_bias, "logit_bias entries",
                 "--max-logit-bias")
        _at_most("bad_words", len(body.bad_words or ()), self.max_bad_words, "bad_words", "--max-bad-words")
        _at_most("allowed_token_ids", len(body.allowed_token_ids or ()), self.max_allowed_token_ids,
                 "allowed_token_ids", "--max-allowed-token-ids")
        longest = max((len(word) for word in body.bad_words or ()), default=0)
        _at_most("bad_words", longest, self.max_stop_length, "characters in a bad word", "--max-stop-length")
        param, logprobs = body.logprobs_param()
        most = vocab_size if self.max_logprobs == -1 else self.max_logprobs
        for name, value in ((param, logprobs or 0), ("prompt_logprobs", body.prompt_logprobs or 0)):
            asked = f"-1 (the whole vocabulary's, {value})" if name in whole else value
            _at_most(name, value, most, name, "--max-logprobs", asked)

    def check_constraint(self, param: str, text: str) -> None:
        """A constraint's canonical text (a schema's JSON, a regex, a grammar): its compile time grows faster than its
        size, and constrained calls wait for one another's."""
        _at_most(param, len(text), self.max_constraint_size, f"characters in {param}", "--max-constraint-size")

    def check_prompt_count(self, num_prompts: int) -> None:
        _at_most("prompt", num_prompts, self.max_client_batch_size, "prompts in one call", "--max-client-batch-size")

    def check_embedding_inputs(self, num_inputs: int, param: str = "input") -> None:
        _at_most(param, num_inputs, self.max_embedding_inputs, "inputs in one call", "--max-embedding-inputs")

    def logprob_room(self, body: GenerationRequest, n: int, prompt_tokens: list[int]) -> int | None:
        """The most new tokens each prompt may generate for the call's log-probabilities to stay within the limit
        (None: it asks for no new tokens' log-probabilities)."""
        per_new_token, per_prompt_token = _logprob_entries_per_token(body, n)
        if not per_new_token:
            return None
        left = self.max_logprob_entries - per_prompt_token * sum(prompt_tokens)
        return max(0, left // (per_new_token * len(prompt_tokens)))

    def check_logprob_entries(self, body: GenerationRequest, n: int, new_tokens: list[int],
                              prompt_tokens: list[int]) -> None:
        """Bound the log-probabilities one call returns: ``new_tokens`` is the most each prompt can generate; its
        prompt's logprobs come too when they are asked (``echo`` or ``prompt_logprobs``)."""
        per_new_token, per_prompt_token = _logprob_entries_per_token(body, n)
        entries = per_new_token * sum(new_tokens) + per_prompt_token * sum(prompt_tokens)
        param = body.logprobs_param()[0] if per_new_token else "prompt_logprobs"
        if entries > self.max_logprob_entries:
            _refuse(param, f"n x (logprobs + 1) x tokens (new ones, and the prompt's when its logprobs are asked) "
                           f"over all prompts is {entries} log-probabilities, more than this server returns for one "
                           f"call ({self.max_logprob_entries}, --max-logprob-entries): lower max_tokens, n or {param}")


def _logprob_entries_per_token(body: GenerationRequest, n: int) -> tuple[int, int]:
    """How many log-probabilities one new token and one prompt token of a call return (over its ``n`` answers)."""
    _, logprobs = body.logprobs_param()
    return (0 if logprobs is None else n * (logprobs + 1)), body.prompt_logprob_entries(n)


def _at_most(param: str, value: int, limit: int, what: str, option: str, asked: object = None) -> None:
    if value > limit:
        _refuse(param, f"at most {limit} {what} are allowed on this server ({option}), got "
                       f"{value if asked is None else asked}")


def _refuse(param: str, message: str) -> None:
    raise APIError(400, message, param=param)
