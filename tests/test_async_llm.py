"""`hf_paged.AsyncLLM`: vLLM's asynchronous entry point, over the engine thread the server uses."""

import asyncio
import copy
import threading
import time

import pytest

from hf_paged import AsyncLLM, ContinuousBatchGenerator, RequestOutputKind, SamplingParams, StructuredOutputsParams
from hf_paged.engine_loop import EngineError


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tokenizer = smollm2
    engine = AsyncLLM.from_generator(ContinuousBatchGenerator(model, tokenizer, num_blocks=256))
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params, request_id=None):
    return [output async for output in engine.generate(prompt, params, request_id)]


def test_concurrent_requests_match_generate_in_every_output_kind(engine, smollm2, chat_prompts):
    model, tokenizer = smollm2
    expected = []
    for prompt in chat_prompts[:3]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected.append(model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:].tolist())
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]

    async def main():
        return await asyncio.gather(*(
            _collect(engine, prompt, SamplingParams(temperature=0, max_tokens=10, output_kind=kind))
            for prompt, kind in zip(chat_prompts, kinds)))

    cumulative, delta, final = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in cumulative][-1] == expected[0]
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lengths == sorted(lengths) and len(cumulative) > 2  # each a snapshot that later ones did not change
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
    assert [t for o in delta for t in o.outputs[0].token_ids] == expected[1]
    assert "".join(o.outputs[0].text for o in delta) == tokenizer.decode(expected[1], skip_special_tokens=True)
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == expected[2]
    assert final[0].outputs[0].finish_reason == "length"


def test_leaving_early_or_abort_ends_a_request_and_frees_its_blocks(engine, chat_prompts):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        async for output in engine.generate(chat_prompts[0], params, request_id="left"):
            if len(output.outputs[0].token_ids) >= 3:
                break  # the generator is released here, and closed
        for _ in range(200):
            if "left" not in engine.generator.requests:
                break
            await asyncio.sleep(0.05)
        assert "left" not in engine.generator.requests  # aborted now, not when asyncio.run ends
        aborted = asyncio.create_task(_collect(engine, chat_prompts[1], params, request_id="to-abort"))
        while "to-abort" not in engine.generator.requests:
            await asyncio.sleep(0.01)
        await engine.abort("to-abort")
        return await aborted

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 200
    assert not engine.generator.requests and engine.generator.kv_manager.pool.num_used_blocks == 0
    assert engine.is_running and not engine.errored


def test_a_request_id_is_free_again_as_soon_as_its_request_is_given_up_as_in_vllm(engine, chat_prompts):
    """vLLM forgets a request once it is aborted or its generator closed: its id may be reused at once (here the
    new call waits for the engine's next step to hand out the abort)."""
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=3)

    async def started(request_id):
        task = asyncio.create_task(_collect(engine, chat_prompts[0], long, request_id))
        while request_id not in engine.generator.requests:
            await asyncio.sleep(0.01)
        return task

    async def main():
        reused = []
        outputs = engine.generate(chat_prompts[0], long, request_id="again")
        async for _ in outputs:
            break
        await outputs.aclose()  # aborted (after a bare break, once the event loop closes it)
        reused.append(await _collect(engine, chat_prompts[1], short, "again"))
        task = await started("again")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reused.append(await _collect(engine, chat_prompts[1], short, "again"))
        task = await started("again")
        await engine.abort("again")  # its generator may not have seen the end yet
        reused.append(await _collect(engine, chat_prompts[1], short, "again"))
        assert (await task)[-1].outputs[0].finish_reason == "abort"
        task = await started("again")
        with pytest.raises(ValueError, match="already in use"):  # while it runs, the id is its own
            await _collect(engine, chat_prompts[1], short, "again")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        reused.append(await _collect(engine, chat_prompts[1], short, "again"))
        return reused

    from hf_paged.engine_loop import EngineDead, EngineLoop

    dead = EngineLoop(engine.generator)  # one stopped for good is not started again to wait for an id
    dead.fatal = RuntimeError("a failure")
    with pytest.raises(EngineDead):
        asyncio.run(dead.id_released("again", 1.0))
    assert dead._thread is None
    for outputs in asyncio.run(main()):
        assert outputs[-1].finished and outputs[-1].request_id == "again"
        assert outputs[-1].outputs[0].finish_reason == "length"
        assert len(outputs[-1].outputs[0].token_ids) == 3
    assert engine.generator.kv_manager.pool.num_used_blocks == 0


