"""`model.generate` with attn_implementation="paged" gives the same tokens as Transformers' own attention."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, TextStreamer, pipeline

from hf_paged import PagedCache
from reference import generate_with
from tiny_models import ARCHITECTURES, tiny_model


def _left_padded_batch(seed=0, lengths=(5, 17, 11, 24)):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 256, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask



@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_architectures_greedy_match_reference(arch):
    model, reference = tiny_model(arch)
    ids, mask = _left_padded_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    expected = generate_with(model, reference, **kwargs)
    got = model.generate(**kwargs)
    assert torch.equal(got, expected)
    # One by one as well (no padding at all).
    for row in range(ids.shape[0]):
        single = ids[row : row + 1, mask[row].bool()]
        one = dict(input_ids=single, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(**one), generate_with(model, reference, **one))


def test_attention_sinks_are_served_token_identically_in_batches_and_chunks(smollm2_path):
    """gpt-oss's attention sinks through the engine (decodes and prompt chunks in one step, windows shorter than the
    prompts) give the tokens of Transformers' eager attention, one prompt at a time."""
    from transformers import AutoTokenizer

    from hf_paged import ContinuousBatchGenerator, SamplingParams

    model, reference = tiny_model("gpt_oss")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)  # the tiny models' 256 ids are its first 256 tokens
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 30, 12)]
    expected = []
    for prompt in prompts:
        out = generate_with(model, reference, input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    engine = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    outputs = engine.run(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_sliding_window_is_shorter_than_the_sequence():
    model, _ = tiny_model("mistral")
    ids, _ = _left_padded_batch(lengths=(30,))
    assert model.config.sliding_window < ids.shape[1]
    kwargs = dict(input_ids=ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**kwargs), generate_with(model, "sdpa", **kwargs))


def test_smollm2_chat_prompts_one_by_one_and_batched(smollm2, chat_prompts):
    model, tokenizer = smollm2
    prompts = chat_prompts[:8]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert len(set(batch.attention_mask.sum(1).tolist())) > 1, "prompts must have mixed lengths"
    kwargs = dict(**batch, max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(**kwargs), generate_with(model, "sdpa", **kwargs))
    for prompt in prompts:
        one = dict(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=16, do_sample=False)
        assert torch.equal(model.generate(**one), generate_with(model, "sdpa", **one))


def test_smollm2_answers_a_question(smollm2, chat_prompts):
    model, tokenizer = smollm2
    inputs = tokenizer(chat_prompts[0], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs.input_ids.shape[1] :])


def test_seeded_sampling_matches_reference():
    model, _ = tiny_model("llama")
    ids, mask = _left_padded_batch(seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=20, temperature=0.8,
                  pad_token_id=0)
    torch.manual_seed(1234)
    expected = generate_with(model, "sdpa", **kwargs)
    torch.manual_seed(1234)
    assert torch.equal(model.generate(**kwargs), expected)


def test_beam_search_matches_reference_and_frees_blocks():
    model, _ = tiny_model("qwen2")
    ids, mask = _left_padded_batch(seed=5, lengths=(7, 19))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, num_beams=3, do_sample=False, pad_token_id=0)
    expected = generate_with(model, "sdpa", **kwargs)
    cache = PagedCache(model.config, num_blocks=64, block_size=8)
    assert torch.equal(model.generate(**kwargs, cache=cache), expected)
    cache.reset()
    assert cache.pool.num_used_blocks == 0
    assert all(count == 0 for count in cache.pool.ref_counts)


