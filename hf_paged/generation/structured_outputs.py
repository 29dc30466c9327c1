"""Constrained decoding: grammars compiled from `StructuredOutputsParams`, per-sequence matchers and token bitmasks.

The only module that knows the backend, xgrammar: its matchers accept a token, roll back and fork cheaply, each
fills its row of a step's bitmask, and its CPU kernel masks fp32/bf16 logits in place (a Triton/CUDA one on GPU).
Grammars compile in a process of their own (`grammar_worker`, so one that takes too long can be stopped), waited for
on a background thread, never on the engine thread, and are cached by their constraint's canonical text.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .sampling_params import InvalidParameter, StructuredOutputsParams

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:42: " before a message
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.M)  # a grammar with such a rule is EBNF, else Lark
# Seconds a constraint may take to compile (vLLM sets none); past them it is refused. Usual ones take well under one.
COMPILE_TIMEOUT_S = 30.0


def _xgrammar():
    import xgrammar  # takes about a second: imported when the first constrained request comes

    return xgrammar


class GrammarTooSlow(InvalidParameter):
    """A constraint whose grammar work for one token took longer than `GrammarMatcher.max_seconds_per_token`."""


class GrammarMatcher:
    """Where one sequence's output stands in its grammar.

    The work of one token (filling its bitmask row, accepting the token) runs on the engine thread, and for an
    ambiguous grammar (nested bounded repetitions such as ``((a{0,60}){0,60}){0,60}``) it grows several-fold with
    every token: past ``max_seconds_per_token`` the token raises `GrammarTooSlow`, which fails that request alone.
    The time is the engine thread's CPU time, so waiting for the interpreter lock (another thread's long ``json.dumps``)
    or for a core does not count.
    """

    max_seconds_per_token = 0.25  # legitimate grammars take a few milliseconds per token at most

    def __init__(self, matcher: "xgrammar.GrammarMatcher", vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size
        self.spent = 0.0  # seconds of grammar work on the coming token so far

    @classmethod
    def of(cls, grammar: "xgrammar.CompiledGrammar") -> "GrammarMatcher":
        """A matcher at the start of a compiled grammar (what `GrammarCompiler.compile` gives)."""
        return cls(_xgrammar().GrammarMatcher(grammar), grammar.tokenizer_info.vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no change) if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """The grammar is complete and its end token was accepted."""
        return self._matcher.is_terminated()

    def advance(self, token_id: int) -> bool:
        """Accept a sampled token; False when the output must end here: its grammar is complete (the token was an
        end token), or the token is outside the grammar, which masking makes impossible. Raises `GrammarTooSlow`."""
        start = time.thread_time()
        accepted = self.accept(token_id)
        spent, self.spent = self.spent + time.thread_time() - start, 0.0
        if spent > self.max_seconds_per_token:
            raise GrammarTooSlow("structured_outputs", f"SamplingParams.structured_outputs took {spent:.3g} s of "
                                 f"grammar work for one token (at most {self.max_seconds_per_token} s): a constraint "
                                 "this ambiguous would stall every other request")
        return accepted and not self.is_terminated()

    def accept_text(self, text: str) -> bool:
        """Advance by text that tokens already carried (no change, and False, if the grammar does not allow it)."""
        return self._matcher.accept_string(text)

    def fork(self) -> "GrammarMatcher":
        return GrammarMatcher(self._matcher.fork(), self.vocab_size)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, off the caller's thread, with an LRU cache.

    ``end_token_ids`` are the tokens a finished grammar allows (the model's end-of-sequence tokens); a constraint
    that takes more than ``compile_timeout`` seconds to compile is refused.
    """

    def __init__(self, tokenizer, vocab_size: int, end_token_ids, cache_size: int = 256,
                 compile_timeout: float = COMPILE_TIMEOUT_S):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.end_token_ids = sorted(end_token_ids)
        self.cache_size, self.compile_timeout = cache_size, compile_timeout
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hf-paged-grammar")  # one: _compile is not reentrant
        self._info = None  # an xgrammar.TokenizerInfo, built on first use: it reads the whole vocabulary

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar; it raises ``ValueError`` naming the field if the constraint is invalid.
        A schema the backend would compile but not enforce is refused at once (``ValueError``)."""
        if spec.json is not None and (unsupported := unenforced_schema_keywords(spec.json)):
            raise InvalidParameter("structured_outputs", f"SamplingParams.structured_outputs.json uses "
                                   f"{', '.join(unsupported)}, which the grammar backend cannot enforce (outputs "
                                   "could break the schema)")
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is None or future.cancelled() or _failed_by_chance(future):
                future = self._cache[key] = self._pool.submit(self._compile, spec)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        from .grammar_worker import compile_process

        xgrammar = _xgrammar()
        if self._info is None:
            self._info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                 stop_token_ids=self.end_token_ids)
            self._info_json = self._info.serialize_json()
            self._info_key = hashlib.sha256(self._info_json.encode()).hexdigest()
        compiled = compile_process().compile(self._info_key, self._info_json, spec, self.compile_timeout)
        return xgrammar.CompiledGrammar.deserialize_json(compiled, self._info)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _failed_by_chance(future: Future) -> bool:
    """Whether a compile failed for a reason other than its constraint (its process killed, say): it is tried again."""
    return future.done() and not isinstance(future.exception(), (type(None), InvalidParameter))


def grammar_compiler(tokenizer_info_json: str) -> "xgrammar.GrammarCompiler":
    """The backend's compiler for a tokenizer (`grammar_worker` builds one per tokenizer)."""
    xgrammar = _xgrammar()
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1,
                                    cache_enabled=False)