def test_an_abort_of_an_unknown_id_leaves_the_engine_idle(engine):
    async def main():
        await engine.abort(["finished-long-ago", "never-seen"])
        for _ in range(200):  # the idle engine takes the aborts in
            if not engine.generator.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert not engine.generator.has_unfinished_requests()
    assert engine.generator.reset_prefix_cache()


def test_generate_after_a_shutdown_whose_step_is_still_running(engine, chat_prompts, monkeypatch):
    runner = engine.generator.runner
    real_execute = runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(0.3)
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        running = asyncio.create_task(_collect(engine, chat_prompts[0], params))
        while not engine.generator.requests:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown, 0.05)  # returns while the thread still ends its step
        with pytest.raises(EngineError):
            await running
        again = SamplingParams(temperature=0, max_tokens=2)
        return await asyncio.wait_for(_collect(engine, chat_prompts[1], again), 60)  # the thread was restarted

    outputs = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2 and engine.is_running


def test_bad_input_is_refused_without_touching_requests_in_flight(engine, chat_prompts):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    changed = SamplingParams()
    changed.temperature = -1  # validated again when used

    async def main():
        running = asyncio.create_task(_collect(engine, chat_prompts[0], params, request_id="taken"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="'taken' is already in use"):
            await _collect(engine, chat_prompts[1], params, request_id="taken")
        with pytest.raises(ValueError, match="the prompt is empty"):
            await _collect(engine, "", params)
        with pytest.raises(ValueError, match="temperature"):
            await _collect(engine, "Hi", changed)
        with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
            await _collect(engine, "Hi", params.replace(structured_outputs=StructuredOutputsParams(regex="[a-")))
        return await asyncio.wait_for(running, 60)  # a lost route would leave it waiting

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length" and not outputs[-1].error


def test_shutdown_fails_requests_in_flight_and_a_later_call_starts_again(engine, chat_prompts):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def main():
        running = asyncio.create_task(_collect(engine, chat_prompts[0], params))
        while not engine.generator.requests:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown)
        assert not engine.is_running
        with pytest.raises(EngineError, match="shutdown"):
            await running
        # The stopped request's blocks are free, though no step follows.
        assert not engine.generator.requests and engine.generator.kv_manager.pool.num_used_blocks == 0
        return await _collect(engine, chat_prompts[1], SamplingParams(temperature=0, max_tokens=4))

    again = asyncio.run(main())
    assert again[-1].finished and len(again[-1].outputs[0].token_ids) == 4 and engine.is_running
    assert engine.generator.kv_manager.pool.num_used_blocks == 0


def test_the_event_loop_never_uses_the_engine_threads_tokenizer(smollm2, chat_prompts):
    """A fast tokenizer used from two threads at once can raise "Already borrowed": prompts are tokenized on the
    event loop with a copy, the engine thread detokenizes with the generator's own."""
    model, tokenizer = smollm2
    generator = ContinuousBatchGenerator(model, copy.deepcopy(tokenizer), num_blocks=64)
    engine = AsyncLLM.from_generator(generator)
    threads = set()

    def recorded(name):
        def method(self, *args, **kwargs):
            threads.add(threading.get_ident())
            return getattr(super(recording, self), name)(*args, **kwargs)
        return method

    recording = type("Recording", (type(generator.tokenizer),), {
        name: recorded(name) for name in ("__call__", "apply_chat_template", "encode", "decode")})
    generator.tokenizer.__class__ = recording
    params = SamplingParams(temperature=0, max_tokens=4, bad_words=["Paris"])

    async def main():
        return await asyncio.gather(_collect(engine, chat_prompts[0], params), _collect(engine, "Hello", params))

    try:
        outputs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(out[-1].finished and out[-1].outputs[0].text for out in outputs)
    assert threads and threading.get_ident() not in threads  # only the engine thread's detokenizing
    assert asyncio.run(engine.get_tokenizer()) is not generator.tokenizer


