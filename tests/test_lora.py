"""LoRA adapters (`hf_paged.lora`): PEFT's own adapter files, served beside the base model, token-identical to PEFT."""

import asyncio
import copy
import json
import os

import httpx
import openai
import pytest
import torch

from hf_paged import AsyncLLM, ContinuousBatchGenerator, LoRARequest, SamplingParams
from live_server import MODEL, assert_openai_error, live_server, tiny_model

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 33, 7], [3, 4, 5, 6], [100, 200, 300, 400, 500, 600, 700]]
# name: PEFT's LoraConfig fields (every adapter's lora_B is drawn large enough to change greedy answers)
ADAPTERS = {
    "attn": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(r=16, lora_alpha=32, rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 4},
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def _greedy(model, prompt, tokens=GREEDY.max_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                         eos_token_id=None)  # as ignore_eos: EOS may be drawn, and the answer goes on
    return out[0, len(prompt):].tolist()


def _save_adapter(model, path, seed, spread=0.5, **fields):
    """``model`` (changed in place) with a random LoRA adapter (``lora_B`` drawn with std ``spread``) saved at
    ``path``; returns the PEFT model."""
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **fields))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, spread)
    adapted.save_pretrained(path)
    return adapted.eval()


@pytest.fixture(scope="module")
def adapters(smollm2_path, tmp_path_factory):
    """Each adapter's directory, and every prompt's greedy tokens under it (and under None: the base model), from
    PEFT over Transformers' SDPA attention."""
    root = tmp_path_factory.mktemp("loras")
    base, _ = tiny_model(smollm2_path)
    base.set_attn_implementation("sdpa")
    expected = {None: [_greedy(base, p) for p in PROMPTS]}
    paths = {}
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        adapted = _save_adapter(copy.deepcopy(base), paths[name], seed, **fields)
        expected[name] = [_greedy(adapted, p) for p in PROMPTS]
    assert len({str(tokens) for tokens in expected.values()}) == len(expected)  # every adapter changes the answers
    return paths, expected


def requests_of(paths):
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}


def engine(smollm2_path, **options):
    return ContinuousBatchGenerator(*tiny_model(smollm2_path), **{"num_blocks": 256, "enable_lora": True, **options})


def adapted_native_steps(generator) -> list[int]:
    """Counts, from now on, the native decoder's steps that hold adapted tokens (one entry per step: its tokens)."""
    native, steps = generator.runner.native, []
    forward = native.forward

    def counted(*args, lora=None):
        if lora is not None:
            steps.append(lora.num_tokens)
        return forward(*args, lora=lora)

    native.forward = counted
    return steps


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_requests_of_several_adapters_and_none_in_one_batch_match_peft(smollm2_path, adapters, enforce_eager):
    """In the native decoder's steps, and with ``enforce_eager`` through the Transformers forward and its hooks."""
    paths, expected = adapters
    loras = requests_of(paths)
    generator = engine(smollm2_path, max_loras=3, enforce_eager=enforce_eager)
    assert (generator.runner.native is None) == enforce_eager
    native_steps = [] if enforce_eager else adapted_native_steps(generator)
    names = [None, *ADAPTERS] * len(PROMPTS)
    prompts = [PROMPTS[i // (len(ADAPTERS) + 1)] for i in range(len(names))]
    outputs = generator.run(prompts, GREEDY, use_tqdm=False, lora_request=[loras.get(n) for n in names])
    for name, prompt, output in zip(names, prompts, outputs):
        assert output.outputs[0].token_ids == expected[name][PROMPTS.index(prompt)], name
        assert output.lora_request == loras.get(name)
    assert generator.list_loras() == {1, 2, 3}
    assert enforce_eager or len(native_steps) == GREEDY.max_tokens  # the prompts' step and every decode step


def test_max_loras_holds_requests_of_other_adapters_until_a_seat_frees(smollm2_path, adapters):
    paths, expected = adapters
    loras = requests_of(paths)
    generator = engine(smollm2_path, max_loras=1, max_cpu_loras=3)
    schedule, seen = generator.scheduler.schedule, []

    def watched(*args):
        out = schedule(*args)
        seen.append({seq.request.adapter for seq in generator.scheduler.running} - {None})
        return out

    generator.scheduler.schedule = watched
    names = ["attn", "mlp", None, "all", "attn", "mlp"]
    outputs = generator.run([PROMPTS[0]] * len(names), GREEDY, use_tqdm=False,
                            lora_request=[loras.get(n) for n in names])
    assert [o.outputs[0].token_ids for o in outputs] == [expected[n][0] for n in names]
    assert max(map(len, seen)) == 1 and len(set().union(*seen)) == 3  # one adapter at a time, each in turn


def test_an_id_taken_again_by_another_adapter_counts_as_another_adapter(smollm2_path, adapters):
    """Once an adapter has left the engine's table (``max_cpu_loras``) its id may name another one, while requests of
    the first still run: ``max_loras`` counts the two, so the second waits."""
    paths, expected = adapters
    generator = engine(smollm2_path, max_loras=1, max_cpu_loras=1)
    running = []
    schedule = generator.scheduler.schedule

    def watched(*args):
        out = schedule(*args)
        running.append({seq.request.lora.request.lora_name for seq in generator.scheduler.running})
        return out

    generator.scheduler.schedule = watched
    generator.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("attn", 1, paths["attn"]), request_id="a")
    generator.step()
    generator.add_request(PROMPTS[1], GREEDY, lora_request=LoRARequest("mlp", 2, paths["mlp"]), request_id="b")
    generator.add_request(PROMPTS[2], GREEDY, lora_request=LoRARequest("all", 1, paths["all"]), request_id="c")
    outputs = {}
    while generator.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in generator.step() if o.finished})
    assert outputs == {"a": expected["attn"][0], "b": expected["mlp"][1], "c": expected["all"][2]}
    assert max(map(len, running)) == 1
    assert list(dict.fromkeys(name for names in running for name in names)) == ["attn", "mlp", "all"]


