"""`OutputRouter` on its own, with stand-in requests: who gets each output, and when an id is free again."""

from types import SimpleNamespace

import pytest

from hf_paged.generation.output_router import OutputRouter
from hf_paged.generation.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind


class FakeRequest:
    """What the router reads of a request: its id, whether it is done, its kind of output, and the output a step
    left (taken once)."""

    def __init__(self, request_id: str, kind: RequestOutputKind = RequestOutputKind.DELTA):
        self.request_id, self.params = request_id, SimpleNamespace(output_kind=kind)
        self.is_finished, self.error, self._output = False, None, None

    def stepped(self, text: str, finished: bool = False) -> "FakeRequest":
        self.is_finished = finished
        self._output = RequestOutput(self.request_id, None, [], [CompletionOutput(0, text, [len(text)])], finished,
                                     RequestMetrics(0.0))
        return self

    def take_output(self):
        output, self._output = self._output, None
        return output


def texts(outputs):
    return {output.request_id: output.outputs[0].text for output in outputs}


def test_step_gets_the_unclaimed_outputs_and_a_claimed_request_waits_for_its_caller():
    router, a, b = OutputRouter(), FakeRequest("a"), FakeRequest("b")
    router.reserve("a"), router.reserve("b")
    router.claim({"b"})
    assert texts(router.route([a.stepped("x"), b.stepped("1")], only=None)) == {"a": "x"}
    assert texts(router.route([a.stepped("y"), b.stepped("2")], only=None)) == {"a": "y"}
    assert not router.holds_unclaimed()  # "b" is held for the caller that claimed it
    assert texts(router.route([], only={"b"})) == {"b": "12"}  # the held deltas, merged


def test_a_caller_waiting_for_one_request_leaves_the_others_for_step():
    router, a, b = OutputRouter(), FakeRequest("a", RequestOutputKind.CUMULATIVE), FakeRequest("b")
    router.reserve("a"), router.reserve("b")
    router.claim({"b"})
    assert texts(router.route([a.stepped("x"), b.stepped("1")], only={"b"})) == {"b": "1"}
    assert texts(router.route([a.stepped("xy")], only={"b"})) == {}
    assert router.holds_unclaimed()
    assert texts(router.route([], only=None)) == {"a": "xy"}  # a cumulative output held: the latest


def test_an_id_is_free_again_once_its_final_output_is_handed_out():
    router, a = OutputRouter(), FakeRequest("a")
    router.reserve("a")
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        router.reserve("a")
    router.claim({"a"})
    router.route([a.stepped("done", finished=True)], only=None)  # held for its claimer: still in use
    with pytest.raises(ValueError, match="already in use"):
        router.reserve("a")
    assert texts(router.route([], only={"a"})) == {"a": "done"}
    router.unclaim({"a"})
    assert router.is_empty
    router.reserve("a")


def test_dropped_requests_lose_their_held_and_later_outputs_and_free_their_ids():
    router, a, b = OutputRouter(), FakeRequest("a"), FakeRequest("b")
    router.reserve("a"), router.reserve("b")
    router.claim({"a", "b"})
    router.route([a.stepped("x", finished=True), b.stepped("1")], only=set())
    router.unclaim({"a", "b"})
    assert router.drop({"a", "b"}) == {"b"}  # "a" had finished: its held output goes, its id is free
    router.reserve("a")
    assert texts(router.route([b.stepped("2", finished=True)], only=None)) == {}  # nobody reads "b" any more
    router.reserve("b")


def test_an_id_is_in_use_until_the_last_output_is_handed_out_or_dropped():
    router, a = OutputRouter(), FakeRequest("a")
    assert not router.in_use("a")
    router.reserve("a")
    assert router.drop({"a"}) == {"a"} and router.in_use("a")  # its abort is still to come
    router.route([a.stepped("x")], only=None)
    assert router.in_use("a")
    assert router.route([a.stepped("y", finished=True)], only=None) == [] and not router.in_use("a")
    router.reserve("a")  # free again
