"""`OutputRouter`: which caller of a `ContinuousBatchGenerator` gets each request's outputs.

`run` and `stream` wait for their own requests (they *claim* them) while `step` hands out the rest; a step runs for
whoever calls it, so the outputs of requests another caller waits for are held until that caller steps. A request id
stays in use until its last output is handed out (or dropped).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from .outputs import RequestOutput, RequestOutputKind
from .sequence import Request


class OutputRouter:
    """Routes outputs by request id; every method but `reserve` and `in_use` is called under the generator's stepping
    lock."""

    def __init__(self):
        self._live: set[str] = set()  # ids queued, running, or with an output not handed out; guarded by _lock
        self._lock = threading.Lock()  # `reserve` runs on callers' threads, outside the stepping lock
        self._held: dict[str, RequestOutput] = {}  # outputs seen by one caller's step that belong to another
        self._unread: set[str] = set()  # requests whose outputs nobody reads any more: dropped
        self._claimed: set[str] = set()  # requests a `run` or `stream` waits for: `step` leaves their outputs

    def reserve(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live.add(request_id)

    def in_use(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._live

    def claim(self, request_ids: set[str]) -> None:
        self._claimed |= request_ids

    def unclaim(self, request_ids: set[str]) -> None:
        self._claimed -= request_ids

    @property
    def is_empty(self) -> bool:
        """Whether no request id is in use and nothing is held, claimed or waiting to be dropped."""
        return not (self._live or self._held or self._unread or self._claimed)

    def holds_unclaimed(self) -> bool:
        """Whether `step` has held outputs to hand out."""
        return any(request_id not in self._claimed for request_id in self._held)

    def route(self, changed: Iterable[Request], only: set[str] | None) -> list[RequestOutput]:
        """The outputs for this caller: those held for it, then those of the ``changed`` requests. With ``only`` (a
        `run` or `stream`), of the requests in it; without (`step`), of those nobody claimed. The others are held."""
        mine = only.__contains__ if only is not None else (lambda request_id: request_id not in self._claimed)
        outputs = [self._held.pop(rid) for rid in [rid for rid in self._held if mine(rid)]]
        self._release({output.request_id for output in outputs if output.finished})
        for request in changed:
            rid, done = request.request_id, request.is_finished or request.error is not None
            unread = rid in self._unread
            if done:
                self._unread.discard(rid)
            output = request.take_output()
            if output is not None and not unread and not mine(rid):
                self._hold(output, request.params.output_kind)
                continue
            if output is not None and not unread:
                outputs.append(output)
            if done:
                self._release({rid})
        return outputs

    def drop(self, request_ids: set[str]) -> set[str]:
        """Nobody reads ``request_ids``' outputs any more: their held outputs go, later ones are dropped. Returns
        those still live, which the caller aborts."""
        dropped = {rid: self._held.pop(rid) for rid in request_ids & self._held.keys()}
        self._release({rid for rid, output in dropped.items() if output.finished})
        with self._lock:
            live = request_ids & self._live
        self._unread |= live
        return live

    def _hold(self, output: RequestOutput, kind: RequestOutputKind) -> None:
        """Keep one output per request: a later delta merged into the held one, else the latest."""
        held = self._held.get(output.request_id)
        if held is not None and kind is RequestOutputKind.DELTA:
            held.add(output)
        else:
            self._held[output.request_id] = output

    def _release(self, request_ids: set[str]) -> None:
        with self._lock:
            self._live -= request_ids