def test_explicit_cache_block_accounting():
    model, _ = tiny_model("llama")
    ids, mask = _left_padded_batch(seed=7)
    cache = PagedCache(model.config, num_blocks=40, block_size=8)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                         cache=cache)
    # Every row holds exactly its real tokens (prompt without padding + generated, but the last token is not yet
    # written): ceil(len / block_size) blocks each, nothing more.
    lengths = [int(m.sum()) + 10 - 1 for m in mask]
    assert cache.pool.num_used_blocks == sum(-(-n // 8) for n in lengths)
    assert [len(cache.rows.block_table(r)) for r in range(len(lengths))] == [-(-n // 8) for n in lengths]
    assert out.shape[1] == ids.shape[1] + 10
    cache.reset()
    assert cache.pool.num_used_blocks == 0 and cache.pool.num_free_blocks == 40


def test_cache_too_small_raises_no_free_blocks():
    from hf_paged import NoFreeBlocksError

    model, _ = tiny_model("llama")
    ids, mask = _left_padded_batch()
    cache = PagedCache(model.config, num_blocks=3, block_size=8)
    with pytest.raises(NoFreeBlocksError):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, cache=cache)


def test_an_update_whose_cache_never_reaches_attention_is_refused():
    """A model that changed its keys between `cache.update` and attention would attend without the cache."""
    model, _ = tiny_model("gpt_neox")
    cache = PagedCache(model.config, num_blocks=8, block_size=8)
    keys = torch.zeros(1, 4, 3, 16)
    cache.update(keys, keys, 0)
    with pytest.raises(TypeError, match="layer 0's attention did not receive the PagedCache"):
        cache.update(keys.clone(), keys, 1)


def _deepseek_v3(v_head_dim):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                            q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=v_head_dim,
                            vocab_size=256, pad_token_id=0)


def test_models_the_backend_cannot_serve_are_refused_when_built():
    from transformers import BloomConfig, MptConfig

    for config, name in [(BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=256), "BloomForCausalLM"),
                         (MptConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=256), "MptForCausalLM")]:
        with pytest.raises(NotImplementedError, match=f"{name} computes its attention itself"):
            AutoModelForCausalLM.from_config(config, attn_implementation="paged")
    with pytest.raises(NotImplementedError, match="keys of 24 and values of 12 numbers per head"):
        AutoModelForCausalLM.from_config(_deepseek_v3(v_head_dim=12), attn_implementation="paged")
    model = AutoModelForCausalLM.from_config(_deepseek_v3(v_head_dim=12))
    with pytest.raises(NotImplementedError, match="multi-head latent attention"):
        model.set_attn_implementation("paged")


def test_a_model_whose_layers_differ_in_head_size_is_refused_when_built():
    """Gemma 4's full-attention layers have wider heads than its sliding ones (512 and 256 in its checkpoints;
    Transformers' per_layer_config): an ambiguous per-layer attribute inside Transformers before."""
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    with pytest.raises(NotImplementedError, match="layers differ in the shape of their keys and values"):
        AutoModelForCausalLM.from_config(config, attn_implementation="paged")


@pytest.mark.parametrize("model_type, extra, words", [
    ("doge", {}, "a mask that it computes from the input"),
    ("llama4_text", {"intermediate_size_mlp": 128, "attention_chunk_size": 64}, r"\['chunked_attention'\] layers"),
    ("hy_v4", {}, r"\['indexed_attention'\] layers"),
])
def test_models_whose_attention_no_kernel_computes_are_refused_when_built(model_type, extra, words):
    """Each failed inside Transformers' own code (a mask indexed as 4-D, a missing cache), or only at the first
    forward."""
    with pytest.raises(NotImplementedError, match=words):
        AutoModelForCausalLM.from_config(_small(model_type, **extra), attn_implementation="paged")


def test_a_multimodal_model_builds_when_an_encoder_config_has_heads_but_no_layers():
    """Phi-4-multimodal's audio encoder config has attention heads and no num_hidden_layers: the build-time check of
    the keys' shape is for decoders (an AttributeError refused the whole model)."""
    model = AutoModelForCausalLM.from_config(_small("phi4_multimodal"), attn_implementation="paged").eval()
    out = model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


