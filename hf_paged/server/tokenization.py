"""`PromptEncoder`: prompts to token ids on worker threads, off the event loop and off the engine's lock.

Each worker thread has its own copy of the tokenizer: a fast tokenizer object used from two threads at once can raise
"Already borrowed" (Rust's borrow check), and the engine thread keeps using the generator's own one to detokenize.
A prompt that could not fit the context even at ``max_chars_per_token`` characters per token (and one token per chat
message, for its template) is refused before it is tokenized, so a huge prompt costs a length check, not seconds of
tokenization.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from jinja2 import TemplateError

from ..generation import InvalidParameter, SamplingParams
from ..generation.detokenizer import token_text
from ..generation.inputs import InputProcessor, Prompt
from .protocol import APIError


class PromptEncoder:
    """Renders chat templates and tokenizes prompts with the engine's own `InputProcessor` (each worker thread has a
    copy of it, with a copy of the tokenizer), so the engine gets the token ids it would have made itself."""

    def __init__(self, inputs: InputProcessor, max_chars_per_token: int, workers: int):
        self.inputs = inputs
        self.max_model_len = inputs.max_model_len
        self.chars_per_token = max_chars_per_token
        self.max_chars = self.max_model_len * max_chars_per_token
        self._master = copy.deepcopy(inputs.tokenizer)  # copied from only under _copy_lock
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None

    def processor(self) -> InputProcessor:
        """This thread's own `InputProcessor`, with its own tokenizer."""
        processor = getattr(self._local, "processor", None)
        if processor is None:
            processor = copy.copy(self.inputs)
            with self._copy_lock:
                processor.tokenizer = copy.deepcopy(self._master)
            self._local.processor = processor
        return processor

    async def encode(self, prompt: Prompt, param: str, keep: int | None = None,
                     add_special_tokens: bool | None = None, pooling: bool = False, measured: bool = True) -> list[int]:
        """The prompt's token ids, its last ``keep`` only if given (``truncate_prompt_tokens``), with the tokenizer's
        special tokens as `tokenize_prompt` adds them; raises a 400 naming ``param`` for a prompt that is too long or
        cannot render (one to embed, ``pooling``, may fill the context; one not ``measured``, ``/tokenize``'s, is
        counted past it, up to the characters it could hold). A prompt to truncate is not measured before it is
        tokenized (the body's size bounds it)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            try:
                prompt = self.inputs.truncated(prompt, keep, pooling)
            except InvalidParameter as err:
                raise APIError(400, str(err), param=err.param) from None
            if measured:
                self._check_tokens(len(prompt), param, pooling)
            return prompt
        if keep is None:
            self.check(prompt, param)
        else:
            check_text(prompt, param)
        return await asyncio.get_running_loop().run_in_executor(self.start(), self._encode, prompt, param, keep,
                                                                add_special_tokens, pooling, measured)

    def check(self, prompt: str | list[dict], param: str, extra_chars: int = 0) -> None:
        """Refuse (a 400) a prompt of more characters than the context could hold (each chat message counts as
        ``max_chars_per_token`` characters more than its fields, since its template takes a token at least), or one
        that is not text."""
        check_text(prompt, param)
        if isinstance(prompt, str):
            chars = extra_chars + len(prompt)
        else:
            fields = sum(len(str(value)) for message in prompt for value in message.values())
            chars = extra_chars + fields + len(prompt) * self.chars_per_token
        if chars > self.max_chars:
            raise APIError(400, f"the prompt is {chars} characters long (a chat message counts "
                                f"{self.chars_per_token} more), more than could fit this engine's context "
                                f"(max_model_len) of {self.max_model_len} tokens", param=param)

    def _encode(self, prompt: str | list[dict], param: str, keep: int | None, add_special_tokens: bool | None,
                pooling: bool, measured: bool) -> list[int]:
        try:
            _, token_ids = self.processor().tokenize(prompt, keep, add_special_tokens, pooling)
        except TemplateError as err:
            raise APIError(400, f"the chat template cannot render these messages: {err}", param=param) from err
        except InvalidParameter as err:
            raise APIError(400, str(err), param=err.param) from err
        except (TypeError, ValueError) as err:
            raise APIError(400, str(err), param=param) from err
        if measured:
            self._check_tokens(len(token_ids), param, pooling)
        return token_ids

    async def tokenize_bad_words(self, params: SamplingParams) -> None:
        """Tokenize ``params.bad_words`` on a tokenizing thread; the engine then reads them from ``params``."""
        if params.bad_words:
            await asyncio.get_running_loop().run_in_executor(
                self.start(), lambda: params.bad_words_token_ids(self.processor().tokenizer))

    def _check_tokens(self, num_tokens: int, param: str, pooling: bool = False) -> None:
        try:
            self.inputs.check_prompt_length(num_tokens, pooling)
        except ValueError as err:
            raise APIError(400, str(err), param=param) from None

    async def text(self, token_ids: list[int], param: str) -> str:
        """The text of a token-id prompt (checked, then decoded on a tokenizing thread); a 400 naming ``param``
        for ids the model does not know."""
        def decode() -> str:
            processor = self.processor()
            processor.check_token_ids(token_ids)
            return processor.tokenizer.decode(token_ids)

        try:
            return await asyncio.get_running_loop().run_in_executor(self.start(), decode)
        except ValueError as err:
            raise APIError(400, str(err), param=param) from err

    def decoder(self) -> "TokenText":
        """Each token's text and bytes, on a tokenizer copy of its own: logprobs name every token."""
        with self._copy_lock:
            return TokenText(copy.deepcopy(self._master))

    def start(self) -> ThreadPoolExecutor:
        """The worker threads, started on first use (idempotent)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="hf-paged-tokenize")
        return self._pool

    def close(self) -> None:
        """Stop the worker threads (a later `encode` starts them again)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _bytes_of_byte_level_chars() -> dict[str, int]:
    """Byte-level BPE vocabularies (GPT-2's scheme) spell byte b as a printable character: b itself where it is
    printable (and not a space), else chr(256 + k) for the k-th other byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


_BYTE_OF_CHAR = _bytes_of_byte_level_chars()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenText:
    """A token's text (``token_text(id)``, as `detokenizer.token_text` gives it) and its bytes
    (``token_text.bytes(id)``), cached. The bytes are those its vocabulary entry stands for, so the tokens that split
    a character (each "\ufffd" as text) join into its bytes, as OpenAI's chat logprobs promise; a tokenizer whose
    vocabulary cannot be read so gives its text's UTF-8."""

    def __init__(self, tokenizer):
        self._tokenizer, self._lock = tokenizer, threading.Lock()  # built on the event loop and on worker threads
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # As written (ensure_ascii off): a Replace("\u2581", " ") decoder's pattern is the character itself.
        decoder = "" if backend is None else json.dumps(json.loads(backend.to_str()).get("decoder"), ensure_ascii=False)
        self._byte_level, self._metaspace = "ByteLevel" in decoder, "\u2581" in decoder or "Metaspace" in decoder
        self._text = lru_cache(maxsize=1 << 16)(self._decode)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)

    def _decode(self, token_id: int) -> str:
        with self._lock:
            return token_text(self._tokenizer, token_id)

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        with self._lock:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if isinstance(piece, str) and (byte := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        if isinstance(piece, str) and self._metaspace:
            return piece.replace("\u2581", " ").encode()
        return self(token_id).encode()


def check_text(prompt: str | list[dict], param: str) -> None:
    """Refuse text that UTF-8 cannot hold (a lone surrogate, from a ``"\\ud800"`` escape in the request's JSON): a
    prompt, its messages' fields, or (``param`` other than the prompt's) any JSON value's text."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif param in ("prompt", "messages"):
        texts = [v for m in prompt for v in m.values() if isinstance(v, str)]
    else:
        texts = [json.dumps(prompt, ensure_ascii=False)]
    for text in texts:
        try:
            text.encode()
        except UnicodeEncodeError as err:
            raise APIError(400, f"{param} holds {text[err.start]!r}, a lone surrogate: not text", param=param) \
                from None
