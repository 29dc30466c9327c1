"""What a step hands back: deltas whose size does not grow with the output, and a server stream that holds at most
one pending output per request however slowly its client reads."""

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_paged import ContinuousBatchGenerator, RequestOutputKind, SamplingParams

LONG = 4000


@pytest.fixture(scope="module")
def long_generator(smollm2):
    """A tiny random Llama with room for a 4,000-token answer, behind SmolLM2's tokenizer."""
    _, tokenizer = smollm2
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=LONG + 64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
    return ContinuousBatchGenerator(model, tokenizer, num_blocks=(LONG + 64) // 16 + 2, prepack_weights=False)


def copied_per_step(generator, kind: RequestOutputKind, max_tokens: int) -> list[int]:
    """Token ids plus logprob entries that each step's output carries for one long request."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, output_kind=kind)
    generator.add_request([5, 6, 7], params)
    copied = []
    while generator.has_unfinished_requests():
        for output in generator.step():
            copied.append(sum(len(o.token_ids) + len(o.logprobs) for o in output.outputs))
    return copied


def test_delta_outputs_copy_the_same_amount_every_step(long_generator):
    delta = copied_per_step(long_generator, RequestOutputKind.DELTA, 600)
    assert len(delta) == 600 and max(delta) == 2  # one token and its logprobs, at step 1 as at step 600
    cumulative = copied_per_step(long_generator, RequestOutputKind.CUMULATIVE, 600)
    assert cumulative[-1] == 2 * 600  # what a cumulative output copies grows with the answer
    final = copied_per_step(long_generator, RequestOutputKind.FINAL_ONLY, 600)
    assert final == [2 * 600]


def test_deltas_add_up_to_the_cumulative_output(long_generator):
    params = dict(temperature=0.8, seed=3, max_tokens=40, n=2, logprobs=2, stop=["e"])
    deltas = list(long_generator.stream([[9, 10, 11]], SamplingParams(**params, output_kind=RequestOutputKind.DELTA)))
    (whole,) = long_generator.run([[9, 10, 11]], SamplingParams(**params), use_tqdm=False)
    merged = deltas[0]
    for later in deltas[1:]:
        merged.add(later)
    assert merged.finished and [(o.text, o.token_ids, o.logprobs, o.finish_reason) for o in merged.outputs] == [
        (o.text, o.token_ids, o.logprobs, o.finish_reason) for o in whole.outputs]


def test_a_stream_nobody_reads_holds_one_pending_output(long_generator):
    """A 4,000-token answer whose client never reads: the server's stream keeps one merged output, not 4,000."""
    from hf_paged.server import create_app

    app = create_app(long_generator, "tiny")
    engine = app.state.engine
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def submit_and_never_read():
        stream = engine.submit([[5, 6, 7]], params, ["slow-reader"])
        most_pending, deadline = 0, time.monotonic() + 120
        # until the last delivery, which comes after the generator has let the request go
        while not any(output.finished for output in stream.undelivered.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            most_pending = max(most_pending, len(stream.undelivered))
        return stream, most_pending

    try:
        stream, most_pending = asyncio.run(submit_and_never_read())
    finally:
        engine.stop()
    (pending,) = stream.undelivered.values()
    assert most_pending == 1 and pending.finished and len(pending.outputs[0].token_ids) == LONG
    assert long_generator.kv_manager.pool.num_used_blocks == 0


def test_a_stream_whose_client_stops_reading_is_aborted_after_the_write_timeout(long_generator):
    """Its KV blocks are not held for the whole answer: after --stream-write-timeout without a read it is aborted."""
    from hf_paged.engine_loop import EngineError, EngineLoop

    engine = EngineLoop(long_generator, write_timeout=0.5)
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def never_read_then_look():
        stream = engine.submit([[5, 6, 7]], params, ["stalled"])
        while long_generator.has_unfinished_requests():
            await asyncio.sleep(0.05)
        with pytest.raises(EngineError, match="read nothing"):
            async for _ in stream:
                pass
        return stream

    try:
        stream = asyncio.run(never_read_then_look())
    finally:
        engine.stop()
    (pending,) = stream.undelivered.values()
    assert not pending.finished and len(pending.outputs[0].token_ids) < LONG
    assert long_generator.kv_manager.pool.num_used_blocks == 0 and not long_generator.requests


def test_the_write_timeout_counts_from_when_outputs_wait_not_from_the_last_read():
    """A call whose first outputs come after a long queue is not "stalled": its handler never had anything to read."""
    from hf_paged.generation.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from hf_paged.engine_loop import RequestStream

    aborted = []

    class Engine:
        def abort(self, ids):
            aborted.extend(ids)

    def output(request_id):
        return RequestOutput(request_id, None, [], [CompletionOutput(0, "x", [1])], False, RequestMetrics(0.0))

    async def late_first_outputs():
        stream = RequestStream(Engine(), ["a", "b"], write_timeout=0.2)
        await asyncio.sleep(0.3)  # a long queue: nothing to read yet
        stream.put(output("a"))
        stream.put(output("b"))  # same step, before the handler ran
        return stream

    stream = asyncio.run(late_first_outputs())
    assert stream.error is None and not aborted and set(stream.undelivered) == {"a", "b"}


def test_a_refusal_names_the_parameter_at_fault(long_generator):
    """`InvalidParameter.param` and `RequestOutput.error_param`: what the server's 400s name, read from the error
    itself (the server parsed "SamplingParams.<field>" out of its text)."""
    from hf_paged import InvalidParameter

    with pytest.raises(InvalidParameter) as raised:
        SamplingParams(temperature=-1.0)
    assert raised.value.param == "temperature" and "SamplingParams.temperature must be" in str(raised.value)
    fine = SamplingParams(temperature=0, max_tokens=2)
    outputs = long_generator.run([[5, 6], [5, 6], [5, 6]], [SamplingParams(n=10**4), fine,
                                                             SamplingParams(stop_token_ids=[10**6])], use_tqdm=False)
    assert [(o.error_param, o.error is None) for o in outputs] == [("n", False), (None, True), ("stop_token_ids", False)]


def test_calls_on_the_engine_thread_run_between_steps_and_fail_when_it_stops(long_generator):
    """`EngineLoop.call` (embeddings' forwards): run on the engine thread, never during a step; their errors reach the
    caller; those still queued when the engine stops fail with EngineStopping."""
    import threading

    from hf_paged.engine_loop import EngineLoop, EngineStopping

    engine = EngineLoop(long_generator)
    params = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    stepping, seen = threading.Event(), []
    step = long_generator.step

    def watched_step():
        stepping.set()
        try:
            return step()
        finally:
            stepping.clear()

    long_generator.step = watched_step
    try:
        long_generator.add_request([5, 6, 7], params, "beside")  # steps while the calls come
        for _ in range(20):
            seen.append(engine.call(lambda: (threading.current_thread().name, stepping.is_set())).result(10))
        assert set(seen) == {("hf-paged-engine", False)}
        steps = []  # while a request generates, one call runs between two steps
        long_generator.step = lambda: (steps.append(None), watched_step())[1]
        queued = [engine.call(lambda: len(steps)) for _ in range(4)]
        counts = [future.result(10) for future in queued]
        assert all(b > a for a, b in zip(counts, counts[1:])), counts
        long_generator.step = watched_step
        with pytest.raises(ZeroDivisionError):
            engine.call(lambda: 1 / 0).result(10)
        engine.stop()
        queued = engine.call(lambda: 1)  # restarts the engine, as a submit does
        assert queued.result(10) == 1
        gate, started = threading.Event(), threading.Event()
        blocker = engine.call(lambda: (started.set(), gate.wait())[1])
        later = engine.call(lambda: 2)
        assert started.wait(10)  # stop comes while the call runs, not while it is still queued
        engine.stop(timeout=0.1)
        gate.set()
        assert blocker.result(10) is True
        with pytest.raises(EngineStopping):
            later.result(10)
        gate.clear()  # a graceful shutdown's cut-off fails the calls still queued too
        blocker, later = engine.call(gate.wait), engine.call(lambda: 2)
        engine.cut_off()
        gate.set()
        with pytest.raises(EngineStopping):
            later.result(10)
        ended = engine.call(lambda: (_ for _ in ()).throw(SystemExit("boom")))  # ends the thread: its caller knows
        with pytest.raises(SystemExit):
            ended.result(10)
    finally:
        long_generator.step = step
        engine.stop()
        long_generator.abort_request("beside")
        long_generator.step()