def test_a_model_whose_layers_project_keys_of_different_shapes_is_refused():
    """MiMo-V2-Flash's sliding layers have twice the KV heads of its full ones: refused by the cache, which holds one
    shape (a first forward blamed JetMoe before)."""
    from hf_paged.cache import KVCacheSpec

    config = _small("mimo_v2_flash", v_head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged")
    with pytest.raises(NotImplementedError, match="layers differ in the shape of their keys"):
        KVCacheSpec.from_model(model)
    with pytest.raises(NotImplementedError, match="layers differ in the shape of their keys"):
        model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_latent_attention_with_one_head_size_matches_reference():
    """DeepSeek-V3's keys are 16 + 8 numbers per head (its config's head_dim says 8); values of 24 fit the blocks."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_deepseek_v3(v_head_dim=24), attn_implementation="paged").eval()
    ids, mask = _left_padded_batch(seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**kwargs), generate_with(model, "sdpa", **kwargs))


def test_continuing_from_a_returned_cache_matches_a_fresh_run():
    """The multi-turn pattern: generate, append the next turn, generate again from ``out.cache``. The cache
    ``generate`` made itself grows past the size it was given for the first call."""
    model, _ = tiny_model("llama")
    first = model.generate(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=10, do_sample=False,
                           pad_token_id=0, return_dict_in_generate=True)
    assert first.cache.num_blocks == 2
    turn = torch.cat([first.sequences, torch.tensor([[11, 12, 13]])], dim=1)
    kwargs = dict(input_ids=turn, max_new_tokens=40, do_sample=False, pad_token_id=0)
    again = model.generate(**kwargs, cache=first.cache)
    assert torch.equal(again, generate_with(model, "sdpa", **kwargs))
    assert first.cache.num_blocks > 2 and first.cache.pool.num_used_blocks == -(-(again.shape[1] - 1) // 16)


def test_a_hybrid_model_generates_with_transformers_cache_and_the_engine_refuses_it(smollm2):
    """LFM2 mixes convolution layers (with their own states) into its attention layers: `generate` keeps
    Transformers' cache for it, and a PagedCache or the engine refuses it by name."""
    from transformers import Lfm2Config

    from hf_paged import ContinuousBatchGenerator

    config = Lfm2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=512, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, layer_types=["conv", "full_attention"] * 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged", dtype=torch.float32).eval()
    kwargs = dict(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**kwargs), generate_with(model, "eager", **kwargs))
    with pytest.raises(NotImplementedError, match=r"\['conv'\] layers"):
        PagedCache(config, num_blocks=4)
    with pytest.raises(NotImplementedError, match="hybrid models"):
        ContinuousBatchGenerator(model, smollm2[1], num_blocks=4)


