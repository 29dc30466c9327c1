"""`InputProcessor`: turns a prompt and its parameters into a `Request`, refusing what this engine cannot serve."""

from __future__ import annotations

import copy
import random

from transformers import GenerationConfig

from .outputs import RequestOutputKind
from .sampling_params import InvalidParameter, SamplingParams
from .sequence import Request

Prompt = str | list[int] | list[dict] | dict
PROMPT_KINDS = ("a string, a list of token ids, a list of chat messages, or vLLM's {'prompt': text} or "
                "{'prompt_token_ids': [...]}")


def is_prompt_dict(value) -> bool:
    """Whether ``value`` is one of vLLM's prompt dicts (not a chat message)."""
    return isinstance(value, dict) and ("prompt" in value or "prompt_token_ids" in value)


def tokenize_prompt(tokenizer, prompt: Prompt, add_special_tokens: bool | None = None) -> tuple[str | None, list[int]]:
    """``(text, token_ids)`` of a prompt as the engine sees it: chat messages go through the chat template. The
    tokenizer's special tokens (a BOS) are added to a text (``add_special_tokens``, default True), not to a rendered
    chat (default False: its template wrote them), as in vLLM."""
    if is_prompt_dict(prompt):
        prompt_cache_salt(prompt)  # refused before anything is tokenized
        return _unpack_prompt_dict(tokenizer, prompt, add_special_tokens is not False)
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt, add_special_tokens=add_special_tokens is not False).input_ids
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and prompt:
        try:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - the template's own error, whatever its type, names the problem
            raise ValueError(f"the chat messages cannot be rendered by the tokenizer's chat template: "
                             f"{type(err).__name__}: {err}") from err
        return text, tokenizer(text, add_special_tokens=bool(add_special_tokens)).input_ids
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"a prompt is {PROMPT_KINDS}, got {type(prompt).__name__}")


