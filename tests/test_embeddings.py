"""Embeddings (`hf_paged.pooling`): against Transformers' own hidden states, through `LLM.embed`, and through
``/v1/embeddings`` on a real server with the official `openai` client."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import ContinuousBatchGenerator
from hf_paged.pooling import PoolingConfig, embed

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from hf_paged.server import ServerLimits, create_app  # noqa: E402
from live_server import live_server  # noqa: E402

MODEL = "smollm2-embed"
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "Hi", "A dog slept on the rug."]


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path, attn_implementation="eager").eval()


def expected(reference, ids: list[int], config: PoolingConfig, dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        states = reference.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[config.pooling][:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if config.normalize else vector


@pytest.mark.parametrize("config", [PoolingConfig(), PoolingConfig("mean", False), PoolingConfig("cls", True)],
                         ids=["last-normalized", "mean", "cls-normalized"])
def test_pooled_states_are_transformers_own(smollm2, reference, config):
    """Inputs of one length run as a batch, others alone; each is its own forward's pooled state."""
    model, tokenizer = smollm2
    ids = [tokenizer(text).input_ids for text in TEXTS] + [tokenizer(TEXTS[0]).input_ids]
    vectors = embed(model, ids, config, dimensions=None)
    for prompt, vector in zip(ids, vectors):
        torch.testing.assert_close(torch.tensor(vector), expected(reference, prompt, config), atol=2e-5, rtol=1e-4)
    cut = embed(model, ids[:1], config, dimensions=64)[0]
    assert len(cut) == 64
    torch.testing.assert_close(torch.tensor(cut), expected(reference, ids[0], config, 64), atol=2e-5, rtol=1e-4)


def test_inputs_run_in_padded_batches_by_length():
    from hf_paged.pooling import padded_batches

    assert padded_batches([5, 1, 3, 3]) == [[1, 2, 3, 0]]  # by length; 4 x 5 tokens fit
    assert padded_batches([600, 10, 700, 5000, 650], batch_tokens=2048) == [[1, 0, 4], [2], [3]]  # 4 x 700 would not
    assert padded_batches([]) == []