def test_the_engine_refuses_what_it_would_serve_wrong_and_serves_llama4_tuning_below_its_floor(smollm2):
    """Mamba has no attention to page (an AttributeError before). Llama 4's attention temperature tuning counts
    positions from a cache the engine does not pass, so it is exact only below ``floor_scale``: refused past it
    (wrong tokens before), token-equal to `generate` below."""
    from hf_paged import ContinuousBatchGenerator, SamplingParams

    tokenizer = smollm2[1]
    mamba = AutoModelForCausalLM.from_config(_small("mamba"), attn_implementation="paged")
    with pytest.raises(NotImplementedError, match="mamba has no attention heads"):
        ContinuousBatchGenerator(mamba, tokenizer, num_blocks=8)
    config = _small("llama4_text", intermediate_size_mlp=128, attention_chunk_size=None, no_rope_layers=[1, 0],
                    attn_temperature_tuning=True, floor_scale=16, attn_scale=0.5, interleave_moe_layer_step=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
    with pytest.raises(NotImplementedError, match=r"floor_scale \(16\): set max_model_len and max_num_batched"):
        ContinuousBatchGenerator(model, tokenizer, num_blocks=16, block_size=4)
    prompt = [17, 93, 41, 200, 8, 77]
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=16, block_size=4, max_model_len=15,
                                   max_num_batched_tokens=15)
    [out] = gen.run([prompt], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    ids = torch.tensor([prompt])
    expected = generate_with(model, "sdpa", input_ids=ids, max_new_tokens=9, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_a_large_max_length_does_not_reserve_its_worst_case():
    """The cache `generate` builds starts at INITIAL_TOKENS_PER_ROW tokens per row and doubles as it fills."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from hf_paged.integration import INITIAL_TOKENS_PER_ROW

    class AtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 600, dtype=torch.bool)

    model, _ = tiny_model("llama")
    ids, mask = _left_padded_batch(lengths=(9, 5))
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, max_length=100_000,
                  stopping_criteria=StoppingCriteriaList([AtLength()]))
    out = model.generate(**kwargs, return_dict_in_generate=True)
    assert out.sequences.shape[1] == 600
    initial = 2 * (INITIAL_TOKENS_PER_ROW // 16 + 1)
    assert initial < out.cache.num_blocks <= 4 * initial  # grew past the start, far from 100k tokens per row
    assert torch.equal(out.sequences, generate_with(model, "sdpa", **kwargs))


def test_continuing_with_a_mask_the_cache_does_not_match_is_refused():
    """Padding is never stored, so a continuation whose mask marks other cached tokens as real (or as padding)
    cannot be computed as sdpa would: refused instead of answered differently."""
    model, _ = tiny_model("llama")
    ids, mask = _left_padded_batch(lengths=(9, 5))
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True)
    turn = torch.cat([first.sequences, torch.tensor([[11, 12], [13, 14]])], dim=1)
    full = torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], dim=1)
    hole = full.clone()
    hole[0, 2] = 0  # a prompt token the cache holds, now marked as padding
    for bad in (hole, torch.ones_like(full)):  # all ones: the padding of row 1 as real tokens
        with pytest.raises(ValueError, match="cached tokens per row as real"):
            model.generate(input_ids=turn, attention_mask=bad, max_new_tokens=2, do_sample=False, pad_token_id=0,
                           cache=first.cache)


def test_a_paged_assistant_model_matches_plain_greedy():
    model, _ = tiny_model("llama")
    assistant, _ = tiny_model("qwen2")
    kwargs = dict(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=60, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**kwargs, assistant_model=assistant), generate_with(model, "sdpa", **kwargs))


def test_other_cache_implementations_are_refused():
    model, _ = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="cache_implementation='static'"):
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=3, cache_implementation="static",
                       pad_token_id=0)
    from transformers import DynamicCache, StaticCache

    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(NotImplementedError, match="StaticCache"):
        model.generate(input_ids=ids, max_new_tokens=3, pad_token_id=0,
                       cache=StaticCache(config=model.config, max_cache_len=32))
    # A DynamicCache holds exactly the past tokens, which the plain attention path reads.
    kwargs = dict(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**kwargs, cache=DynamicCache(config=model.config)),
                       generate_with(model, "sdpa", **kwargs))


def test_text_streamer_streams_the_same_text(smollm2, chat_prompts, capsys):
    model, tokenizer = smollm2
    inputs = tokenizer(chat_prompts[2], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False,
                         streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True).strip()


def test_pipeline_batched(smollm2):
    model, tokenizer = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    messages = [[{"role": "user", "content": "What is the capital of France?"}],
                [{"role": "user", "content": "Name the largest planet in the solar system."}],
                [{"role": "user", "content": "Who wrote Romeo and Juliet?"}]]
    outputs = pipe(messages, max_new_tokens=16, do_sample=False, batch_size=3)
    answers = [o[0]["generated_text"][-1]["content"] for o in outputs]
    assert "Paris" in answers[0]
    model.set_attn_implementation("sdpa")
    try:
        reference = pipe(messages, max_new_tokens=16, do_sample=False, batch_size=3)
    finally:
        model.set_attn_implementation("paged")
    assert answers == [o[0]["generated_text"][-1]["content"] for o in reference]


def test_forward_without_cache_matches_reference():
    model, _ = tiny_model("gemma2")
    ids, mask = _left_padded_batch()
    paged = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    model.set_attn_implementation("eager")
    reference = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(paged[real], reference[real], rtol=1e-4, atol=1e-4)


def test_unsupported_feature_is_named():
    from hf_paged.attention import paged_attention_forward

    module = torch.nn.Module()
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="an additive position bias"):
        paged_attention_forward(module, q, q, q, None, position_bias=torch.zeros(2))
    model, _ = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, output_attentions=True,
                       return_dict_in_generate=True, pad_token_id=0)


def _small(model_type: str, **extra):
    """A tiny config of ``model_type`` from the fields it knows of a common small shape."""
    from transformers import CONFIG_MAPPING

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                 num_local_experts=2, num_experts_per_tok=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config_class = CONFIG_MAPPING[model_type]
    known = config_class()
    return config_class(**{k: v for k, v in {**shape, **extra}.items() if hasattr(known, k)})


@pytest.mark.parametrize("model_type, extra, words", [
    ("diffllama", {}, "layer 0's attention ran twice in one forward"),  # two attention calls a layer (two value sets)
    ("hrm_text", {}, "layer 0's attention ran twice in one forward"),  # one module attends for several cache layers
    ("inkling_text", {}, "an additive position bias"),
    # It repeats its keys per expert after cache.update: 2 KV heads cached, 4 attended.
    ("jetmoe", {"num_local_experts": 4, "num_experts_per_tok": 2}, "gets other keys than its config describes"),
])
def test_models_whose_attention_the_blocks_cannot_hold_are_refused_at_the_first_forward(model_type, extra, words):
    """Each gave wrong tokens without a word (the first three) or a bare shape error (JetMoe)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_small(model_type, **extra), attn_implementation="paged").eval()
    with pytest.raises((NotImplementedError, ValueError), match=words):
        model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_a_paged_cache_under_another_attention_is_refused():
    """After ``set_attn_implementation("sdpa")`` the model's attention would read only the new keys a PagedCache
    hands on: wrong tokens on a one-layer model, a misleading error on others."""
    model, _ = tiny_model("llama")
    first = model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False,
                           pad_token_id=0, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="a PagedCache is read only by attn_implementation='paged'.*'sdpa'"):
        model.generate(first.sequences, cache=first.cache, max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_gradients_flow_without_a_cache_and_are_refused_through_one():
    """Training-style forwards (no cache) give eager's gradients, softcapping included; a forward through a
    PagedCache gives the right logits but refuses backward (its kernels read keys back from the blocks, outside
    autograd: the gradients came out silently wrong, and the blocks joined the graph)."""
    model, reference = tiny_model("gemma2")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def grads(implementation):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    expected, got = grads(reference), grads("paged")
    assert got.keys() == expected.keys() and all(torch.allclose(got[k], expected[k], atol=1e-5) for k in got)
    cache = PagedCache(model.config, num_blocks=8, block_size=4)
    out = model(ids, labels=ids, cache=cache)
    model.set_attn_implementation(reference)
    torch.testing.assert_close(out.logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    assert not any(k.requires_grad for k in cache.key_cache)
    with pytest.raises(NotImplementedError, match="no gradients flow through the paged KV cache"):
        out.loss.backward()


def test_mask_patterns_other_than_causal_are_refused():
    from transformers import masking_utils as masks

    from hf_paged.attention import is_causal_pattern

    assert is_causal_pattern(masks.causal_mask_function)
    assert is_causal_pattern(masks.sliding_window_causal_mask_function(4))
    assert not is_causal_pattern(masks.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)))
    assert not is_causal_pattern(masks.or_masks(masks.causal_mask_function, masks.bidirectional_mask_function))
    packed = masks.packed_sequence_mask_function(torch.zeros(1, 4, dtype=torch.long))
    assert not is_causal_pattern(masks.and_masks(masks.causal_mask_function, packed))
    # A plain forward over packed sequences (positions restart, no attention mask) is refused, not run causally.
    model, _ = tiny_model("llama")
    with pytest.raises(NotImplementedError, match="mask pattern"):
        model(input_ids=torch.arange(5, 13)[None], position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
              use_cache=False)


