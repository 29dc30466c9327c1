"""`SamplingParams`: how one request is decoded, validated on creation."""

from __future__ import annotations

import copy
import json
import numbers
from dataclasses import dataclass, field, fields

from transformers import GenerationConfig

from .outputs import RequestOutputKind

_INT64_END = 2**63
FLOAT32_MAX = 3.4028234663852886e38  # sampling runs in float32
GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy, as in vLLM: dividing by them overflows float32


MAX_JSON_DEPTH = 100  # nesting of a JSON schema (or tool parameters): deeper ones exhaust Python's recursion


def json_too_deep(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` nests lists and dicts more than ``limit`` levels deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is not None:
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in children)
    return False


def _plain(value):
    """A number of another kind (numpy's, say) as Python's ``int`` or ``float``; anything else as it is."""
    if isinstance(value, bool) or type(value) in (int, float) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_utf8(text: str) -> bool:
    """False for text that UTF-8 cannot hold (a lone surrogate), which no tokenizer takes."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class InvalidParameter(ValueError):
    """A bad value of the request parameter ``param`` (a `SamplingParams` field, or a field of a server request):
    the caller's fault, told to the caller."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, with vLLM's names; exactly one field is given.

    ``json``: a JSON schema (a dict or its JSON text); ``json_object=True``: any JSON object; ``regex``: a regular
    expression the whole output matches; ``choice``: one of these strings exactly; ``grammar``: an EBNF (GBNF-style,
    ``root ::= ...``) or Lark grammar.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter("structured_outputs", "SamplingParams.structured_outputs must set exactly one of "
                                   f"json, regex, choice, grammar and json_object, got {given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as err:
                    raise InvalidParameter("structured_outputs",
                                           f"SamplingParams.structured_outputs.json is not valid JSON: {err}") from None
            self._require(isinstance(schema, dict), "json", "a JSON schema (an object)")
            self._require(not json_too_deep(schema), "json", f"a JSON schema nested at most {MAX_JSON_DEPTH} levels")
            try:
                json.dumps(schema)
            except (TypeError, ValueError) as err:
                raise InvalidParameter("structured_outputs",
                                       f"SamplingParams.structured_outputs.json is not valid JSON: {err}") from None
            object.__setattr__(self, "json", schema)
        self._require(self.regex is None or isinstance(self.regex, str), "regex", "a string")
        self._require(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()), "grammar",
                      "a non-empty string")
        self._require(self.json_object in (None, True, False), "json_object", "a boolean")
        if self.choice is not None:
            self._require(isinstance(self.choice, (list, tuple)) and self.choice
                          and all(isinstance(c, str) and c for c in self.choice), "choice",
                          "a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @staticmethod
    def _require(ok: bool, name: str, allowed: str) -> None:
        if not ok:
            raise InvalidParameter("structured_outputs", f"SamplingParams.structured_outputs.{name} must be {allowed}")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """The constraint as (kind, canonical text): equal keys compile to the same grammar.

        Schema keys keep their order: it is the order in which the output writes an object's properties.
        """
        value = getattr(self, self.kind)
        if self.kind in ("regex", "grammar"):
            return self.kind, value
        return self.kind, json.dumps(value, separators=(",", ":"), ensure_ascii=False)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key


# A generation config's settings that stand for what a server's request leaves out (vLLM's --generation-config), and
# the `SamplingParams` field each one is.
GENERATION_CONFIG_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                              "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class SamplingParams:
    """Decoding parameters of one request, with vLLM's names and meanings.

    ``temperature=0`` (or any temperature below 1e-5) is greedy. Penalties follow vLLM: ``repetition_penalty`` (> 1
    discourages every token seen in the prompt or output), ``presence_penalty`` and ``frequency_penalty`` (OpenAI's,
    on output tokens). ``seed`` makes a request's samples reproducible whatever else is in the batch (-1 is no seed, as
    in vLLM), except under speculative decoding, where they depend on when the request speculated. ``stop`` strings
    are matched on the detokenized text and cut out unless ``include_stop_str_in_output``, and so is the text of the
    token that stopped the sequence (one of ``stop_token_ids``, or EOS; its id stays in the output). ``logprobs=k``
    returns the ``k`` most likely tokens' log-probabilities (and the sampled one's) at each step, from the model's own
    distribution; ``prompt_logprobs=k`` does the same for every prompt token after the first (the output's
    ``prompt_logprobs``, whose first entry is None, and ``prompt_ranks``, each prompt token's rank; such a prompt is
    computed whole, not read from the prefix cache).
    ``logit_bias`` ({token id: -100 to 100}, OpenAI's) is added to those tokens' logits before sampling.
    ``allowed_token_ids`` restricts every output token to those ids. ``bad_words`` are never completed: a word's
    last token is masked whenever the output ends with the tokens before it (each word is tokenized alone and, where
    that gives as many tokens, after a space too; vLLM's rule). ``truncate_prompt_tokens=k`` keeps a prompt's last
    ``k`` tokens (-1: as many as leave room for one new token in the context), before the prompt is checked.
    ``structured_outputs`` (`StructuredOutputsParams`) constrains the output to a JSON schema, a regular expression,
    a choice of strings or a grammar: tokens that would leave it are masked before penalties, temperature and top-k/p,
    and the output ends (``finish_reason="stop"``) when the constraint is complete and the model emits its end token.
    ``output_kind`` says what each output of the request carries (see `RequestOutputKind`).
    ``use_beam_search=True`` decodes by beam search of width ``n`` as Transformers' ``generate(num_beams=n)`` does
    (see `beam_search`; one beam is greedy decoding): the ``n`` best finished beams come back, best first, once the
    search ends; ``length_penalty``, ``early_stopping`` and ``repetition_penalty`` (on the log-probabilities) are
    Transformers'. It ranks by the model's own log-probabilities, so the sampling fields (temperature, top_p, top_k,
    min_p, seed) play no part, and the other fields that would change them or cut a beam short are refused with it.
    ``logprobs=-1`` (and ``prompt_logprobs=-1``) asks for the whole vocabulary's, as in vLLM. ``detokenize=False``
    leaves the output's text empty (token ids only; no stop strings then), and ``extra_args`` is carried for whoever
    reads the parameters. Per-request ``logits_processors`` are refused, as vLLM V1 refuses them.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    detokenize: bool = True
    extra_args: dict | None = None
    logits_processors: list | None = None
    # ((tokenizer, bad_words) it was made from, their token sequences): see `bad_words_token_ids`
    _bad_words_token_ids: tuple[tuple, list[list[int]]] | None = field(default=None, init=False, repr=False,
                                                                        compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalise and check every field; raises `InvalidParameter` naming the first bad one. Runs on creation, and
        again when the engine takes the parameters (a field may have been changed since)."""
        self._copy_containers()
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        self._check_types()
        self._check(self.n >= 1, "n", self.n, "an integer >= 1")
        self._check(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 means greedy)")
        self._check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        self._check(self.top_k >= 0 or self.top_k == -1, "top_k", self.top_k, "0 or -1 (off) or a positive integer")
        self._check(self.top_k < _INT64_END, "top_k", self.top_k, "below 2**63")
        self._check(self.seed is None or -_INT64_END <= self.seed < _INT64_END, "seed", self.seed,
                    "a 64-bit signed integer")
        self._check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        self._check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        self._check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        self._check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        self._check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        self._check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            self._check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens, "<= max_tokens")
        self._check(self.logprobs is None or self.logprobs >= -1, "logprobs", self.logprobs,
                    ">= 0, or -1 (the whole vocabulary's)")
        self._check(self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
                    "truncate_prompt_tokens", self.truncate_prompt_tokens, ">= 1, or -1 (what the context holds)")
        self._check(self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs",
                    self.prompt_logprobs, ">= 0, or -1 (the whole vocabulary's)")
        self._check(self.detokenize or not self.stop, "stop", self.stop,
                    "empty when detokenize is False (stop strings are found in the text)")
        self._check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", self.extra_args,
                    "a dict")
        if self.logits_processors:
            raise InvalidParameter("logits_processors", "SamplingParams.logits_processors: per-request logits "
                                   "processors are not supported (nor in vLLM V1); logit_bias, allowed_token_ids, "
                                   "bad_words and structured_outputs shape the logits")
        self._check(all(s for s in self.stop), "stop", self.stop, "non-empty strings")
        self._check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
                    self.allowed_token_ids, "a non-empty list of token ids")
        self._check(all(isinstance(w, str) and w.strip() and _is_utf8(w) for w in self.bad_words), "bad_words",
                    self.bad_words, "a list of non-empty strings (that UTF-8 can hold)")
        self._check(all(-100 <= v <= 100 for v in self.logit_bias.values()), "logit_bias", self.logit_bias,
                    "a map of token ids to numbers in [-100, 100]")
        self._check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                    "structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
        self._check(isinstance(self.output_kind, RequestOutputKind), "output_kind", self.output_kind,
                    "a RequestOutputKind")
        if self.top_k == -1:
            self.top_k = 0
        if self.use_beam_search:
            self._check_beam_search()

    # Fields beam search cannot honour (it ranks by the model's own log-probabilities), with their "off" values.
    _NOT_WITH_BEAMS = {"logprobs": None, "min_tokens": 0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0, "stop": [], "logit_bias": {}, "allowed_token_ids": None,
                       "bad_words": [], "structured_outputs": None}

    def _check_beam_search(self) -> None:
        for name, off in self._NOT_WITH_BEAMS.items():
            if getattr(self, name) != off:
                raise InvalidParameter(name, f"SamplingParams.{name} cannot be used with use_beam_search (beam search "
                                       "ranks beams by the model's own log-probabilities)")
        self._check(self.early_stopping in (True, False, "never"), "early_stopping", self.early_stopping,
                    'True, False or "never"')

    def _copy_containers(self) -> None:
        """The list and map fields as this object's own lists and dict (a lone stop string becomes a list)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check(isinstance(self.stop, (list, tuple, type(None))), "stop", self.stop,
                    "a string or a list of strings")
        self._check(isinstance(self.stop_token_ids, (list, tuple, type(None))), "stop_token_ids", self.stop_token_ids,
                    "a list of integers")
        self._check(isinstance(self.logit_bias, (dict, type(None))), "logit_bias", self.logit_bias,
                    "a map of token ids to numbers in [-100, 100]")
        self._check(isinstance(self.allowed_token_ids, (list, tuple, type(None))), "allowed_token_ids",
                    self.allowed_token_ids, "a non-empty list of token ids")
        self._check(isinstance(self.bad_words, (list, tuple, type(None))), "bad_words", self.bad_words,
                    "a list of non-empty strings")
        self.stop = list(self.stop or [])
        self.allowed_token_ids = None if self.allowed_token_ids is None else list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's), to change without changing this one."""
        return copy.deepcopy(self)

    def _check_types(self) -> None:
        numeric = ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed",
                   "truncate_prompt_tokens", "temperature", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "length_penalty")
        for name in numeric:
            setattr(self, name, _plain(getattr(self, name)))
        self.stop_token_ids = [_plain(t) for t in self.stop_token_ids]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [_plain(t) for t in self.allowed_token_ids]
        self.logit_bias = {_plain(t): _plain(v) for t, v in self.logit_bias.items()}
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None or name in ("n", "top_k", "min_tokens"):
                self._check(_is_int(value), name, value, "an integer")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "length_penalty"):
            value = getattr(self, name)
            self._check(_is_real(value) and abs(value) <= FLOAT32_MAX, name, value, "a finite float32 number")
        # "false" would read as True
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "use_beam_search",
                     "detokenize"):
            self._check(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        self._check(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
                    "a list of integers")
        self._check(all(isinstance(t, str) for t in self.stop), "stop", self.stop, "a string or a list of strings")
        self._check(all(_is_int(t) for t in self.allowed_token_ids or ()), "allowed_token_ids",
                    self.allowed_token_ids, "a non-empty list of token ids")
        self._check(all(_is_int(t) and _is_real(v) for t, v in self.logit_bias.items()), "logit_bias",
                    self.logit_bias, "a map of token ids to numbers in [-100, 100]")

    @staticmethod
    def _check(ok: bool, name: str, value, allowed: str) -> None:
        if not ok:
            raise InvalidParameter(name, f"SamplingParams.{name} must be {allowed}, got {value!r}")

    @property
    def greedy(self) -> bool:
        """Whether no token is drawn at random (a beam search draws none either: its sampled token goes unused)."""
        return self.temperature < GREEDY_TEMPERATURE or self.use_beam_search

    @staticmethod
    def model_defaults(config: GenerationConfig | None) -> dict:
        """The sampling settings a model's own generation config recommends, as `SamplingParams` fields (vLLM's
        ``--generation-config auto``): its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens
        (as ``max_tokens``), where it sets them. A server uses them for what a request leaves out."""
        return {field: getattr(config, name) for name, field in GENERATION_CONFIG_DEFAULTS.items()
                if config is not None and getattr(config, name, None) is not None}

    @classmethod
    def from_generation_config(cls, config: GenerationConfig) -> "SamplingParams":
        """Map a Transformers `GenerationConfig` onto `SamplingParams`; anything that cannot be mapped is an error."""
        defaults = GenerationConfig()
        # What `generate` takes where a config leaves a field unset (Transformers 5 keeps None in the config).
        fallback = getattr(GenerationConfig, "_get_default_generation_params", dict)()
        supported = {
            "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens",
            "min_new_tokens", "num_return_sequences", "stop_strings", "eos_token_id", "pad_token_id", "bos_token_id",
            "use_cache", "return_dict_in_generate", "max_length", "cache_implementation", "num_beams",
            "length_penalty", "early_stopping",
            "transformers_version", "_from_model_config",
        }
        # No equivalent, but fine when off (logits: ask for SamplingParams.logprobs).
        off = {"output_scores", "output_logits", "output_attentions", "output_hidden_states"}
        unmapped = [
            key for key, value in config.to_diff_dict().items()
            if key not in supported and value not in (getattr(defaults, key, None), fallback.get(key))
            and not (key in off and value is False)
        ]
        if unmapped:
            raise ValueError(f"GenerationConfig options with no SamplingParams equivalent: {sorted(unmapped)}")
        if config.max_new_tokens is None and config.max_length not in (defaults.max_length, fallback.get("max_length")):
            raise ValueError("GenerationConfig.max_length cannot be mapped (prompts differ in length): "
                             "use max_new_tokens")
        sample, beams = bool(config.do_sample), (config.num_beams or 1) > 1
        if sample and beams:
            raise ValueError("GenerationConfig do_sample with num_beams > 1 (beam sampling) has no SamplingParams "
                             "equivalent")
        return cls(
            # A beam search returns all its beams, best first: the first num_return_sequences are generate's.
            n=config.num_beams if beams else config.num_return_sequences or 1,
            use_beam_search=beams,
            length_penalty=config.length_penalty if config.length_penalty is not None else 1.0,
            early_stopping=config.early_stopping if config.early_stopping is not None else False,
            temperature=(config.temperature if config.temperature is not None else 1.0) if sample else 0.0,
            top_p=(config.top_p if config.top_p is not None else 1.0) if sample else 1.0,
            top_k=(config.top_k if config.top_k is not None else fallback.get("top_k", 0)) if sample else 0,
            min_p=(config.min_p or 0.0) if sample else 0.0,
            repetition_penalty=config.repetition_penalty or 1.0,
            # Unset, generate makes max_length's default (20) new tokens.
            max_tokens=config.max_new_tokens if config.max_new_tokens is not None else fallback.get("max_length", 20),
            min_tokens=config.min_new_tokens or 0,
            stop=config.stop_strings,
            include_stop_str_in_output=bool(config.stop_strings),  # generate's text ends with the stop string
            # generate stops at the config's end tokens only: they replace the model's and the tokenizer's.
            stop_token_ids=[config.eos_token_id] if isinstance(config.eos_token_id, int) else config.eos_token_id,
            ignore_eos=config.eos_token_id is not None,
        )

    def bad_words_token_ids(self, tokenizer) -> list[list[int]]:
        """The token sequences of ``bad_words``: each word with its leading spaces stripped, and again after one
        space where that starts with another token but has as many (vLLM's rule). Tokenized once per parameters
        object (the server does it on a tokenizing thread, so the engine's lock never waits for a tokenizer)."""
        # A copy of the tokenizer (a server's tokenizing thread has its own) finds what the original made.
        key = (getattr(tokenizer, "name_or_path", None), len(tokenizer), tuple(self.bad_words))
        if self._bad_words_token_ids is None or self._bad_words_token_ids[0] != key:
            sequences = []
            for word in self.bad_words:
                plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
                spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
                sequences += [plain] if plain else []  # a word some normalizer erases bans nothing
                if plain and len(spaced) == len(plain) and spaced[0] != plain[0]:
                    sequences.append(spaced)
            self._bad_words_token_ids = (key, sequences)
        return self._bad_words_token_ids[1]

    def replace(self, **changes) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update(changes)
        return SamplingParams(**values)