def prompt_cache_salt(prompt: Prompt) -> str | None:
    """vLLM's ``cache_salt`` of a prompt dict: the prompt's blocks are shared in the prefix cache only with prompts
    of the same salt, so that one user cannot tell from its speed whether another's prompt began the same way."""
    salt = prompt.get("cache_salt") if is_prompt_dict(prompt) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise InvalidParameter("cache_salt", f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def _unpack_prompt_dict(tokenizer, prompt: dict, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
    """vLLM's ``{"prompt": text}`` (a TextPrompt) or ``{"prompt_token_ids": [...]}`` (a TokensPrompt, whose token
    ids win over a ``prompt`` text beside them, as in vLLM)."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
    if unknown:
        raise ValueError(f"prompt dicts with {unknown} are not supported (only 'prompt', 'prompt_token_ids' and "
                         "'cache_salt')")
    text = prompt.get("prompt")
    if not isinstance(text, str) and (text is not None or "prompt_token_ids" not in prompt):
        raise ValueError(f"a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        token_ids = prompt["prompt_token_ids"]
        if not (isinstance(token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in token_ids)):
            raise ValueError("a prompt's prompt_token_ids must be a list of integers")
        return text, list(token_ids)
    return text, tokenizer(text, add_special_tokens=add_special_tokens).input_ids


class InputProcessor:
    """Tokenizes prompts (text, token ids or chat messages) and checks them, and their parameters, against the
    model's vocabulary and context and the engine's limits. Every refusal is a ``ValueError`` naming the problem."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int, eos_token_ids: set[int],
                 generation_config: GenerationConfig | None = None, seed: int | None = None,
                 scheduling_policy: str = "fcfs", tensor_parallel: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.generation_config = generation_config  # the model's: the settings that parameters leave out
        self.seeds = random.Random(seed)  # of the requests that give none
        self.scheduling_policy = scheduling_policy
        self.tensor_parallel = tensor_parallel

    def request(self, request_id: str, prompt: Prompt, params: SamplingParams | GenerationConfig | None,
                priority: int = 0) -> Request:
        params = self.sampling_params(params)
        if params.structured_outputs is not None and self.tensor_parallel:
            # Ranks would admit it when their own compile ends, at different steps, and leave lockstep.
            raise InvalidParameter("structured_outputs", "SamplingParams.structured_outputs is not supported on a "
                                   "tensor-parallel engine yet")
        text, token_ids = self.tokenize(prompt, params.truncate_prompt_tokens)
        if not token_ids:
            raise ValueError("the prompt is empty")
        self.check_prompt_length(len(token_ids))
        self.check_params(params)
        whole = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        params = params.replace(**whole) if whole else params  # vLLM's -1: the whole vocabulary's
        seed = params.seed if params.seed is not None else self.seeds.getrandbits(62)
        request = Request(request_id, text, token_ids, params, seed, self.eos_token_ids, self.tokenizer.eos_token_id,
                          bad_words_token_ids=params.bad_words_token_ids(self.tokenizer))
        request.priority = self.check_priority(priority)
        return request

    def check_priority(self, priority) -> int:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameter("priority", f"priority must be an integer, got {priority!r}")
        if priority and self.scheduling_policy != "priority":
            raise InvalidParameter("priority", f"priority {priority} needs the priority scheduling policy "
                                   "(scheduling_policy='priority', hf-paged serve --scheduling-policy priority)")
        return priority

    def sampling_params(self, params: SamplingParams | GenerationConfig | None) -> SamplingParams:
        """``params`` as `SamplingParams`: None takes the sampling settings of the model's generation config (vLLM's
        default, ``generation_config="auto"``); a `GenerationConfig` takes its sampling fields that it leaves unset
        from the model's, as `generate` does."""
        if params is None:
            return SamplingParams(**SamplingParams.model_defaults(self.generation_config))
        if isinstance(params, GenerationConfig):
            return SamplingParams.from_generation_config(_with_model_defaults(params, self.generation_config))
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams or GenerationConfig, got {type(params)}")
        params.validate()  # again: a field may have been set since the parameters were made
        return params

    def final_only(self, params):
        """``params`` asking for one output per request, when it finishes (what `run` collects); parameters that
        cannot be read are left for `add_request` to refuse, so that only their request fails."""
        try:
            return self.sampling_params(params).replace(output_kind=RequestOutputKind.FINAL_ONLY)
        except ValueError:
            return params

    def tokenize(self, prompt: Prompt, keep: int | None = None, add_special_tokens: bool | None = None,
                 pooling: bool = False) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids (see `tokenize_prompt`), its last ``keep`` tokens only if given (vLLM's
        ``truncate_prompt_tokens``, see `truncated`), checked against the vocabulary."""
        text, token_ids = tokenize_prompt(self.tokenizer, prompt, add_special_tokens)
        token_ids = self.truncated(token_ids, keep, pooling)
        self.check_token_ids(token_ids)
        return text, token_ids

    def truncated(self, token_ids: list[int], keep: int | None, pooling: bool = False) -> list[int]:
        """The last ``keep`` of ``token_ids`` (all when None; -1: as many as the context holds, leaving room for one
        new token unless they are ``pooling``'s); more than the context holds is an error, as in vLLM."""
        if keep is None:
            return token_ids
        if not isinstance(keep, int) or keep == 0 or keep < -1:
            raise InvalidParameter("truncate_prompt_tokens", f"truncate_prompt_tokens must be >= 1, or -1 (what the "
                                   f"context holds), got {keep!r}")
        if keep > self.max_model_len:
            raise InvalidParameter("truncate_prompt_tokens", f"truncate_prompt_tokens ({keep}) is more than this "
                                   f"engine's context (max_model_len) of {self.max_model_len} tokens")
        keep = self.max_model_len - (not pooling) if keep == -1 else keep
        return token_ids[len(token_ids) - min(len(token_ids), keep):]

    def check_token_ids(self, token_ids: list[int]) -> None:
        """A tokenizer can know more tokens than the model embeds; a prompt of them would fail every step it joins."""
        bad = self._outside_vocabulary(token_ids)
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the model's vocabulary (size {self.vocab_size})")

    def check_prompt_length(self, num_tokens: int, pooling: bool = False) -> None:
        """A prompt must leave room for one new token in the context (one to embed, ``pooling``, must fit it)."""
        if pooling and num_tokens > self.max_model_len:
            raise ValueError(f"the input is {num_tokens} tokens long but this engine's context (max_model_len) is "
                             f"{self.max_model_len} tokens")
        if not pooling and num_tokens >= self.max_model_len:
            raise ValueError(f"the prompt is {num_tokens} tokens long but this engine's context (max_model_len) is "
                             f"{self.max_model_len} tokens, prompt and output together")

    def _outside_vocabulary(self, token_ids) -> list[int]:
        return [t for t in token_ids if not 0 <= t < self.vocab_size]

    def check_params(self, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check on its own: the limits of this engine and this vocabulary."""
        if params.n > self.max_num_seqs:
            raise InvalidParameter("n", f"SamplingParams.n must be at most this engine's max_num_seqs "
                                   f"({self.max_num_seqs}), the most sequences it runs at once, got {params.n}")
        bad = self._outside_vocabulary(params.stop_token_ids)
        if bad:
            raise InvalidParameter("stop_token_ids", f"SamplingParams.stop_token_ids must be in the vocabulary (0 to "
                                   f"{self.vocab_size - 1}), got {bad[:5]}")
        bad = self._outside_vocabulary(params.logit_bias)
        if bad:
            raise InvalidParameter("logit_bias", f"SamplingParams.logit_bias must name token ids in the vocabulary "
                                   f"(0 to {self.vocab_size - 1}), got {bad[:5]}")
        bad = self._outside_vocabulary(params.allowed_token_ids or ())
        if bad:
            raise InvalidParameter("allowed_token_ids", "SamplingParams.allowed_token_ids must be in the vocabulary "
                                   f"(0 to {self.vocab_size - 1}), got {bad[:5]}")
        bad = [t for ids in params.bad_words_token_ids(self.tokenizer) for t in self._outside_vocabulary(ids)]
        if bad:
            raise InvalidParameter("bad_words", f"SamplingParams.bad_words tokenize to ids outside the model's "
                                   f"vocabulary (size {self.vocab_size}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise InvalidParameter(name, f"SamplingParams.{name} must be at most the vocabulary's "
                                       f"{self.vocab_size} tokens, got {value}")


_SAMPLING_FIELDS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def _with_model_defaults(config: GenerationConfig, model_config: GenerationConfig | None) -> GenerationConfig:
    """``config`` with each sampling field it leaves at Transformers' default taken from the model's config."""
    if model_config is None:
        return config
    merged, default = copy.deepcopy(config), GenerationConfig()
    for name in _SAMPLING_FIELDS:
        value = getattr(model_config, name, None)
        if value is not None and getattr(config, name, None) == getattr(default, name, None):
            setattr(merged, name, value)
    return merged


def prompt_list(prompts) -> list[Prompt]:
    """``prompts`` as a list: one prompt alone is wrapped (a string, token ids, one conversation or one vLLM prompt
    dict)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and (
            isinstance(prompts[0], int) or (isinstance(prompts[0], dict) and not is_prompt_dict(prompts[0])))):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be one prompt or a list of them; a prompt is {PROMPT_KINDS}")
    return list(prompts)


def per_prompt(value, prompts: list, what: str) -> list:
    """``value`` for each prompt: a list (or tuple) of one per prompt as it is, anything else repeated."""
    if not isinstance(value, (list, tuple)):
        return [value] * len(prompts)
    if len(value) != len(prompts):
        raise ValueError(f"{len(value)} {what} for {len(prompts)} prompts")
    return list(value)


def one_params_per_prompt(prompts, sampling_params) -> tuple[list[Prompt], list]:
    """``prompts`` as a list (`prompt_list`), with its parameters: one for all, or a list (or tuple) of one each."""
    prompts = prompt_list(prompts)
    return prompts, per_prompt(sampling_params, prompts, "sampling params")


def model_eos_token_ids(model, tokenizer) -> set[int]:
    """The tokens that end a sequence: the model's generation config's EOS ids and the tokenizer's."""
    ids = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