def test_assisted_decoding_crops_the_cache():
    """Prompt-lookup decoding proposes tokens, then rolls the cache back with `crop` when they are rejected."""
    model, _ = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6, 7]])
    kwargs = dict(input_ids=ids, max_new_tokens=20, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)
    cache = PagedCache(model.config, num_blocks=16, block_size=4)
    crops = []
    original_crop = cache.crop
    cache.crop = lambda n: (crops.append(n), original_crop(n))
    got = model.generate(**kwargs, cache=cache)
    assert torch.equal(got, generate_with(model, "sdpa", **kwargs))
    assert any(n < 0 for n in crops), "no candidate was rejected: the test does not exercise crop"
    assert cache.pool.num_used_blocks == -(-(got.shape[1] - 1) // 4)


def test_kv_shared_layers_hold_no_blocks():
    """Gemma3n's last layers reuse earlier layers' keys and values: the cache holds blocks for the others only."""
    model, reference = tiny_model("gemma3n")
    kwargs = dict(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]), max_new_tokens=10, do_sample=False,
                  pad_token_id=0)
    out = model.generate(**kwargs, return_dict_in_generate=True)
    assert torch.equal(out.sequences, generate_with(model, reference, **kwargs))
    assert model.config.num_hidden_layers == 4 and len(out.cache.key_cache) == len(out.cache.value_cache) == 2
    assert out.cache.spec.bytes_per_block(16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4


def test_a_damaged_default_model_copy_is_rebuilt(tmp_path, monkeypatch):
    """Conversions are staged and renamed into place, so a copy missing a file was damaged by hand: rebuild it."""

    import hf_paged.default_model as default_model

    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path))
    target = tmp_path / default_model.DEFAULT_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")  # no weights
    (target / "stale").write_text("x")
    built = []

    def fake_convert(gguf, out):
        out.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("ok")
        built.append(out)

    monkeypatch.setattr(default_model, "_convert", fake_convert)
    monkeypatch.setattr(default_model, "_gguf_file", lambda: Path("model.gguf"))
    assert default_model.resolve_model(Path("smollm2")) == str(target) and built == [target]
    assert not (target / "stale").exists()
    assert default_model.default_model_path() == str(target) and len(built) == 1  # complete now: kept