def test_one_adapter_under_two_names_is_one_adapter_of_a_step(smollm2_path, adapters, monkeypatch):
    """Two names (and ids) for the same files load two objects that compute the same thing: ``max_loras`` 1 runs
    both names together, as one group of the step's rows."""
    from hf_paged.lora import LoRAStep

    paths, expected = adapters
    generator = engine(smollm2_path, max_loras=1)
    groups, of = [], LoRAStep.of

    def counted(*args, **kwargs):
        step = of(*args, **kwargs)
        groups.append(0 if step is None else len(step.groups))
        return step

    monkeypatch.setattr(LoRAStep, "of", counted)
    outputs = generator.run([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=[
        LoRARequest("attn", 1, paths["attn"]), LoRARequest("attn-too", 2, paths["attn"])])
    assert [o.outputs[0].token_ids for o in outputs] == [expected["attn"][0], expected["attn"][1]]
    assert generator.scheduler.num_preemptions == 0 and set(groups) == {1}
    assert len(groups) == GREEDY.max_tokens  # both prompts in one step, then every decode step holds both


def test_the_prefix_cache_keeps_each_adapters_keys_and_values_apart(smollm2_path, adapters):
    paths, _ = adapters
    loras = requests_of(paths)
    generator = engine(smollm2_path, max_loras=2, block_size=4)
    prompt = list(range(10, 40))
    reference = copy.deepcopy(generator.model)
    reference.set_attn_implementation("sdpa")
    base_tokens = _greedy(reference, prompt)
    first, base, again = (generator.run([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
                          for lora in (loras["attn"], None, loras["attn"]))
    assert base.outputs[0].token_ids == base_tokens and first.outputs[0].token_ids != base_tokens
    assert base.num_cached_tokens == 0  # the adapter's blocks are not the base model's
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    generator.remove_lora(loras["attn"].lora_int_id)  # loaded again, the same contents find their blocks again
    reloaded = generator.run([prompt], GREEDY, use_tqdm=False, lora_request=loras["attn"])[0]
    assert reloaded.num_cached_tokens > 0 and reloaded.outputs[0].token_ids == first.outputs[0].token_ids
    other = LoRARequest("attn", 1, paths["mlp"])  # other contents under the same name and id: nothing is shared
    generator.remove_lora(1)
    assert generator.run([prompt], GREEDY, use_tqdm=False, lora_request=other)[0].num_cached_tokens == 0


def _broken_adapters(source, root):
    """Variants of the adapter at ``source`` that must be refused, each with words its refusal must hold."""
    from safetensors.torch import load_file, save_file

    config = json.loads(open(os.path.join(source, "adapter_config.json")).read())
    tensors = load_file(os.path.join(source, "adapter_model.safetensors"))

    def variant(name, change=None, weights=tensors, config_text=None):
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text(config_text or json.dumps({**config, **(change or {})}))
        if isinstance(weights, bytes):
            (root / name / "adapter_model.safetensors").write_bytes(weights)
        else:
            save_file(weights, root / name / "adapter_model.safetensors")
        return str(root / name)

    wider = {k: torch.zeros(v.shape[0], 96) if "lora_A" in k else v for k, v in tensors.items()}
    renamed = {k.replace("self_attn", "attention"): v for k, v in tensors.items()}
    embedding = {**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}
    output = {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
              "base_model.model.lm_head.lora_B.weight": torch.zeros(49152, 4)}
    rank0 = {k: torch.zeros(0, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 0) for k, v in tensors.items()}
    scalar = {k: torch.tensor(1.0) if "lora_A" in k else v for k, v in tensors.items()}
    return {
        str(root / "missing"): "no adapter_config.json",
        variant("dora", {"use_dora": True}): "DoRA",
        variant("bias", {"bias": "all"}): "trained biases",
        variant("saved", {"modules_to_save": ["lm_head"]}): "modules_to_save",
        variant("wider", weights=wider): "do not fit the model's layer",
        variant("other", weights=renamed): "the model has no module",
        variant("embedding", weights=embedding): "embedding LoRA",
        variant("output", weights=output): "LoRA on the output layer (lm_head) is not served",
        variant("pissa", {"init_lora_weights": "pissa_niter_4"}): "init_lora_weights='pissa_niter_4' trained it",
        variant("listed", config_text="[1, 2]"): "holds a list, not PEFT's object",
        variant("unjson", config_text="{"): "cannot read adapter_config.json",
        variant("damaged", weights=b"not safetensors"): "cannot read its weights",
        variant("rank0", weights=rank0): "is not a matrix of rank 1 or more",
        variant("scalar", weights=scalar): "A () is not a matrix",
        variant("alpha-null", {"lora_alpha": None}): "lora_alpha must be a number, got None",
        variant("patterns-listed", {"alpha_pattern": ["q_proj"]}): "alpha_pattern must map module name patterns",
        source: "rank 16 is above max_lora_rank (8)",
    }


def test_an_adapter_that_does_not_fit_is_refused_by_name_and_the_others_run(smollm2_path, adapters, tmp_path):
    paths, expected = adapters
    broken = _broken_adapters(paths["all"], tmp_path)
    generator = engine(smollm2_path, max_lora_rank=8, max_loras=2)
    good = LoRARequest("attn", 1, paths["attn"])
    bad = [LoRARequest(f"bad{i}", i + 2, path) for i, path in enumerate(broken)]
    outputs = generator.run([PROMPTS[0]] * (len(bad) + 2), GREEDY, use_tqdm=False, lora_request=[good, *bad, None])
    assert outputs[0].outputs[0].token_ids == expected["attn"][0]
    assert outputs[-1].outputs[0].token_ids == expected[None][0]
    for output, words in zip(outputs[1:-1], broken.values()):
        assert output.error is not None and words in output.error, (words, output.error)
        assert not output.outputs
    assert generator.list_loras() == {1}
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'attn'"):
        generator.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("other", 1, paths["mlp"]))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("zero", 0, paths["mlp"])
    module = generator.model.get_submodule("model.layers.0.self_attn.q_proj")
    kind = module.__class__
    module.__class__ = _Router  # a linear layer's sizes, but not its forward (PhiMoE's router returns a tuple)
    try:
        with pytest.raises(ValueError, match="_Router, whose forward is its own"):
            generator.add_lora(LoRARequest("routed", 9, paths["attn"]))
    finally:
        module.__class__ = kind
    plain = ContinuousBatchGenerator(*tiny_model(smollm2_path), num_blocks=64)
    refused = plain.run([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=good)[0]
    assert "enable_lora=True" in refused.error
    with pytest.raises(ValueError, match="EngineConfig.max_cpu_loras \\(1\\) must be at least max_loras \\(2\\)"):
        engine(smollm2_path, max_loras=2, max_cpu_loras=1)


class _Router(torch.nn.Linear):
    def forward(self, hidden):
        return super().forward(hidden), None


def test_adapters_beyond_max_cpu_loras_are_dropped_and_read_again(smollm2_path, adapters):
    paths, expected = adapters
    loras = requests_of(paths)
    generator = engine(smollm2_path)  # max_loras 1, max_cpu_loras 1: vLLM's defaults
    for name in ("attn", "mlp", "attn", "all"):
        output = generator.run([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=loras[name])[0]
        assert output.outputs[0].token_ids == expected[name][1]
        assert generator.list_loras() == {loras[name].lora_int_id}
    assert generator.remove_lora(loras["all"].lora_int_id) and not generator.remove_lora(99)
    assert generator.list_loras() == set()


def test_async_llm_runs_a_request_under_an_adapter(smollm2_path, adapters):
    paths, expected = adapters
    llm = AsyncLLM.from_generator(engine(smollm2_path))

    async def main():
        lora = LoRARequest("mlp", 7, paths["mlp"])
        assert await llm.add_lora(lora) and await llm.list_loras() == {7}
        final = None
        async for final in llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY, "r1", lora_request=lora):
            pass
        return final

    try:
        assert asyncio.run(main()).outputs[0].token_ids == expected["mlp"][2]
    finally:
        llm.shutdown()


def test_smollm2_under_an_adapter_matches_peft(smollm2_path, chat_prompts, tmp_path):
    """The real model, every step through the native decoder, adapted tokens beside base ones."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in chat_prompts[:2]]
    reference = AutoModelForCausalLM.from_pretrained(smollm2_path, attn_implementation="sdpa", dtype=torch.float32)
    base_tokens = [_greedy(reference, p, 16) for p in prompts]
    every_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapted = _save_adapter(reference, tmp_path / "smol", 0, spread=0.02, r=8, lora_alpha=16,
                            target_modules=every_linear)
    adapter_tokens = [_greedy(adapted, p, 16) for p in prompts]
    assert adapter_tokens != base_tokens
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, attn_implementation="paged", dtype=torch.float32)
    generator = ContinuousBatchGenerator(model, tokenizer, enable_lora=True, kv_cache_memory=256 << 20)
    native_steps = adapted_native_steps(generator)
    lora = LoRARequest("smol", 1, str(tmp_path / "smol"))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = generator.run(prompts * 2, params, use_tqdm=False, lora_request=[lora, lora, None, None])
    assert [o.outputs[0].token_ids for o in outputs] == adapter_tokens + base_tokens
    assert len(native_steps) == 16


def test_bf16_adapted_tokens_do_not_depend_on_the_batch(smollm2_path, chat_prompts, tmp_path):
    """In the native decoder a token's adapter product is its own row's, computed alike in any batch:
    SmolLM2 in bf16 under two adapters gives each request the tokens it gets alone, beside other adapters' requests
    and base ones. (Through the Transformers forward, a mixed step's stacked products round otherwise than a step of
    one adapter.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in chat_prompts[:6]]
    every_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, attn_implementation="paged", dtype=torch.bfloat16)
    loras = []
    for seed, rank in ((0, 8), (1, 4)):
        _save_adapter(copy.deepcopy(model), tmp_path / f"a{seed}", seed, spread=0.02, r=rank, lora_alpha=16,
                      target_modules=every_linear)
        loras.append(LoRARequest(f"a{seed}", seed + 1, str(tmp_path / f"a{seed}")))
    generator = ContinuousBatchGenerator(model, tokenizer, enable_lora=True, max_loras=2, kv_cache_memory=256 << 20,
                                         enable_prefix_caching=False)
    native_steps = adapted_native_steps(generator)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    chosen = [loras[0], loras[1], None, loras[0], None, loras[1]]
    together = generator.run(prompts, params, use_tqdm=False, lora_request=chosen)
    alone = [generator.run([p], params, use_tqdm=False, lora_request=[lora])[0] for p, lora in zip(prompts, chosen)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert native_steps[1:24] == [6] * 23 and len(native_steps) == 24 * 5  # all six together, then four alone


def test_the_server_serves_adapters_by_model_name_as_vllm(smollm2_path, adapters, monkeypatch):
    from hf_paged.server import create_app

    paths, expected = adapters
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    generator = engine(smollm2_path, max_loras=2, max_cpu_loras=8)
    app = create_app(generator, MODEL, lora_modules=[("attn", paths["attn"]), ("all", paths["all"], "org/base")])
    with live_server(app) as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
        cards = {card.id: card for card in client.models.list().data}
        assert list(cards) == [MODEL, "attn", "all"]
        assert cards["attn"].parent == MODEL and cards["attn"].root == paths["attn"] and cards[MODEL].parent is None
        assert cards["all"].parent == "org/base"  # vLLM's base_model_name: what /v1/models names as the parent
        assert client.models.retrieve("all").id == "all"

        def complete(model, prompt=PROMPTS[0]):
            return client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})

        for name in (None, "attn", "all"):
            answer = complete(name or MODEL)
            assert answer.model == (name or MODEL)
            assert answer.choices[0].token_ids == expected[name][0]
        chunks = list(client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, stream=True))
        assert {chunk.model for chunk in chunks} == {"attn"}
        with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
            complete("nope")
        refused = httpx.post(f"{server.base}/v1/embeddings", json={"model": "attn", "input": "hi"})
        assert "LoRA adapters do not apply" in assert_openai_error(refused, 400, "model")["message"]

        def post(path, body):
            return httpx.post(f"{server.base}/v1/{path}", json=body, timeout=30)

        loaded = post("load_lora_adapter", {"lora_name": "mlp", "lora_path": paths["mlp"]})
        assert loaded.status_code == 200 and "'mlp' added" in loaded.text
        assert complete("mlp", PROMPTS[2]).choices[0].token_ids == expected["mlp"][2]
        assert "taken already" in assert_openai_error(post("load_lora_adapter", {"lora_name": "mlp",
                                                                                 "lora_path": paths["mlp"]}),
                                                      400, "lora_name")["message"]
        missing = post("load_lora_adapter", {"lora_name": "gone", "lora_path": "/no/such/adapter"})
        assert "no adapter_config.json" in assert_openai_error(missing, 404, "lora_path")["message"]
        assert post("unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
        assert_openai_error(post("unload_lora_adapter", {"lora_name": "mlp"}), 404, "lora_name")
        with pytest.raises(openai.NotFoundError):
            complete("mlp")
        assert post("load_lora_adapter", {"lora_name": "mlp", "lora_path": paths["mlp"]}).status_code == 200
        ids = generator.list_loras()  # attn 1, all 2, mlp 3 (unloaded): an unloaded adapter's id is not given again
        assert len(ids) == 3 and {1, 2} < ids and 3 not in ids
        replaced = post("load_lora_adapter", {"lora_name": "attn", "lora_path": paths["mlp"], "load_inplace": True})
        assert replaced.status_code == 200 and len(generator.list_loras()) == 3 and 1 not in generator.list_loras()
        assert complete("attn", PROMPTS[2]).choices[0].token_ids == expected["mlp"][2]
        assert complete(MODEL).choices[0].token_ids == expected[None][0]  # the engine served on throughout

        def lora_info():
            lines = httpx.get(f"{server.base}/metrics").text.splitlines()
            return [line.split(" ")[0] for line in lines if line.startswith("hf_paged:lora_requests_info{")]

        assert lora_info() == ['hf_paged:lora_requests_info{max_lora="2",running_lora_adapters="",'
                               'waiting_lora_adapters=""}']
        with client.completions.create(model="all", prompt=PROMPTS[0], max_tokens=1000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}) as stream:
            next(iter(stream))
            assert lora_info() == ['hf_paged:lora_requests_info{max_lora="2",running_lora_adapters="all",'
                                   'waiting_lora_adapters=""}']  # the series of vLLM's, which gateways read


