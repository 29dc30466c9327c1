"""A real `hf-paged` server on a loopback port, in this process, over a tiny random model with SmolLM2's tokenizer.

The tiny model (2 layers, hidden size 64) makes steps cost milliseconds, so server tests measure the server, not the
model; its greedy answers are random-looking tokens that rarely hit EOS, which makes lengths predictable.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import torch

MODEL = "tiny"


def tiny_model(smollm2_path: str):
    """A tiny random Llama that uses SmolLM2's tokenizer and chat template, and that tokenizer.

    Its weights are large enough (``initializer_range=0.2``) that its logits are far apart: greedy answers do not
    hinge on rounding, so they are the same whatever else is in the batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024,
                         initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged", dtype=torch.float32).eval()
    return model, tokenizer


def tiny_generator(smollm2_path: str, **engine):
    """A `ContinuousBatchGenerator` over `tiny_model` (256 KV blocks unless told otherwise)."""
    from hf_paged import ContinuousBatchGenerator

    return ContinuousBatchGenerator(*tiny_model(smollm2_path), **{"num_blocks": 256, **engine})


@contextmanager
def live_server(app, serve=None):
    """Serve ``app`` with uvicorn on a free port; yields ``(base_url, uvicorn_server, thread)``.

    ``serve(server, app)`` replaces ``server.run()`` (e.g. `hf_paged.cli.serve_until_stopped`); its result is kept
    in ``thread.result``."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(daemon=True, target=lambda: setattr(
        thread, "result", serve(server, app) if serve else server.run(sockets=[sock])))
    if serve is not None:
        server.config.fd = sock.fileno()
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.02)
    try:
        yield SimpleNamespace(base=base, server=server, thread=thread, app=app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until_idle(generator, timeout: float = 20, engine=None) -> None:
    """Until ``generator`` holds no request and no block; given the server's ``engine`` loop, also until that loop
    has counted and delivered the last step's outputs (it does so after the step that let the requests go)."""
    deadline = time.monotonic() + timeout
    while generator.stats().num_used_blocks or generator.has_unfinished_requests():
        assert time.monotonic() < deadline, f"still busy: {generator.stats()}"
        time.sleep(0.02)
    if engine is not None:
        engine.call(lambda: None).result(timeout)  # runs on the engine thread after that step's metrics and delivery


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