def test_a_gguf_file_is_converted_once_as_the_default_model_is(smollm2_path, tmp_path, monkeypatch):
    """llama.cpp's users have GGUF files: a .gguf path (or a directory holding just one) loads as the embedded
    default model does, converted once into the cache, keyed by the file."""
    import hashlib
    import shutil

    import hf_paged.default_model as default_model

    monkeypatch.setattr(default_model, "cache_root", lambda: tmp_path / "cache")
    gguf = tmp_path / "models" / "smol.gguf"
    gguf.parent.mkdir()
    shutil.copy(default_model._gguf_file(), gguf)
    converted = Path(default_model.resolve_model(str(gguf)))
    assert converted.parent == tmp_path / "cache" / "gguf" and converted.name.startswith("smol-")

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in ("model.safetensors", "tokenizer.json", "config.json"):  # what the default model's copy holds
        assert digest(converted / name) == digest(Path(smollm2_path) / name), name
    monkeypatch.setattr(default_model, "_convert", lambda *args: pytest.fail("converted twice"))
    assert default_model.resolve_model(gguf.parent) == str(converted)  # its directory, no config.json beside it
    shutil.copy(gguf, gguf.parent / "other.gguf")
    with pytest.raises(ValueError, match="2 GGUF files: give one of them"):
        default_model.resolve_model(gguf.parent)
    (gguf.parent / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.undo()
    monkeypatch.setattr(default_model, "cache_root", lambda: tmp_path / "cache")
    with pytest.raises(ValueError, match="cannot convert .*broken.gguf"):
        default_model.resolve_model(gguf.parent / "broken.gguf")


@pytest.mark.parametrize("arch, window", [("llama", None), ("mistral", 8), ("qwen2_moe", 6)])
def test_transformers_hands_the_paged_backend_its_mask_and_window(arch, window, monkeypatch):
    """Canary for a Transformers upgrade: the paged mask function must keep receiving the causal pattern (by its
    `mask_function`) and the sliding window (as `local_size`), and the attention function the window it applies."""
    import hf_paged.attention as attention

    seen_masks, seen_windows = [], []
    real_mask, real_kernel = attention.padding_mask, attention.paged_attention

    def recording_mask(*args, **kwargs):
        seen_masks.append((attention.is_causal_pattern(kwargs["mask_function"]), kwargs.get("local_size")))
        return real_mask(*args, **kwargs)

    def recording_kernel(*args):
        seen_windows.append(args[7])
        return real_kernel(*args)

    from transformers.masking_utils import AttentionMaskInterface

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "paged", recording_mask)
    monkeypatch.setattr(attention, "paged_attention", recording_kernel)
    model, _ = tiny_model(arch)
    model.generate(torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]), max_new_tokens=2, do_sample=False)
    assert seen_masks and all(causal for causal, _ in seen_masks)
    assert {size for _, size in seen_masks} <= {None, window} and (window is None or window in seen_windows)
    assert set(seen_windows) <= {None, window}


