"""Schemathesis against the server's own OpenAPI schema, in process over ASGI, on a tiny random model.

Every generated call (valid bodies and invalid ones alike) must be answered without a 5xx, within seconds, and every
error must have OpenAI's shape; afterwards the engine must be alive with no KV block in use.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from live_server import MODEL, tiny_generator, wait_until_idle  # noqa: E402

from hf_paged.server import ServerLimits, create_app  # noqa: E402

SLOWEST_CALL_S = 30


@pytest.fixture(scope="module")
def app(smollm2_path):
    # A short context bounds the work of any call: the fuzzer's max_tokens of 2**31 still stop after ~100 tokens.
    generator = tiny_generator(smollm2_path, max_num_seqs=8, max_model_len=128)
    return create_app(generator, MODEL, limits=ServerLimits(max_client_batch_size=8))


@pytest.fixture(scope="module")
def operations(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return {operation.ok().label: operation.ok() for operation in schema.get_all_operations()}


@schemathesis.check
def openai_error_shape(ctx, response, case) -> None:
    """A 4xx/5xx carries ``{"error": {"message", "type", "param", "code"}}`` and nothing else; never a 5xx."""
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert response.status_code < 500, body


POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE


@pytest.mark.parametrize("label, mode, examples", [
    ("POST /v1/completions", POSITIVE, 60), ("POST /v1/completions", NEGATIVE, 60),
    ("POST /v1/chat/completions", POSITIVE, 60), ("POST /v1/chat/completions", NEGATIVE, 60),
    ("POST /v1/responses", POSITIVE, 60), ("POST /v1/responses", NEGATIVE, 60),
    ("POST /v1/score", POSITIVE, 30), ("POST /v1/score", NEGATIVE, 30),
    ("POST /v1/rerank", POSITIVE, 30), ("POST /v2/rerank", NEGATIVE, 30),
    ("GET /v1/models", POSITIVE, 5), ("GET /health", POSITIVE, 5), ("GET /metrics", POSITIVE, 5),
], ids=lambda value: getattr(value, "value", str(value)))
def test_no_call_breaks_the_server(operations, label, mode, examples):
    """Positive cases follow the schema, negative ones break it (wrong types, missing fields, ...)."""
    @given(case=operations[label].as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def call(case):
        start = time.perf_counter()
        response = case.call()
        assert time.perf_counter() - start < SLOWEST_CALL_S, "a call took too long"
        case.validate_response(response, checks=[openai_error_shape])

    call()


def test_after_the_fuzzing_the_engine_is_alive_and_idle(app):
    generator = app.state.engine.generator
    wait_until_idle(generator)
    assert app.state.engine.healthy and generator.stats().num_used_blocks == 0
