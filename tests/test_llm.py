"""`hf_paged.LLM`: vLLM's offline entry point over the engine, on the embedded SmolLM2."""

import pytest

from hf_paged import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", num_blocks=256)


def test_generate_is_the_engines_run_and_takes_vllms_prompt_forms(llm, smollm2, chat_prompts):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    model, tokenizer = smollm2
    ids = tokenizer(chat_prompts[0], return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    outputs = llm.generate([chat_prompts[0], {"prompt_token_ids": ids[0].tolist()}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected, expected]
    assert llm.get_tokenizer() is llm.generator.tokenizer and llm.reset_prefix_cache()


def test_chat_renders_one_or_many_conversations_with_vllms_options(llm):
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=6)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    [alone] = llm.chat(question, greedy, use_tqdm=False)
    assert alone.prompt == text
    assert alone.outputs[0].token_ids == llm.generate([text], greedy, use_tqdm=False)[0].outputs[0].token_ids
    started = question + [{"role": "assistant", "content": "The capital of France is"}]
    both = llm.chat([question, started], greedy, use_tqdm=False, add_generation_prompt=False,
                    continue_final_message=True)
    assert both[1].prompt.endswith("The capital of France is") and both[1].outputs[0].text.strip()
    assert both[0].prompt.endswith("capital of France?")  # the user's turn continued, not an assistant's opened
    with pytest.raises(ValueError, match="set add_generation_prompt=False"):
        llm.chat(started, greedy, continue_final_message=True)
    with pytest.raises(ValueError, match="tokenize cannot be set"):
        llm.chat(question, greedy, chat_template_kwargs={"tokenize": True})
    [plain] = llm.chat(question, greedy, use_tqdm=False, chat_template="{{ messages[0]['content'] }} Paris is")
    assert plain.prompt == "What is the capital of France? Paris is"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    [called] = llm.chat(question, greedy, use_tqdm=False, tools=tools)
    assert "get_weather" in called.prompt