def test_the_engine_serves_a_model_in_training_mode_as_in_eval_and_leaves_it_as_it_was(smollm2):
    """GPT-2 has dropout on its embeddings, attention and residuals: a model trained between engine runs (an RL loop)
    gets eval()'s tokens, and every module keeps its own mode. A refused engine leaves the attention as it was."""
    from hf_paged import ContinuousBatchGenerator, SamplingParams

    tokenizer = smollm2[1]
    model = tiny_model("gpt2", "sdpa")[0]
    prompt = [17, 93, 41, 200, 8, 77]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    with pytest.raises(ValueError, match="max_model_len"):
        ContinuousBatchGenerator(model, tokenizer, num_blocks=16, block_size=4, max_model_len=10**6)
    assert model.config._attn_implementation == "sdpa"
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=16, block_size=4)
    model.train()
    model.transformer.h[1].eval()  # a module the caller keeps in eval mode
    modes = [m.training for m in model.modules()]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = [gen.run([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    assert runs == [expected, expected]
    assert [m.training for m in model.modules()] == modes


def test_dummy_weights_are_built_from_the_config_and_served(smollm2_path, tmp_path):
    """vLLM's --load-format dummy: the architecture and dtype of the checkpoint, random weights, none read."""
    from hf_paged import ContinuousBatchGenerator, SamplingParams
    from hf_paged.loading import load_model

    real, _ = load_model(smollm2_path)
    model, tokenizer = load_model(smollm2_path, dtype="bfloat16", load_format="dummy")
    assert type(model) is type(real) and model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "paged"
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight.float(), real.model.layers[0].mlp.up_proj.weight)
    assert load_model(smollm2_path, load_format="dummy")[0].dtype == torch.float32  # "auto": the config's
    assert model.generation_config.to_diff_dict() == real.generation_config.to_diff_dict()  # the directory's
    (out,) = ContinuousBatchGenerator(model, tokenizer, num_blocks=16).run(
        ["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="built on one process"):
        load_model(smollm2_path, load_format="dummy", tensor_parallel_size=2)
    (tmp_path / "quantized").mkdir()
    config = json.loads((Path(smollm2_path) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "quantized" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not quantized: this checkpoint is"):
        load_model(tmp_path / "quantized", load_format="dummy", tokenizer=smollm2_path)
