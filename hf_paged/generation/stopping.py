"""When a sequence stops: a pure function of its new token, its text and its request's parameters."""

from __future__ import annotations

from dataclasses import dataclass

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class Stop:
    """Why a sequence finished, and where its text ends (``text_end``: None keeps all of it)."""

    finish_reason: str
    stop_reason: int | str | None = None
    text_end: int | None = None


def find_stop_string(text: str, num_new_chars: int, stops: list[str], include_stop: bool) -> Stop | None:
    """The earliest stop string that ends in the last ``num_new_chars`` characters of ``text``; older text was
    checked already, or was never to be (``min_tokens``)."""
    if not num_new_chars or not stops:
        return None
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    if best is None:
        return None
    pos, stop = best
    return Stop("stop", stop, pos + len(stop) if include_stop else pos)


def stop_reason(token: int, params: SamplingParams, eos_token_id: int | None) -> int | None:
    """vLLM's ``stop_reason`` of a sequence that stopped at stop token ``token``."""
    return None if token == eos_token_id and not params.ignore_eos else token


def token_stop(token: int, text: str, num_new_chars: int, params: SamplingParams, eos_token_id: int | None) -> Stop:
    """How a sequence stops at stop token ``token``, whose text is the last ``num_new_chars`` characters of ``text``:
    that text is cut from the output unless ``include_stop_str_in_output`` (its id stays)."""
    text_end = None if params.include_stop_str_in_output else len(text) - num_new_chars
    return Stop("stop", stop_reason(token, params, eos_token_id), text_end)


def check_stop(
    token: int, num_output_tokens: int, num_tokens: int, text: str, num_new_chars: int, params: SamplingParams,
    stop_ids: frozenset[int], max_model_len: int, eos_token_id: int | None = None,
) -> Stop | None:
    """Whether a sequence that just appended ``token`` (now ``num_output_tokens`` generated, ``num_tokens`` in all,
    its text ending in ``num_new_chars`` new characters) stops, and why.

    Stop tokens (``stop_ids``: the request's stop_token_ids, and EOS unless ignored) count only once ``min_tokens``
    are generated, and stop strings only when they end in the text of a later token (vLLM's rule: the first
    ``min_tokens`` tokens' text is never searched, though a stop string may begin in it); ``max_tokens`` and the
    context (``max_model_len``) always count. As with a stop string, a stop token's text is cut from the output
    unless ``include_stop_str_in_output`` (its id stays). As in vLLM, the ``stop_reason`` of a stop token is the token,
    except for the tokenizer's EOS (``eos_token_id``) while it is not ignored: None.
    """
    stop_token = num_output_tokens >= params.min_tokens and token in stop_ids
    # A stop token's text is searched only where it stays in the output; a stop string found there wins (vLLM).
    if num_output_tokens > params.min_tokens and (params.include_stop_str_in_output or not stop_token):
        stop = find_stop_string(text, num_new_chars, params.stop, params.include_stop_str_in_output)
        if stop is not None:
            return stop
    if stop_token:
        return token_stop(token, text, num_new_chars, params, eos_token_id)
    if (params.max_tokens is not None and num_output_tokens >= params.max_tokens) or num_tokens >= max_model_len:
        return Stop("length")
    return None
