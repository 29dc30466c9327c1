"""Grammars compile in a process of their own, shared by every engine of this process: a compile cannot be stopped
on a thread, and some constraints of a few hundred characters take minutes, holding the compiles queued behind them
and a core. One that runs past its time kills the process (the constraint is refused); the next compile starts
another. The parent sends ``(tokenizer key, tokenizer info)`` once per tokenizer, then ``(tokenizer key, spec)`` per
compile, and reads back ``(True, the compiled grammar's JSON)`` or ``(False, the error)``; the backend itself is
`structured_outputs`'s.

    python -m hf_paged.generation.grammar_worker PARENT_PID   (started by `CompileProcess`; it ends with its parent)
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time

from .sampling_params import InvalidParameter, StructuredOutputsParams

START_TIMEOUT_S = 300.0  # the process imports torch and the backend, or reads a tokenizer: seconds when loaded
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
    """The compile process, started at the first compile and again after one was killed; at exit it is killed before
    the threads that wait on it are joined."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._tokenizers: set[str] = set()  # keys of the tokenizer infos the process has
        self._lock = threading.Lock()  # one compile at a time
        self._exiting = False
        threading._register_atexit(self._exit)  # before concurrent.futures joins its threads (atexit runs after)

    def compile(self, key: str, info_json: str, spec: StructuredOutputsParams, timeout: float) -> str:
        """The compiled grammar of ``spec`` as JSON; raises ``InvalidParameter`` for an invalid constraint or one that
        does not compile within ``timeout`` seconds, ``RuntimeError`` when the process fails."""
        with self._lock:
            try:
                process = self._started()
                if key not in self._tokenizers:  # taken in before the compile's time starts
                    _write(process.stdin, ("tokenizer", key, info_json))
                    if _answer(process, START_TIMEOUT_S) != "ready":
                        raise RuntimeError("the grammar compile process did not take the tokenizer")
                    self._tokenizers.add(key)
                _write(process.stdin, ("compile", key, spec))
                answer = _answer(process, timeout)
            except BaseException:
                self.close()
                raise
            if answer is None:
                self.close()
                raise InvalidParameter("structured_outputs", f"SamplingParams.structured_outputs.{spec.kind} did not "
                                                             f"compile within {timeout:g} s: simplify the constraint")
        done, payload = answer
        if not done:
            raise InvalidParameter("structured_outputs", payload)
        return payload

    def _started(self) -> subprocess.Popen:
        if self._exiting:
            raise RuntimeError("the interpreter is exiting: no grammar compiles")
        if self._process is None or self._process.poll() is not None:
            self.close()
            # A session of its own: a terminal's Ctrl+C is the parent's to act on (the process ends with it).
            self._process = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid())],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
            if _answer(self._process, START_TIMEOUT_S) != "ready":
                raise RuntimeError("the grammar compile process did not start (see its errors above)")
        return self._process

    def _exit(self) -> None:
        self._exiting = True
        self.close()

    def close(self) -> None:
        process, self._process, self._tokenizers = self._process, None, set()
        if process is not None:
            process.kill()
            process.wait()
            process.stdin.close()
            process.stdout.close()


def _answer(process: subprocess.Popen, timeout: float):
    """The process's next message; None when it does not come within ``timeout``. ``RuntimeError`` when the process
    ended (killed, say, for memory)."""
    poller = select.poll()  # not select(), which takes no descriptor past 1023 (a busy server has more)
    poller.register(process.stdout, select.POLLIN)
    if not poller.poll(timeout * 1000):
        return None
    message = _read(process.stdout)
    if message is None:
        raise RuntimeError(f"the grammar compile process ended (exit code {process.wait()})")
    return message


_SHARED: CompileProcess | None = None
_SHARED_LOCK = threading.Lock()


def compile_process() -> CompileProcess:
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = CompileProcess()
        return _SHARED


def _end_with(parent: int) -> None:
    """End this process once ``parent`` has ended (killed, say): a compile in progress would otherwise go on."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    from .structured_outputs import compile_grammar, grammar_compiler

    threading.Thread(target=_end_with, args=(int(sys.argv[1]),), daemon=True).start()
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever else writes to stdout goes to stderr
    compilers = {}
    _write(answers, "ready")
    while (message := _read(sys.stdin.buffer)) is not None:
        kind, key, body = message
        if kind == "tokenizer":
            compilers[key] = grammar_compiler(body)
            _write(answers, "ready")
            continue
        try:
            _write(answers, (True, compile_grammar(compilers[key], body).serialize_json()))
        except InvalidParameter as err:
            _write(answers, (False, str(err)))


if __name__ == "__main__":
    main()