def compile_grammar(compiler: "xgrammar.GrammarCompiler", spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
    """``spec``'s grammar (in `grammar_worker`'s process); ``InvalidParameter`` names what the backend refuses."""
    try:
        if spec.json is not None:
            return compiler.compile_json_schema(spec.json, any_whitespace=False)
        if spec.json_object:
            return compiler.compile_json_schema({"type": "object"}, any_whitespace=False)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
        if _EBNF_RULE.search(spec.grammar):
            return compiler.compile_grammar(spec.grammar)
        return compiler.compile_lark(spec.grammar)
    except Exception as err:  # noqa: BLE001 - whatever the backend refuses is this constraint's fault
        message = _LOG_PREFIX.sub("", str(err)).strip()
        raise InvalidParameter("structured_outputs",
                               f"SamplingParams.structured_outputs.{spec.kind} is invalid: {message}") from None


# JSON schema keywords xgrammar 0.2 compiles but does not enforce (vLLM refuses several of them for it too).
_UNENFORCED = ("contains", "minContains", "maxContains", "patternProperties", "propertyNames", "dependentRequired",
               "dependentSchemas", "dependencies", "not", "if", "then", "else")
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
            "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf")


# Keywords that constrain a value; xgrammar reads a $ref, an enum or a const alone and drops these beside it (any
# other key there, an annotation or an extension such as OpenAPI's "nullable", constrains nothing it could enforce).
_VALIDATION = frozenset({"minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                         "exclusiveMaximum", "multipleOf", "properties", "additionalProperties", "required", "items",
                         "prefixItems", "minItems", "maxItems", "minProperties", "maxProperties", "anyOf", "oneOf",
                         "allOf", "enum", "const"})
# Keywords of strings and numbers, which xgrammar enforces only where the node says its type.
_SCALAR_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                              "exclusiveMaximum", "multipleOf"})
_COMBINATORS = ("anyOf", "oneOf", "allOf")
_JSON_TYPES = {"string": str, "object": dict, "array": list, "boolean": bool, "null": type(None),
               "integer": int, "number": (int, float)}
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def unenforced_schema_keywords(schema: dict) -> list[str]:
    """The keywords of ``schema`` (and its subschemas) the grammar would silently not enforce, sorted."""
    found, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
            continue
        if not isinstance(node, dict):
            continue
        found.update(key for key in _UNENFORCED if key in node)
        found.update(_ignored_beside(node))
        types = _declared_types(node)
        if not types and _SCALAR_KEYWORDS & set(node) and not {"$ref", "enum", "const"} & set(node):
            found.add("string or number keywords in a schema without a type")
        if "multipleOf" in node and not (node.get("type") == "integer" and type(node["multipleOf"]) is int):
            found.add("multipleOf other than an integer's")
        fmt = node.get("format")
        if "string" in types and fmt is not None and not (isinstance(fmt, str) and fmt in _FORMATS):
            found.add(f"format {fmt!r}")
        if isinstance(node.get("oneOf"), list) and _branches_may_overlap(node["oneOf"], schema):
            found.add("oneOf whose branches may overlap (it is read as anyOf)")
        if node.get("uniqueItems") is True:
            found.add("uniqueItems")
        if isinstance(node.get("pattern"), str) and _LOOKAROUND.search(node["pattern"]):
            found.add("lookaround in a pattern")
        if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            found.add("minLength/maxLength beside a pattern or format")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.add("allOf of several schemas")
        declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required")
        if isinstance(required, list) and any(not isinstance(name, str) or name not in declared for name in required):
            found.add("required properties it does not declare")
        stack += [child for key in _SUBSCHEMA_MAPS if isinstance(node.get(key), dict) for child in node[key].values()]
        stack += [node[key] for key in _SUBSCHEMAS if key in node]
    return sorted(found)


