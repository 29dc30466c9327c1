"""Grammars compile in a process of their own, shared by every engine of this process: a compile cannot be stopped
on a thread, and some constraints of a few hundred characters take minutes, holding the compiles queued behind them
and a core. One that runs past its time kills the process (the constraint is refused); the next compile starts
another. The parent sends ``(tokenizer key, tokenizer info)`` once per tokenizer, then ``(tokenizer key, spec)`` per
compile, and reads back ``(True, the compiled grammar's JSON)`` or ``(False, the error)``; the backend itself is
`structured_outputs`'s.

    python -m hf_paged.generation.grammar_worker   (started by `CompileProcess`)
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading

from .sampling_params import InvalidParameter, StructuredOutputsParams

START_TIMEOUT_S = 300.0  # the process imports torch and the backend: seconds on a loaded machine
_HEADER = struct.Struct("<Q")


def _write(stream, message) -> None:
    data = pickle.dumps(message)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    return pickle.loads(stream.read(_HEADER.unpack(header)[0]))


class CompileProcess:
    """The compile process, started at the first compile and again after one was killed."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._tokenizers: set[str] = set()  # keys of the tokenizer infos the process has
        self._lock = threading.Lock()  # one compile at a time
        atexit.register(self.close)

    def compile(self, key: str, info_json: str, spec: StructuredOutputsParams, timeout: float) -> str:
        """The compiled grammar of ``spec`` as JSON; raises ``InvalidParameter`` for an invalid constraint or one that
        does not compile within ``timeout`` seconds."""
        with self._lock:
            process = self._started()
            if key not in self._tokenizers:
                _write(process.stdin, ("tokenizer", key, info_json))
                self._tokenizers.add(key)
            _write(process.stdin, ("compile", key, spec))
            answer = self._answer(timeout)
            if answer is None:
                self.close()
                raise InvalidParameter("structured_outputs", f"SamplingParams.structured_outputs.{spec.kind} did not "
                                                             f"compile within {timeout:g} s: simplify the constraint")
        done, payload = answer
        if not done:
            raise InvalidParameter("structured_outputs", payload)
        return payload

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self.close()
            self._process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE)
            if self._answer(START_TIMEOUT_S) != "ready":
                self.close()
                raise RuntimeError("the grammar compile process did not start (see its errors above)")
        return self._process

    def _answer(self, timeout: float):
        """The process's next message; None when it does not come within ``timeout`` or the process ended."""
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        return _read(self._process.stdout) if ready else None

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process.stdin.close()
            self._process.stdout.close()
        self._process, self._tokenizers = None, set()


_SHARED: CompileProcess | None = None
_SHARED_LOCK = threading.Lock()


def compile_process() -> CompileProcess:
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = CompileProcess()
        return _SHARED


def main() -> None:
    from .structured_outputs import compile_grammar, grammar_compiler

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole terminal: the parent ends this process
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever else writes to stdout goes to stderr
    compilers = {}
    _write(answers, "ready")
    while (message := _read(sys.stdin.buffer)) is not None:
        kind, key, body = message
        if kind == "tokenizer":
            compilers[key] = grammar_compiler(body)
            continue
        try:
            _write(answers, (True, compile_grammar(compilers[key], body).serialize_json()))
        except InvalidParameter as err:
            _write(answers, (False, str(err)))


if __name__ == "__main__":
    main()