def test_pooling_follows_the_sentence_transformers_files(tmp_path):
    assert PoolingConfig.of_model(tmp_path) == PoolingConfig("last", True)  # none: vLLM's default for a causal LM
    assert PoolingConfig.of_model("") == PoolingConfig.of_model(None) == PoolingConfig()  # built from a config
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    modules = [{"idx": 0, "type": "sentence_transformers.models.Transformer", "path": ""},
               {"idx": 1, "type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert PoolingConfig.of_model(tmp_path) == PoolingConfig("mean", False)
    (tmp_path / "modules.json").write_text(json.dumps(modules + [{"type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert PoolingConfig.of_model(tmp_path) == PoolingConfig("last", True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 576}))
    assert PoolingConfig.of_model(tmp_path) == PoolingConfig("mean", True)  # sentence-transformers' default
    # What is not served here is refused, not replaced by another pooling.
    for flags in ({"pooling_mode_max_tokens": True}, {"pooling_mode_weightedmean_tokens": True},
                  {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(flags))
        with pytest.raises(ValueError, match="is not served here: one of last token, mean or first token"):
            PoolingConfig.of_model(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(modules + [{"type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="include Dense, which are not served"):
        PoolingConfig.of_model(tmp_path)
    with pytest.raises(ValueError, match="pooling is one of"):
        PoolingConfig("max")
    assert PoolingConfig.from_vllm({"pooling_type": "MEAN", "normalize": False}) == PoolingConfig("mean", False)
    assert PoolingConfig.from_vllm({}) == PoolingConfig()


def test_the_pooler_config_flag_decides_over_the_model_directory(smollm2, reference):
    """vLLM's --pooler-config, through the server's options."""
    from starlette.testclient import TestClient

    from hf_paged.server.options import ServingOptions

    model, tokenizer = smollm2
    config = PoolingConfig("mean", False)
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=16), MODEL,
                     options=ServingOptions(pooling=config))
    with TestClient(app) as client:
        (data,) = client.post("/v1/embeddings", json={"input": TEXTS[0]}).json()["data"]
    torch.testing.assert_close(torch.tensor(data["embedding"]),
                               expected(reference, tokenizer(TEXTS[0]).input_ids, config), atol=2e-5, rtol=1e-4)


def test_llm_embed_as_vllms(smollm2_path, smollm2, reference):
    from hf_paged import LLM

    llm = LLM(smollm2_path, dtype="float32", num_blocks=16)
    tokenizer = smollm2[1]
    (one,) = llm.embed(TEXTS[1])
    assert one.prompt_token_ids == tokenizer(TEXTS[1]).input_ids and one.finished
    torch.testing.assert_close(torch.tensor(one.outputs.embedding), expected(reference, one.prompt_token_ids,
                                                                              PoolingConfig()), atol=2e-5, rtol=1e-4)
    outputs = llm.embed([TEXTS[1], {"prompt_token_ids": one.prompt_token_ids}], dimensions=32)
    assert [len(o.outputs.embedding) for o in outputs] == [32, 32]
    assert outputs[0].outputs.embedding == outputs[1].outputs.embedding
    llm.generator.model.config.matryoshka_dimensions = [16, 64]  # as a Matryoshka model's config names them
    try:
        assert len(llm.embed(TEXTS[1], dimensions=16)[0].outputs.embedding) == 16
        with pytest.raises(ValueError, match=r"one of the model's matryoshka_dimensions \[16, 64\].*got 32"):
            llm.embed(TEXTS[1], dimensions=32)
    finally:
        del llm.generator.model.config.matryoshka_dimensions
    for prompts, options, words in (([""], {}, "empty"), ([[10 ** 7]], {}, "outside the model's vocabulary"),
                                    (["x"], {"dimensions": 0}, "dimensions must be 1 to"),
                                    (["x"], {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be >= 1")):
        with pytest.raises(ValueError, match=words):
            llm.embed(prompts, **options)
    # vLLM's way to ask for an embedding model: its runner, task and convert are taken, its pooler_config decides.
    config = PoolingConfig("mean", False)
    pooled = LLM(smollm2_path, dtype="float32", num_blocks=16, runner="pooling", convert="embed",
                 pooler_config={"pooling_type": "MEAN", "normalize": False})
    torch.testing.assert_close(torch.tensor(pooled.embed(TEXTS[1])[0].outputs.embedding),
                               expected(reference, one.prompt_token_ids, config), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(smollm2_path, runner="classify")


def test_an_input_to_embed_may_fill_the_context_as_in_vllm(smollm2_path):
    """Nothing is generated after an input to embed: it may be max_model_len tokens long (-1 keeps that many), and a
    truncation past the context is refused, offline and served."""
    from starlette.testclient import TestClient

    from hf_paged import LLM

    llm = LLM(smollm2_path, dtype="float32", num_blocks=16, max_model_len=32)
    ids = list(range(100, 140))
    assert llm.embed([ids[:32]])[0].prompt_token_ids == ids[:32]
    assert llm.embed([ids], truncate_prompt_tokens=-1)[0].prompt_token_ids == ids[-32:]
    for options, words in (({}, "the input is 40 tokens long"), ({"truncate_prompt_tokens": 33},
                                                                    r"truncate_prompt_tokens \(33\) is more than")):
        with pytest.raises(ValueError, match=words):
            llm.embed([ids], **options)
    with pytest.raises(ValueError, match="prompt and output together"):  # a prompt to generate from leaves room
        llm.generate([{"prompt_token_ids": ids[:32]}], use_tqdm=False)
    with TestClient(create_app(llm.generator, MODEL)) as client:
        assert client.post("/v1/embeddings", json={"input": ids[:32]}).json()["usage"]["prompt_tokens"] == 32
        cut = client.post("/v1/embeddings", json={"input": ids, "truncate_prompt_tokens": -1}).json()
        assert cut["usage"]["prompt_tokens"] == 32
        refused = client.post("/v1/embeddings", json={"input": "Hi", "truncate_prompt_tokens": 33})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.fixture(scope="module")
def server(smollm2):
    generator = ContinuousBatchGenerator(*smollm2, num_blocks=256)
    with live_server(create_app(generator, MODEL, limits=ServerLimits(max_embedding_inputs=40))) as live:
        yield SimpleNamespace(base=live.base, generator=generator)


def test_the_openai_client_gets_the_engines_embeddings(server, smollm2):
    """The client asks for base64 by default and decodes it; "float" answers lists; both are `embed`'s vectors."""
    model, tokenizer = smollm2
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=120)
    answer = client.embeddings.create(model=MODEL, input=TEXTS)
    ids = [tokenizer(text).input_ids for text in TEXTS]
    assert [d.index for d in answer.data] == [0, 1, 2, 3] and answer.model == MODEL
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    mine = embed(model, ids, PoolingConfig())
    for data, vector in zip(answer.data, mine):
        torch.testing.assert_close(torch.tensor(data.embedding), torch.tensor(vector), atol=1e-6, rtol=1e-5)
    floats = httpx.post(f"{server.base}/v1/embeddings", json={"input": ids[1], "encoding_format": "float",
                                                              "dimensions": 16}, timeout=60).json()
    assert len(floats["data"]) == 1 and len(floats["data"][0]["embedding"]) == 16
    assert abs(sum(v * v for v in floats["data"][0]["embedding"]) - 1) < 1e-5
    cut = client.embeddings.create(model=MODEL, input=[TEXTS[1]], dimensions=16).data[0].embedding
    torch.testing.assert_close(torch.tensor(cut), torch.tensor(floats["data"][0]["embedding"]), atol=1e-6, rtol=1e-5)


def decoded(text: str, dtype: torch.dtype, endianness: str) -> torch.Tensor:
    """A base64 embedding's numbers, written as ``dtype`` in that byte order."""
    width = torch.empty(0, dtype=dtype).element_size()
    order = {"little": "<", "big": ">", "native": "="}[endianness]
    raw = np.frombuffer(base64.b64decode(text), dtype=f"{order}{ {4: 'i4', 2: 'i2', 1: 'u1'}[width]}")
    return torch.from_numpy(raw.astype(raw.dtype.newbyteorder("="))).view(dtype).float()


def test_vllms_embedding_fields_choose_normalization_and_how_base64_writes_the_numbers(server):
    def embedding(**fields):
        answer = httpx.post(f"{server.base}/v1/embeddings", json={"input": TEXTS[0], **fields}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    plain = embedding(encoding_format="float")
    assert plain["id"].startswith("embd-") and isinstance(plain["created"], int)
    unit = torch.tensor(plain["data"][0]["embedding"])
    raw = torch.tensor(embedding(encoding_format="float", normalize=False)["data"][0]["embedding"])
    assert abs(raw.norm() - 1) > 0.1
    torch.testing.assert_close(raw / raw.norm(), unit, atol=1e-6, rtol=1e-5)
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16),
                        ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        for endianness in ("little", "big", "native"):
            text = embedding(embed_dtype=name, endianness=endianness, encoding_format="base64")["data"][0]["embedding"]
            assert torch.equal(decoded(text, dtype, endianness), unit.to(dtype).float()), (name, endianness)
    refused = httpx.post(f"{server.base}/v1/embeddings", json={"input": "x", "embed_dtype": "int4"}, timeout=60)
    assert refused.status_code == 400 and "embed_dtype" in refused.text


def test_a_conversation_is_embedded_as_its_template_renders_it_as_vllms(server, smollm2):
    """vLLM's chat-style input: ``messages`` rendered by the chat template (no generation prompt unless asked, no
    special tokens added), embedded as that text's tokens would be."""
    model, tokenizer = smollm2
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]

    def embedded(body: dict) -> dict:
        answer = httpx.post(f"{server.base}/v1/embeddings", json={"encoding_format": "float", **body}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    for options in ({}, {"add_generation_prompt": True}):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"]
        answer = embedded({"messages": messages, **options})
        assert answer["usage"]["prompt_tokens"] == len(ids)
        torch.testing.assert_close(torch.tensor(answer["data"][0]["embedding"]),
                                   torch.tensor(embed(model, [ids], PoolingConfig())[0]), atol=1e-6, rtol=1e-5)
    short = embedded({"messages": messages, "truncate_prompt_tokens": 5})
    assert short["usage"]["prompt_tokens"] == 5
    for payload, param, words in (
            ({"messages": messages, "input": "x"}, None, "one of the two"),
            ({}, None, "one of the two"),
            ({"messages": []}, None, "messages"),
            ({"messages": messages, "add_generation_prompt": True, "continue_final_message": True},
             "continue_final_message", "set add_generation_prompt to false")):
        answer = httpx.post(f"{server.base}/v1/embeddings", json=payload, timeout=60)
        assert answer.status_code == 400, (payload, answer.text)
        error = answer.json()["error"]
        assert words in error["message"] and (param is None or error["param"] == param), (payload, error)


def test_embeddings_interleave_with_generation_and_bad_inputs_are_named(server):
    """A call of many inputs runs a few at a time between engine steps: a stream running beside it finishes too."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        completion = pool.submit(httpx.post, f"{server.base}/v1/completions", json=body, timeout=120)
        many = pool.submit(httpx.post, f"{server.base}/v1/embeddings",
                           json={"input": [f"text number {i}" for i in range(40)]}, timeout=120)
        assert completion.result().status_code == 200 and completion.result().json()["usage"]["completion_tokens"] == 24
        assert many.result().status_code == 200 and len(many.result().json()["data"]) == 40
    for payload, param, words in (
            ({"input": []}, "input", "the input is empty"),
            ({"input": [""]}, "input", "input 0 is empty"),
            ({"input": [[1, 2], [10 ** 7]]}, "input", "outside the model's vocabulary"),
            ({"input": "x", "dimensions": 100000}, "dimensions", "dimensions must be 1 to the model's 576"),
            ({"input": ["x"] * 41}, "input", "at most 40 inputs in one call"),
            ({"input": "x", "encoding_format": "int8"}, None, "encoding_format"),
            ({"input": "x", "dimensions": True}, None, "dimensions"),
            ({"input": "x", "model": "other"}, "model", "does not exist")):
        answer = httpx.post(f"{server.base}/v1/embeddings", json=payload, timeout=60)
        assert answer.status_code in (400, 404), payload
        error = answer.json()["error"]
        assert words in error["message"] and (param is None or error["param"] == param), (payload, error)
    assert server.generator.stats().num_used_blocks == 0


def test_a_model_whose_pooling_is_not_served_still_generates_and_overflow_is_named(smollm2, tmp_path, monkeypatch):
    """A sentence-transformers Dense module: embeddings are refused by name, generation goes on; an embedding that
    overflowed its dtype is a 500 that says so (JSON cannot carry NaN)."""
    from starlette.testclient import TestClient

    model, tokenizer = smollm2
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Dense"}]))
    monkeypatch.setattr(model, "name_or_path", str(tmp_path), raising=False)
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=16), MODEL)
    monkeypatch.undo()
    with TestClient(app) as client:
        refused = client.post("/v1/embeddings", json={"input": "x"})
        assert refused.status_code == 400 and "include Dense" in refused.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=16), MODEL)
    monkeypatch.setattr("hf_paged.server.serving.embed", lambda *args: [[float("nan"), 0.0]])
    with TestClient(app) as client:
        broken = client.post("/v1/embeddings", json={"input": "x"})
    assert broken.status_code == 500 and "input 0 is not finite" in broken.json()["error"]["message"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen2_moe", "gemma3n", "gpt_oss", "gpt2", "falcon"])
def test_a_padded_batch_embeds_each_input_as_it_alone(arch):
    """Each input of a right-padded batch pools what it pools alone, whatever the architecture (sliding windows,
    sinks, shared KV): the padding comes after it, and the mean and the last token skip it."""
    from tiny_models import tiny_model

    model, _ = tiny_model(arch)
    torch.manual_seed(1)
    prompts = [torch.randint(3, 250, (n,)).tolist() for n in (3, 20, 11, 20, 7)]
    for config in (PoolingConfig("mean", True), PoolingConfig("last", False)):
        batched = embed(model, prompts, config)
        for prompt, vector in zip(prompts, batched):
            torch.testing.assert_close(torch.tensor(vector), torch.tensor(embed(model, [prompt], config)[0]),
                                       atol=1e-5, rtol=1e-5)


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64),
                                                 torch.tensor(b, dtype=torch.float64), dim=0).item()


def test_llm_score_is_the_embeddings_cosine_similarity_as_vllms(smollm2_path):
    from hf_paged import LLM

    llm = LLM(smollm2_path, dtype="float32", num_blocks=16)
    vectors = [o.outputs.embedding for o in llm.embed(TEXTS)]
    one_to_many = llm.score(TEXTS[0], TEXTS[1:])
    assert [o.outputs.score for o in one_to_many] == pytest.approx([cosine(vectors[0], v) for v in vectors[1:]],
                                                                   abs=1e-6)
    assert one_to_many[0].prompt_token_ids == (llm.embed(TEXTS[0])[0].prompt_token_ids
                                               + llm.embed(TEXTS[1])[0].prompt_token_ids)
    pairwise = llm.score(TEXTS[:2], TEXTS[2:])
    assert [o.outputs.score for o in pairwise] == pytest.approx([cosine(vectors[0], vectors[2]),
                                                                 cosine(vectors[1], vectors[3])], abs=1e-6)
    assert llm.score(TEXTS[1], TEXTS[1])[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
        llm.score(TEXTS[:2], TEXTS[1:])
    with pytest.raises(ValueError, match="data_2 is empty"):
        llm.score(TEXTS[0], [])
    # vLLM's keywords: use_tqdm is taken, the others are refused by name
    assert llm.score(TEXTS[1], TEXTS[1], use_tqdm=False, truncate_prompt_tokens=2)[0].outputs.score == pytest.approx(1)
    assert len(llm.embed(TEXTS[1], use_tqdm=False, truncate_prompt_tokens=2)[0].prompt_token_ids) == 2
    for options, words in (({"lora_request": object()}, "LoRA adapters do not apply"),
                           ({"pooling_params": object()}, "pooling_params are not taken")):
        with pytest.raises(ValueError, match=words):
            llm.score(TEXTS[0], TEXTS[1], **options)
        with pytest.raises(ValueError, match=words):
            llm.embed(TEXTS[0], **options)


def test_score_and_rerank_endpoints_answer_as_vllms(server, smollm2):
    """``/score`` and ``/rerank`` (every path vLLM serves them under) score by the cosine similarity of `embed`'s
    vectors; the documents come back best first."""
    model, tokenizer = smollm2
    ids = [tokenizer(text).input_ids for text in TEXTS]
    vectors = embed(model, ids, PoolingConfig())
    for path in ("/score", "/v1/score"):
        answer = httpx.post(f"{server.base}{path}", json={"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]},
                            timeout=60).json()
        assert answer["object"] == "list" and answer["model"] == MODEL and answer["id"].startswith("score-")
        assert [(d["index"], d["object"]) for d in answer["data"]] == [(0, "score"), (1, "score"), (2, "score")]
        assert [d["score"] for d in answer["data"]] == pytest.approx([cosine(vectors[0], v) for v in vectors[1:]],
                                                                      abs=1e-6)
        assert answer["usage"]["prompt_tokens"] == sum(map(len, ids)) and answer["usage"]["completion_tokens"] == 0
    pairwise = httpx.post(f"{server.base}/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:]}, timeout=60).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([cosine(vectors[0], vectors[2]),
                                                                    cosine(vectors[1], vectors[3])], abs=1e-6)
    scores = [cosine(vectors[0], v) for v in vectors[1:]]
    best = sorted(range(3), key=lambda i: -scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = httpx.post(f"{server.base}{path}", json={"model": MODEL, "query": TEXTS[0], "documents": TEXTS[1:],
                                                          "top_n": 2}, timeout=60).json()
        assert [r["index"] for r in answer["results"]] == best[:2] and answer["id"].startswith("rerank-")
        assert [r["document"]["text"] for r in answer["results"]] == [TEXTS[1 + i] for i in best[:2]]
        assert [r["relevance_score"] for r in answer["results"]] == pytest.approx([scores[i] for i in best[:2]],
                                                                                  abs=1e-6)
        assert answer["usage"]["total_tokens"] == sum(map(len, ids))
    for top_n in (0, -1, 10):  # all of them, as vLLM reads these
        every = httpx.post(f"{server.base}/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": top_n},
                           timeout=60).json()
        assert [r["index"] for r in every["results"]] == best
    for path, payload, param, words in (
            ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:]}, "text_2", "text_1 has 2 texts and text_2 3"),
            ("/score", {"text_1": [], "text_2": TEXTS}, "text_1", "text_1 is empty"),
            ("/score", {"text_1": "x", "text_2": ["y", ""]}, "text_2", "text_2[1] is empty"),
            ("/rerank", {"query": "x", "documents": []}, "documents", "documents is empty"),
            ("/rerank", {"query": "", "documents": ["y"]}, "query", "query is empty"),
            ("/rerank", {"query": "x", "documents": ["y"] * 41}, "documents", "at most 40 inputs in one call"),
            ("/score", {"text_1": ["x"] * 21, "text_2": ["y"] * 21}, "text_2", "in one call are allowed on this "
             "server (--max-embedding-inputs), got 42"),  # the two sides together
            ("/rerank", {"query": "x", "documents": ["y", "z" * 270000]}, "documents",
             "documents[1]: the prompt is 270000 characters long"),
            ("/v1/embeddings", {"input": [[1, 2], [10 ** 7]]}, "input", "input 1: prompt token ids [10000000] are"),
            ("/score", {"text_1": "x", "text_2": "y", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
             ">= 1, or -1"),
            ("/v2/rerank", {"query": "x", "documents": ["y"], "top_n": "all"}, None, "top_n"),
            ("/score", {"text_1": "x"}, None, "text_2"),
            ("/v1/score", {"text_1": "x", "text_2": "y", "model": "other"}, "model", "does not exist")):
        answer = httpx.post(f"{server.base}{path}", json=payload, timeout=60)
        assert answer.status_code in (400, 404), payload
        error = answer.json()["error"]
        assert words in error["message"] and (param is None or error["param"] == param), (payload, error)
    assert server.generator.stats().num_used_blocks == 0


def test_score_and_rerank_want_the_api_key(smollm2):
    from starlette.testclient import TestClient

    app = create_app(ContinuousBatchGenerator(*smollm2, num_blocks=16), MODEL, api_key="secret")
    body = {"text_1": "a", "text_2": "b", "query": "a", "documents": ["b"]}
    with TestClient(app) as client:
        for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
            assert client.post(path, json=body).status_code == 401, path
            assert client.post(path, json=body, headers={"Authorization": "Bearer secret"}).status_code == 200, path


def test_pooling_answers_name_the_model_asked_for_and_count_in_metrics_as_vllms(smollm2):
    """As vLLM's: an answer names the served name it was asked by (an empty name is the served model), and each input
    embedded is a finished request in /metrics, its tokens prompt tokens."""
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    _, tokenizer = smollm2
    app = create_app(ContinuousBatchGenerator(*smollm2, num_blocks=16), [MODEL, "alias"])
    calls = [("/v1/embeddings", {"input": TEXTS[:2]}), ("/score", {"text_1": TEXTS[0], "text_2": TEXTS[1]}),
             ("/rerank", {"query": TEXTS[0], "documents": TEXTS[1:3]})]
    with TestClient(app) as client:
        for path, body in calls:
            for asked, named in (("alias", "alias"), ("", MODEL), (MODEL, MODEL)):
                answer = client.post(path, json={**body, "model": asked})
                assert answer.status_code == 200 and answer.json()["model"] == named, (path, asked, answer.text)
        template = client.post("/v1/embeddings", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "chat_template": "{{ messages }}"})
        assert template.status_code == 400 and template.json()["error"]["param"] == "chat_template"
        samples = {(sample.name, sample.labels.get("finished_reason")): sample.value
                   for family in text_string_to_metric_families(client.get("/metrics").text)
                   for sample in family.samples}
    tokens = [len(tokenizer(text).input_ids) for text in TEXTS]
    assert samples[("hf_paged:request_success_total", "stop")] == 3 * (2 + 2 + 3)  # three names, seven inputs each
    assert samples[("hf_paged:prompt_tokens_total", None)] == 3 * (3 * (tokens[0] + tokens[1]) + tokens[2])
    assert samples[("hf_paged:request_prompt_tokens_count", None)] == 3 * (2 + 2 + 3)
