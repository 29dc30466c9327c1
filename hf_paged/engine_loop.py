"""`EngineLoop`: the one thread that steps the generator, and hands each output to the asyncio task waiting for it.

The server's HTTP handlers and `hf_paged.AsyncLLM`'s callers run on asyncio loops; the engine runs on its own thread.
A caller registers its requests with `EngineLoop.submit`, which returns a `RequestStream`; after every step the
engine thread posts the outputs (deltas) to the callers' loops with one ``call_soon_threadsafe`` per loop, where each
stream merges them and wakes its caller.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .distributed import HEARTBEAT_S, DistributedError
from .generation import ContinuousBatchGenerator, RequestOutput, SamplingParams
from .generation.inputs import Prompt
from .lora import LoRAAdapter, LoRARequest

if TYPE_CHECKING:  # the server extra's; the loop itself runs without it (`hf_paged.AsyncLLM`)
    from .server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while it was serving this request."""


class RequestStream:
    """The outputs of the requests of one call (an HTTP request, an `AsyncLLM.generate`), as the engine thread
    delivers them.

    The engine hands back deltas (`RequestOutputKind.DELTA`); those the handler has not read yet are merged into one
    pending output per request, so a client that reads slowly costs at most one pending output per request, however
    long it lags. A handler that has taken nothing for ``write_timeout`` seconds while outputs wait (its client stopped
    reading, so its writes block) has its requests aborted, which frees their KV blocks. Iterating yields each
    request's merged delta until all have finished; it raises `EngineError` if the engine failed or the client was
    too slow.
    """

    def __init__(self, engine: "EngineLoop", request_ids: list[str], write_timeout: float | None = None):
        self.engine = engine
        self.request_ids = request_ids
        self.pending_ids = set(request_ids)  # not finished yet
        self.undelivered: dict[str, RequestOutput] = {}
        self.error: EngineError | None = None
        self.ready = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.write_timeout = write_timeout
        self.last_read = self.waiting_since = self.loop.time()
        self.num_prompt_tokens = 0  # of all its prompts, for usage (set by whoever tokenized them)
        self.prompt_token_ids: list[list[int]] = []  # each prompt's, as queued (set alike)

    def put(self, item: RequestOutput | EngineError) -> None:
        """Take an output (or the engine's failure) from the engine thread; runs on the stream's loop."""
        if not self.undelivered:
            self.waiting_since = self.loop.time()  # outputs wait for the handler from now
        waited = self.loop.time() - max(self.last_read, self.waiting_since)
        stalled = self.write_timeout is not None and waited > self.write_timeout
        if self.undelivered and stalled and self.error is None:
            self.engine.abandon(list(self.pending_ids))
            self.error = EngineError(f"the client read nothing for {self.write_timeout:g} s: its requests were "
                                     "aborted (--stream-write-timeout)")
        if isinstance(item, EngineError):
            self.error = self.error or item
        elif item.request_id in self.undelivered:
            self.undelivered[item.request_id].add(item)
        else:
            self.undelivered[item.request_id] = item
        self.ready.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self.outputs()

    async def outputs(
        self, is_disconnected: Callable[[], Awaitable[bool]] | None = None, poll_s: float = 1.0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs until all requests finish; with ``is_disconnected``, asked every ``poll_s`` seconds whether
        or not outputs arrive, stop (and abort) once it says so."""
        self._next_check = self.loop.time() + poll_s
        while self.pending_ids:
            if not await self._wait(is_disconnected, poll_s):
                self.close()
                return
            self.ready.clear()
            if self.error is not None:
                self.close()
                raise self.error
            outputs, self.undelivered = list(self.undelivered.values()), {}
            self.last_read = self.loop.time()
            for output in outputs:
                if output.finished:
                    self.pending_ids.discard(output.request_id)
                yield output

    async def _wait(self, is_disconnected: Callable[[], Awaitable[bool]] | None, poll_s: float) -> bool:
        """Wait for outputs; False once ``is_disconnected`` says the client has gone."""
        while is_disconnected is not None:
            if self.loop.time() >= self._next_check:
                self._next_check = self.loop.time() + poll_s
                if await is_disconnected():
                    return False
            try:
                await asyncio.wait_for(self.ready.wait(), max(0.0, self._next_check - self.loop.time()))
                return True
            except asyncio.TimeoutError:
                pass
        await self.ready.wait()
        return True

    def close(self) -> None:
        """Abort whatever has not finished (the client left, or the handler failed)."""
        if self.pending_ids:
            self.engine.abandon(list(self.pending_ids))
            self.pending_ids.clear()


class EngineOverloaded(EngineError):
    """The engine's queue is full: the call is refused before anything was queued (a 503 with Retry-After)."""


class EngineDead(EngineError):
    """The engine thread has stopped for good (an unrecoverable error): nothing more can be served."""


class EngineStopping(EngineError):
    """The server (or `AsyncLLM`) is shutting down, and the request did not finish in time (a 503)."""


GROUP_FAILED_GRACE_S = 1.0  # after a tensor-parallel group fails, before the process ends
FATAL_CONSECUTIVE_FAILURES = 3  # failed steps with no token generated in between: the engine itself is broken


class EngineLoop:
    """Drives ``generator.step()`` on one background thread while there is work, sleeping when there is none.

    A step that raises an ``Exception`` does not stop the thread: the error is logged, every request in flight fails
    with `EngineError` (a step gives no way to tell which request broke it) and is aborted, and serving goes on.
    A ``BaseException`` in a step, or `FATAL_CONSECUTIVE_FAILURES` failed steps with no token generated between
    them (whichever requests were in them), are unrecoverable: every request in flight fails, the thread ends,
    `healthy` turns False and the ``on_fatal`` callbacks run (``hf-paged serve`` then exits non-zero, so a
    supervisor restarts it).

    ``max_num_waiting`` bounds the sequences in flight beyond the ``max_num_seqs`` that one step runs: a call that
    would pass it is refused with `EngineOverloaded` before anything is queued.

    A tensor-parallel group that fails is unrecoverable too; with ``exit_on_group_failure`` (the server's) the process
    then ends at once, so that torchrun ends the other ranks.
    """

    def __init__(self, generator: ContinuousBatchGenerator, metrics: ServerMetrics | None = None,
                 max_num_waiting: int | None = None, write_timeout: float | None = None,
                 exit_on_group_failure: bool = False):
        self.generator = generator
        self.exit_on_group_failure = exit_on_group_failure
        self.metrics = metrics
        self.write_timeout = write_timeout
        self.max_num_seqs_in_flight = None if max_num_waiting is None else \
            generator.config.max_num_seqs + max_num_waiting
        self.fatal: BaseException | None = None
        self.on_fatal: list[Callable[[], None]] = []
        self._routes: dict[str, RequestStream] = {}
        self._seats: dict[str, int] = {}  # sequences each routed request will be (its n)
        self._aborting: set[str] = set()  # routed requests asked to abort (`abort`): their ids are soon free
        self._num_seqs = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._calls: list[tuple[Callable[[], object], Future]] = []  # to run between steps (`call`)

    @property
    def healthy(self) -> bool:
        """Whether the engine can serve: no unrecoverable error, and its thread runs unless it was never started."""
        thread = self._thread
        return self.fatal is None and (thread is None or thread.is_alive() or self._stopping)

    @property
    def running(self) -> bool:
        """Whether the engine thread is started and not stopping."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stopping and self.fatal is None

    def start(self) -> None:
        """Start the engine thread (idempotent); after a `stop` whose thread is still ending its step, once it has."""
        while True:
            with self._lock:
                thread = self._thread
                if thread is None or not thread.is_alive():
                    self._stopping = False
                    self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
                    self._thread.start()
                    return
                if not self._stopping:
                    return
            thread.join()  # outside the lock, which the ending step's delivery takes

    def release(self, timeout: float = 10.0) -> None:
        """End the thread after its current step: whoever served through this loop is gone (a finalizer calls this),
        and the thread would keep the engine, its weights and its KV cache alive for ever. It is waited for (unless
        this is the engine thread itself), so that the engine is not still being freed there when the process
        exits (a native destructor then aborts it)."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def stop(self, timeout: float = 30.0, reason: str = "the server is shutting down") -> None:
        """Stop the thread after its current step; requests still in flight fail (`EngineStopping`, saying
        ``reason``) and, once the thread has ended, give back their blocks."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        stepping = self._thread is not None and self._thread.is_alive()
        self._fail_in_flight(EngineStopping(reason), abort_unrouted=not stepping)
        self._fail_calls(EngineStopping(reason))
        if not stepping and self.fatal is None and self.generator.has_unfinished_requests():
            try:
                self.generator.step()  # takes the aborts in: nothing is left to run
            except Exception:
                logger.exception("could not free the blocks of the requests stopped")

    def cut_off(self) -> None:
        """Fail the requests and calls in flight (`EngineStopping`) while serving goes on: the server stops before
        they end."""
        self._fail_in_flight(EngineStopping("the server is shutting down"), abort_unrouted=False)
        self._fail_calls(EngineStopping("the server is shutting down"))

    def submit(self, prompts: list[Prompt], params: SamplingParams, request_ids: list[str],
               lora_request: LoRARequest | LoRAAdapter | None = None, priority: int = 0) -> RequestStream:
        """Queue one request per prompt, under the LoRA adapter ``lora_request`` if given, at ``priority`` (call from
        the event loop); raises ``ValueError`` for bad input,
        `EngineOverloaded` when the queue is full and `EngineDead` once the engine has stopped for good.

        Give token ids: a text prompt would be tokenized here, on the caller's thread, under the engine's lock."""
        if self.fatal is not None:
            raise EngineDead("the engine has stopped after an unrecoverable error")
        self.start()
        stream = RequestStream(self, request_ids, self.write_timeout)
        # Routes and the generator's inbox change together: a failing step that aborts everything routed then
        # either precedes this request entirely or queues its abort after the request's "add".
        with self._lock:
            seats = params.n * len(request_ids)
            taken = [request_id for request_id in request_ids if request_id in self._routes]
            if taken:  # routing it would take the other request's route
                raise ValueError(f"request id {taken[0]!r} is already in use")
            limit = self.max_num_seqs_in_flight
            if limit is not None and self._num_seqs + seats > limit and self._num_seqs > 0:
                raise EngineOverloaded(f"{self._num_seqs} sequences in flight, --max-num-waiting")
            for request_id in request_ids:
                self._route(request_id, stream, params.n)
            try:
                for prompt, request_id in zip(prompts, request_ids):
                    self._add(prompt, params, request_id, lora_request, priority)
            except BaseException:
                self._unroute(request_ids)  # queues aborts for the prompts already added
                raise
            finally:
                self._wake.set()
        return stream

    def _add(self, prompt: Prompt, params: SamplingParams, request_id: str, lora_request: LoRARequest | LoRAAdapter |
             None, priority: int) -> None:
        # Observed before the request is queued: it may finish at once.
        observed = self.metrics is not None and self.metrics.observe_submitted(request_id, params.n, params.max_tokens)
        try:
            self.generator.add_request(prompt, params, request_id, lora_request, priority)
        except BaseException:
            if observed:  # not when the id is another request's in flight: its entry stays
                self.metrics.withdraw(request_id)
            raise

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the engine thread between two steps, so that nothing else runs the model meanwhile (an
        embedding's forward, say); the future holds its result or exception (`EngineStopping` if the engine stops
        first). Raises `EngineDead` once the engine has stopped for good."""
        if self.fatal is not None:
            raise EngineDead("the engine has stopped after an unrecoverable error")
        self.start()
        future: Future = Future()
        with self._lock:
            self._calls.append((fn, future))
        self._wake.set()
        return future

    def _run_calls(self) -> None:
        """The calls queued: one between two steps while requests are in flight (so they keep generating), all of
        them when none is."""
        while not self._stopping:
            with self._lock:
                if not self._calls:
                    return
                fn, future = self._calls.pop(0)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # the caller's to handle; what ends the thread ends it after
                    future.set_exception(err)
                    if not isinstance(err, Exception):
                        raise
            if self.generator.has_unfinished_requests():
                return

    def _fail_calls(self, error: EngineError) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort these requests in the generator; their streams still get their last output (``"abort"``)."""
        single = isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable)
        request_ids = [request_ids] if single else list(request_ids)
        self.generator.abort_request(request_ids)
        with self._lock:
            self._aborting.update(rid for rid in request_ids if rid in self._routes)
        self._wake.set()  # an idle engine takes the aborts in at once

    def abandon(self, request_ids: list[str]) -> None:
        """Stop routing these requests (nobody reads them any more) and abort them in the generator (their blocks are
        freed at the next step)."""
        with self._lock:
            self._unroute(request_ids)
        self._wake.set()

    async def id_released(self, request_id: str, timeout: float) -> None:
        """Wait (``timeout`` seconds at most) until a request given up (`abandon`) or aborted (`abort`) no longer
        holds ``request_id``: the engine hands out its end at the next step. One in flight keeps its id (`submit`
        refuses it)."""
        if self.fatal is not None:
            raise EngineDead("the engine has stopped after an unrecoverable error")
        self.start()  # a stopped engine hands out nothing
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            with self._lock:
                routed, ending = request_id in self._routes, request_id in self._aborting
            if (routed and not ending) or not (routed or self.generator.request_id_in_use(request_id)):
                return
            await asyncio.sleep(0.01)

    def _route(self, request_id: str, stream: RequestStream, seats: int) -> None:
        self._routes[request_id] = stream
        self._seats[request_id] = seats
        self._num_seqs += seats

    def _drop_route(self, request_id: str) -> RequestStream | None:
        """Forget a request's route (hold the lock); returns its stream, or None if it had none."""
        self._num_seqs -= self._seats.pop(request_id, 0)
        self._aborting.discard(request_id)
        return self._routes.pop(request_id, None)

    def _unroute(self, request_ids: list[str]) -> None:
        """Drop the routes of these requests and abort the ones that had one (hold the lock)."""
        for request_id in request_ids:
            if self._drop_route(request_id) is not None:
                self.generator.abort_request(request_id)

    # ------------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        failures = 0
        try:
            while not self._stopping and failures < FATAL_CONSECUTIVE_FAILURES:
                failures = self._step(failures)
            if failures >= FATAL_CONSECUTIVE_FAILURES:
                self._die(EngineError(f"{failures} engine steps failed in a row"))
        except BaseException as err:  # noqa: BLE001 - whatever ends the thread must not leave handlers waiting
            logger.critical("the engine thread stopped after an unrecoverable error", exc_info=True)
            self._die(err)

    def _step(self, failures: int) -> int:
        """One step, its outputs delivered; returns the number of steps that have failed since a token was last
        generated (a step that only hands back aborted requests is no sign of health)."""
        generator = self.generator
        self._run_calls()
        if not generator.has_unfinished_requests():
            # Under tensor parallelism the other ranks wait for every step's inputs: an idle engine still steps now
            # and then, so they do not time out and a dead rank is found.
            heartbeat = HEARTBEAT_S if generator.is_tensor_parallel else None
            self._wake.wait(heartbeat)
            self._wake.clear()
            if heartbeat is None or self._stopping:
                return failures
        generated = generator.num_generated_tokens
        try:
            outputs = generator.step()
        except DistributedError as err:
            if not self.exit_on_group_failure:
                raise  # unrecoverable: see _run
            self._end_group(err)
            return failures
        except Exception:
            logger.exception("engine step failed; failing the requests in flight")
            if self.metrics is not None:
                self.metrics.step_failures.inc()
            self._fail_in_flight(EngineError("the engine failed while serving this request (see the log)"))
            return failures + 1
        if self.metrics is not None:  # first: a client that has its answer finds it counted in /metrics
            try:
                self.metrics.observe_step(generator.stats(), outputs)
            except Exception:
                logger.exception("could not record the metrics of a step")
        try:
            self._dispatch(outputs)
        except Exception:
            logger.exception("could not deliver the outputs of a step")
        return 0 if generator.num_generated_tokens > generated else failures

    def _die(self, err: BaseException) -> None:
        self.fatal = err
        self._fail_in_flight(EngineError("the engine stopped after an unrecoverable error (see the log)"))
        self._fail_calls(EngineDead("the engine stopped after an unrecoverable error (see the log)"))
        for callback in self.on_fatal:
            try:
                callback()
            except Exception:
                logger.exception("an on_fatal callback failed")

    def _end_group(self, error: DistributedError) -> None:
        """A tensor-parallel rank failed: nothing can be served any more, so the server process ends (and torchrun
        ends the other ranks)."""
        self._fail_in_flight(EngineError(f"the tensor-parallel group failed: {error}"), abort_unrouted=False)
        logger.critical("%s; the server exits", error)
        time.sleep(GROUP_FAILED_GRACE_S)  # the event loop writes those errors out to the clients meanwhile
        logging.shutdown()
        os._exit(1)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | EngineError]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._drop_route(output.request_id) if output.finished else \
                    self._routes.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass

    def _fail_in_flight(self, error: EngineError, abort_unrouted: bool = True) -> None:
        """Fail every routed request; with ``abort_unrouted`` (only safe while no step runs) abort all others too."""
        with self._lock:
            routes, self._routes, self._seats, self._num_seqs = self._routes, {}, {}, 0
        unrouted = set(self.generator.requests) if abort_unrouted else set()
        for request_id in set(routes) | unrouted:
            self.generator.abort_request(request_id)
        if self.metrics is not None:
            self.metrics.observe_failed(list(routes))
        for stream in {id(s): s for s in routes.values()}.values():
            try:
                stream.loop.call_soon_threadsafe(_deliver, [(stream, error)])
            except RuntimeError:
                pass


def _deliver(items: list[tuple[RequestStream, RequestOutput | EngineError]]) -> None:
    for stream, item in items:
        stream.put(item)
