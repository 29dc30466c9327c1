"""What the command line writes to a terminal: ``hf-paged chat``'s conversation, and Ctrl+C taken between steps.

In a chat the whole conversation is sent each turn; the engine's prefix cache still holds the earlier turns' keys and
values, so a turn computes little more than its own tokens. ``/clear`` starts over, ``/exit`` or the end of the input
(Ctrl+D) ends the chat. Ctrl+C stops a reply where it is (what was written of it stays in the conversation) and, at
the prompt, ends the chat. A turn the engine refuses (the conversation outgrew the context, say) is named on stderr
and left out of the conversation.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable

from .generation import ContinuousBatchGenerator, RequestOutputKind, SamplingParams

HELP = "/clear forgets the conversation, /exit ends it (so do Ctrl+D and Ctrl+C); Ctrl+C stops a reply."


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl+C and SIGTERM set the event yielded, for the caller to act on between steps (on the main thread); its
    ``signal`` says which came last."""
    interrupted = threading.Event()
    interrupted.signal = None

    def note(signum, frame) -> None:
        interrupted.signal = signum
        interrupted.set()

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield interrupted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def chat_params(generator: ContinuousBatchGenerator, **given) -> SamplingParams:
    """The sampling settings of a chat: those ``given`` (None: not given) over those the model's generation config
    recommends; a reply may run to the end of the context unless ``max_tokens`` is given."""
    settings = {"max_tokens": None, **SamplingParams.model_defaults(getattr(generator.model, "generation_config",
                                                                            None))}
    settings.update((name, value) for name, value in given.items() if value is not None)
    return SamplingParams(**settings, output_kind=RequestOutputKind.DELTA)


def converse(generator: ContinuousBatchGenerator, params: SamplingParams, system: str | None = None,
             read: Callable[[str], str] = input) -> int:
    """Chat until the input ends or the user leaves (``read(prompt)`` reads a line); the exit code."""
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    prompt = "> " if sys.stdin.isatty() else ""
    while True:
        try:
            line = read(prompt)
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\n" if prompt else "")
            return 0
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/clear":
            messages = list(start)
            print("(the conversation is forgotten)", file=sys.stderr)
            continue
        if command == "/help" or not command:
            print(HELP if command else "", end="\n" if command else "", file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command:  # a mistyped command, not words for the model
            print(f"(no command {command}) {HELP}", file=sys.stderr)
            continue
        turn = messages + [{"role": "user", "content": line}]
        reply = _reply(generator, turn, params)
        if reply is not None:
            messages = turn + [{"role": "assistant", "content": reply}]


def _reply(generator: ContinuousBatchGenerator, messages: list[dict], params: SamplingParams) -> str | None:
    """Stream the reply to ``messages`` to stdout; its text (as far as it went if Ctrl+C stopped it), or None if the
    engine refused the turn. SIGTERM stops the reply and then the chat (``SystemExit``, 128 + its number)."""
    parts, tokens, finish = [], 0, None
    with interrupts_deferred() as interrupted, contextlib.closing(generator.stream(messages, params)) as outputs:
        for output in outputs:  # the stream's close aborts a reply that Ctrl+C stopped
            if output.error is not None:
                print(f"hf-paged: error: {output.error} (/clear starts the conversation over)", file=sys.stderr)
                return None
            parts.append("".join(o.text for o in output.outputs))
            tokens += sum(len(o.token_ids) for o in output.outputs)
            finish = output.outputs[0].finish_reason if output.outputs else finish
            sys.stdout.write(parts[-1])
            sys.stdout.flush()
            if interrupted.is_set():
                break
    sys.stdout.write("\n")
    if interrupted.signal == signal.SIGTERM:
        raise SystemExit(128 + signal.SIGTERM)
    if finish == "length":  # said, or the next turn's refusal would be the first sign of a full context
        print(f"(the reply was cut at --max-tokens {tokens})" if tokens == params.max_tokens else
              "(the reply was cut where the context ends: /clear starts the conversation over)", file=sys.stderr)
    return "".join(parts)