def test_runtime_adapter_routes_are_off_unless_vllms_variable_allows_them(smollm2_path, adapters, monkeypatch):
    from hf_paged.server import create_app

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app = create_app(engine(smollm2_path), MODEL)
    with live_server(app) as server:
        response = httpx.post(f"{server.base}/v1/load_lora_adapter",
                              json={"lora_name": "attn", "lora_path": adapters[0]["attn"]})
        assert response.status_code == 404
    plain = ContinuousBatchGenerator(*tiny_model(smollm2_path), num_blocks=64)
    with pytest.raises(ValueError, match="enable_lora=True"):
        create_app(plain, MODEL, lora_modules=[("attn", adapters[0]["attn"])])


def test_a_layer_that_sees_a_subset_of_a_mixed_steps_tokens_is_an_error_that_names_it(smollm2_path, adapters):
    from hf_paged.lora import LoRAAdapter, LoRAStep

    model, _ = tiny_model(smollm2_path)
    adapter = LoRAAdapter.load(LoRARequest("attn", 1, adapters[0]["attn"]), model, 16)
    step = LoRAStep.of([adapter, None], [3, 2], torch.device("cpu"))
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    with step.applied(model), pytest.raises(RuntimeError, match="q_proj ran on 4 rows of a 5-token step"):
        layer(torch.zeros(1, 4, 64))
    assert not layer._forward_hooks  # removed after the failed forward