def _ignored_beside(node: dict) -> set[str]:
    """What xgrammar would ignore in ``node``: keywords beside a ``$ref``, ``enum`` or ``const`` (each of which it
    reads alone), values of an ``enum``/``const`` that its ``type`` does not allow, and references outside the
    schema."""
    found, ref = set(), node.get("$ref")
    constraining = {key for key in _VALIDATION & set(node)  # allowing anything is no limit
                    if not (key in ("additionalProperties", "items") and (node[key] is True or node[key] == {}))}
    if isinstance(ref, str) and not ref.startswith("#"):
        found.add("$ref outside the schema")
    combinators = [key for key in _COMBINATORS if key in node]
    if combinators and ("type" in node or constraining - {combinators[0]}):
        found.add(f"keywords beside {'/'.join(combinators) if len(combinators) > 1 else combinators[0]}")
    if ref is not None and constraining:
        found.add("keywords beside a $ref")
    if "enum" in node or "const" in node:
        if constraining - {"enum", "const"}:
            found.add("keywords beside an enum or const")
        values = ([node["const"]] if "const" in node else []) + (node["enum"] if isinstance(node.get("enum"), list)
                                                                  else [])
        types = _declared_types(node)
        if types and not all(any(_is_a(value, t) for t in types) for value in values):
            found.add("enum or const values that its type does not allow")
    return found


def _declared_types(node: dict) -> list:
    types = node.get("type", [])
    return [types] if isinstance(types, str) else types if isinstance(types, list) else []


def _branches_may_overlap(branches: list, root: dict) -> bool:
    """Whether some value could match two of ``branches`` (False only where their types, their constant values, or
    the constant values of a property both require, tell them apart: a tagged union)."""
    resolved = [_resolved(branch, root) for branch in branches]
    return any(not _disjoint(a, b, root) for i, a in enumerate(resolved) for b in resolved[i + 1:])


def _disjoint(a, b, root: dict) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    widened = [types | ({"integer"} if "number" in types else set()) for types in (_value_types(a), _value_types(b))]
    if all(widened) and not widened[0] & widened[1]:
        return True
    if (values_a := _constants(a)) is not None and (values_b := _constants(b)) is not None:
        return not values_a & values_b
    both = [x.get("required") for x in (a, b)]
    for name in set(both[0]) & set(both[1]) if all(isinstance(r, list) for r in both) else ():
        properties = [x.get("properties") for x in (a, b)]
        if not all(isinstance(p, dict) and name in p for p in properties):
            continue
        values_a, values_b = (_constants(_resolved(p[name], root)) for p in properties)
        if values_a is not None and values_b is not None and not values_a & values_b:
            return True
    return False


def _value_types(node: dict) -> set[str]:
    """The JSON types ``node`` allows, from its ``type`` or its constant values (empty: any)."""
    if types := _declared_types(node):
        return set(types)
    values = [node["const"]] if "const" in node else node["enum"] if isinstance(node.get("enum"), list) else []
    return {_type_of(value) for value in values}


def _constants(node) -> set[str] | None:
    """The values a ``const`` or ``enum`` allows (as JSON text, numbers as floats: 1 is 1.0), or None."""
    if not isinstance(node, dict) or not ("const" in node or isinstance(node.get("enum"), list)):
        return None
    values = [node["const"]] if "const" in node else node["enum"]
    return {json.dumps(float(v) if type(v) in (int, float) else v, sort_keys=True) for v in values}


def _type_of(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return next(name for name, kind in _JSON_TYPES.items() if name != "integer" and isinstance(value, kind))


def _resolved(node, root: dict, depth: int = 8):
    """``node``, its local ``$ref`` followed (a few times at most)."""
    while depth and isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
        target = root
        for part in filter(None, node["$ref"][1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if target is None:
            return node
        node, depth = target, depth - 1
    return node


def _is_a(value, json_type: str) -> bool:
    kind = _JSON_TYPES.get(json_type)
    if kind is None or (isinstance(value, bool) and json_type != "boolean"):
        return False
    return isinstance(value, kind) or (json_type == "integer" and isinstance(value, float) and value.is_integer())


def fill_bitmask(matchers: list[GrammarMatcher], rows: list[int], num_rows: int) -> torch.Tensor:
    """A ``[num_rows, ceil(vocab_size / 32)]`` int32 bitmask whose ``rows`` allow what ``matchers`` allow next.

    Rows not in ``rows`` are left all-allowed. Each matcher fills its own row: xgrammar's batch filler owns a thread
    pool, and one shared by the engine threads of several generators in a process aborted the process. A matcher met
    again (the ``n`` draws of a prompt) copies its first row, so its time counts once.
    """
    bitmask = _xgrammar().allocate_token_bitmask(num_rows, matchers[0].vocab_size)
    first_rows: dict[int, int] = {}
    for matcher, row in zip(matchers, rows):
        if (first := first_rows.setdefault(id(matcher), row)) != row:
            bitmask[row] = bitmask[first]
            continue
        start = time.thread_time()
        matcher._matcher.fill_next_token_bitmask(bitmask, row)
        matcher.spent += time.thread_time() - start
    return bitmask


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Let row ``row`` of a bitmask (32 tokens per int32 word, low bit first) take ``token_id`` too."""
    word, bit = divmod(token_id, 32)
    bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # bit 31 is the int32's sign


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of ``rows`` that their bitmask rows forbid."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
