"""GPTQ and AWQ checkpoints (made here by tests/fixtures/quantized.py) through the paged backend and the generator."""

import pytest
import torch

from hf_paged import ContinuousBatchGenerator, SamplingParams
from hf_paged.loading import load_model
from fixtures.quantized import fixture_path

FIXTURES = ["tiny-gptq-g128", "tiny-gptq-g64-act", "tiny-awq-gemm", "smollm2-gptq-g64", "smollm2-awq-gemm"]


@pytest.fixture(scope="module", params=FIXTURES)
def quantized(request, smollm2_path):
    model, tokenizer = load_model(fixture_path(request.param))
    tokenizer.padding_side = "left"
    return request.param, model, tokenizer


def _generate(model, impl, **kwargs):
    model.set_attn_implementation(impl)
    try:
        return model.generate(**kwargs)
    finally:
        model.set_attn_implementation("paged")


def test_quantized_checkpoint_uses_quantized_linears(quantized):
    name, model, _ = quantized
    linear = type(model.model.layers[0].self_attn.q_proj).__name__
    assert linear != "Linear" and ("Awq" in linear) == ("awq" in name)


def test_paged_generate_matches_sdpa(quantized, chat_prompts):
    _, model, tokenizer = quantized
    batch = tokenizer(chat_prompts[:8], return_tensors="pt", padding=True)
    kwargs = dict(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(model.generate(**kwargs), _generate(model, "sdpa", **kwargs))


def test_generator_matches_generate_alone(quantized, chat_prompts):
    _, model, tokenizer = quantized
    prompts = chat_prompts[:8]
    expected = []
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append(out[0, inputs.input_ids.shape[1] :].tolist())
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=128)
    outputs = gen.run(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert gen.kv.pool.num_used_blocks == 0


def test_quantized_smollm2_still_knows_the_capital_of_france(quantized):
    name, model, tokenizer = quantized
    if not name.startswith("smollm2"):
        pytest.skip("random-weight tiny models know no facts; the sanity check is for the real model")
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64)
    out = gen.run([[{"role": "user", "content": "What is the capital of France?"}]],
                  SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