def test_cli_lora_modules_are_read_as_vllms(capsys):
    from hf_paged.cli import main
    from hf_paged.server.models import parse_lora_module

    assert parse_lora_module("sql=/adapters/sql") == ("sql", "/adapters/sql", None)
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "m"}') == ("sql", "/a", "m")
    for flags, words in ((["--lora-modules", "sql=/a"], "--lora-modules needs --enable-lora"),
                         (["--enable-lora", "--lora-modules", "sql"], "neither name=path nor a JSON object"),
                         (["--enable-lora", "--lora-modules", '{"name": "sql"}'], "the JSON form is"),
                         (["--enable-lora", "--max-lora-rank", "0"], "max_lora_rank must be a positive integer")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "/no/such/model", *flags])
        assert exit_info.value.code == 2 and words in capsys.readouterr().err, flags


def test_speculation_under_an_adapter_keeps_the_adapters_tokens(smollm2_path, adapters):
    """Prompt lookup's guesses are verified by the model under the request's adapter."""
    paths, expected = adapters
    loras = requests_of(paths)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    generator = engine(smollm2_path, max_loras=3, speculative_config=spec)
    names = ["attn", "mlp", "all", None]
    outputs = generator.run([PROMPTS[2]] * 4, GREEDY, use_tqdm=False, lora_request=[loras.get(n) for n in names])
    assert [o.outputs[0].token_ids for o in outputs] == [expected[n][2] for n in names]
    assert generator.stats().spec_decode_num_draft_tokens > 0