def test_an_engine_dropped_without_shutdown_ends_its_thread_and_is_freed(smollm2):
    """vLLM's AsyncLLM shuts itself down when dropped; an app served without its lifespan (httpx's ASGITransport)
    starts its thread at the first request. Either way, dropping it must not leave the thread holding the engine
    (its weights and KV cache) for the life of the process."""
    import gc
    import weakref

    import httpx

    from hf_paged.server import create_app

    def engine_threads() -> int:
        return sum(thread.name == "hf-paged-engine" for thread in threading.enumerate())

    before = engine_threads()
    engine = AsyncLLM.from_generator(ContinuousBatchGenerator(*smollm2, num_blocks=16))
    generator = weakref.ref(engine.generator)
    asyncio.run(_collect(engine, "Hi", SamplingParams(max_tokens=2)))
    del engine
    gc.collect()
    assert generator() is None and engine_threads() == before

    app = create_app(ContinuousBatchGenerator(*smollm2, num_blocks=16), "m")
    generator = weakref.ref(app.state.serving.generator)

    async def ask() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            return (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})).status_code

    assert asyncio.run(ask()) == 200 and engine_threads() == before + 1
    del app
    gc.collect()
    assert generator() is None and engine_threads() == before


def test_engine_args_make_an_llm_and_an_async_llm_as_vllms(smollm2_path, chat_prompts):
    """vLLM's shapes: ``AsyncLLM.from_engine_args(AsyncEngineArgs(...))`` and ``LLM(**asdict(EngineArgs(...)))``
    load the model with those options and decode alike; options are checked when the arguments are made."""
    import dataclasses

    from hf_paged import LLM, AsyncEngineArgs, EngineArgs

    args = AsyncEngineArgs(model=smollm2_path, dtype="float32", device="cpu", num_blocks=64, max_num_seqs=3,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0, max_tokens=8)
    engine = AsyncLLM.from_engine_args(args)
    try:
        assert engine.generator.config.max_num_seqs == 3 and engine.generator.config.num_blocks == 64
        assert engine.generator.config.speculative_config.num_speculative_tokens == 2
        final = params.replace(output_kind=RequestOutputKind.FINAL_ONLY)
        streamed = asyncio.run(_collect(engine, chat_prompts[0], final))
    finally:
        engine.shutdown()
    llm = LLM(**dataclasses.asdict(EngineArgs(**dataclasses.asdict(args))))
    offline = llm.generate([chat_prompts[0]], params, use_tqdm=False)[0]
    assert streamed[-1].outputs[0].token_ids == offline.outputs[0].token_ids and len(offline.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="max_num_seqs"):
        AsyncEngineArgs(max_num_seqs=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3")
    with pytest.raises(ValueError, match="gptq"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(model=smollm2_path, quantization="gptq"))
    with pytest.raises(TypeError, match="AsyncEngineArgs"):
        AsyncLLM.from_engine_args({"model": smollm2_path})


def test_a_prompt_dicts_cache_salt_keeps_its_blocks_to_its_salt(engine, chat_prompts):
    """vLLM's ``cache_salt`` reaches the engine through `AsyncLLM.generate`: a hit for the same salt only."""
    params = SamplingParams(temperature=0, max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)
    prompt = chat_prompts[4] + " Answer in one sentence, as briefly as you can."

    async def cached(salt) -> int:
        (output,) = await _collect(engine, {"prompt": prompt, "cache_salt": salt}, params)
        return output.num_cached_tokens

    async def main():
        return [await cached(salt) for salt in ("s1", "s2", "s1")]

    first, other, again = asyncio.run(main())
    assert first == other == 0 and again >= 16