def test_an_adapter_loaded_through_transformers_runs_on_every_request(smollm2_path, adapters):
    """Transformers' own PEFT integration (``model.load_adapter``) wraps the layers: the engine runs them as they
    are."""
    paths, expected = adapters
    model, tokenizer = tiny_model(smollm2_path)
    model.load_adapter(paths["mlp"])
    generator = ContinuousBatchGenerator(model, tokenizer, num_blocks=64)
    outputs = generator.run(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected["mlp"]


def test_stacks_are_kept_for_the_most_recent_sets_of_adapters_only():
    from hf_paged.lora import LoRAStacks

    stacks = LoRAStacks(size=2)
    stacks.of((b"a", b"b"))["layer"] = "kept"
    stacks.of((b"c",))
    assert stacks.of((b"a", b"b")) == {"layer": "kept"}  # used again: the most recent
    stacks.of((b"d",))  # a third set drops the least recent, (c,)
    assert stacks.of((b"a", b"b")) == {"layer": "kept"} and stacks.of((b"c",)) == {}


def test_peft_over_a_paged_model_generates_as_over_sdpa(smollm2_path, adapters):
    """Plain ``generate`` keeps working under PEFT's own wrapper (its LoRA layers around the paged model's)."""
    paths, expected = adapters
    model, _ = tiny_model(smollm2_path)
    adapted = peft.PeftModel.from_pretrained(model, paths["all"])
    assert [_greedy(adapted, p) for p in PROMPTS] == expected["all"]


def test_an_adapter_read_for_another_model_is_refused_by_name(smollm2_path, adapters):
    """An adapter `load_lora` returned is checked against the engine it is given to: one read for an fp32 model does
    not run on a bf16 one (the native decoder would read its fp32 tensors as bf16); its own copy does."""
    paths, _ = adapters
    lora = requests_of(paths)["all"]
    fp32 = engine(smollm2_path)
    adapter = fp32.load_lora(lora)
    model, tokenizer = tiny_model(smollm2_path)
    bf16 = ContinuousBatchGenerator(model.to(torch.bfloat16), tokenizer, num_blocks=64, enable_lora=True)
    with pytest.raises(ValueError, match="adapter 'all' was read for another model"):
        bf16.add_request(PROMPTS[0], GREEDY, lora_request=adapter)
    assert len(bf16.run([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=[lora])[0].outputs[0].token_ids) == 10
    fp32.add_request(PROMPTS[0], GREEDY, lora_request=adapter)  # the engine that read it takes it
    assert fp32.has_unfinished_requests()
