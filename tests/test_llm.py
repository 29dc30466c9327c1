"""`hf_paged.LLM`: vLLM's offline entry point over the engine, on the embedded SmolLM2."""

import pytest
from transformers import GenerationConfig

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
    inputs = llm.generator.inputs  # what generate(prompts) samples with, as vLLM's: the generation config's settings
    own, inputs.generation_config = inputs.generation_config, GenerationConfig(do_sample=True, temperature=0.6,
                                                                               top_p=0.9, max_new_tokens=7)
    try:
        defaults = llm.get_default_sampling_params()
    finally:
        inputs.generation_config = own
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.6, 0.9, 7)


def test_what_the_engine_refuses_raises_before_anything_runs_as_in_vllm(llm):
    """vLLM's LLM.generate raises for a refused prompt or parameters (code indexing outputs[0].outputs[0] would get
    an IndexError otherwise); the prompts added before it are withdrawn. The generator's run keeps failed outputs."""
    from hf_paged import StructuredOutputsParams

    greedy = SamplingParams(temperature=0, max_tokens=4)
    vocab, generated = llm.generator.vocab_size, llm.generator.stats().generation_tokens
    cases = [(["Hello", "Hi"], [greedy, greedy.replace(stop_token_ids=[vocab + 5])], "stop_token_ids"),
             (["Hello", [vocab + 1]], greedy, "vocabulary"),
             (["Hello", "Hi"], [greedy, greedy.replace(structured_outputs=StructuredOutputsParams(regex="[a-"))],
              "structured_outputs.regex is invalid")]
    for prompts, params, words in cases:  # of several prompts, the one refused is named
        with pytest.raises(ValueError, match=f"^prompt 1: .*{words}") as refused:
            llm.generate(prompts, params, use_tqdm=False)
    assert refused.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="^SamplingParams.structured_outputs.regex is invalid"):
        llm.chat([{"role": "user", "content": "Hi"}], cases[2][1][1], use_tqdm=False)
    bars = []

    def bar(**options):  # vLLM's use_tqdm may be a tqdm-like class
        from tqdm import tqdm

        bars.append(tqdm(**options))
        return bars[-1]

    [alone] = llm.generate(["Hello"], greedy, use_tqdm=bar)  # the withdrawn ones never ran, nor run now
    assert [(b.total, b.n, b.desc) for b in bars] == [(1, 1, "Generating")]
    assert len(alone.outputs[0].token_ids) == 4 and not llm.generator.has_unfinished_requests()
    assert llm.generator.kv_manager.pool.num_used_blocks == 0
    assert llm.generator.stats().generation_tokens == generated + 4
    failed = llm.generator.run(*cases[0][:2], use_tqdm=False)[1]
    assert failed.error is not None and failed.error_param == "stop_token_ids"


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
    # OpenAI's content parts, as vLLM takes them: joined for a template of strings, as parts for one that loops over
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    assert llm.chat(parts, greedy, use_tqdm=False)[0].prompt == tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital\nof France?"}], tokenize=False, add_generation_prompt=True)
    looping = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"
    assert llm.chat(parts, greedy, False, None, looping)[0].prompt == "[What is the capital][of France?]"
    assert llm.chat(question, greedy, False, None, looping, "openai")[0].prompt == "[What is the capital of France?]"
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)
    with pytest.raises(ValueError, match="chat_template_content_format is one of"):
        llm.chat(question, greedy, chat_template_content_format="xml")


def test_sampling_params_take_numpy_numbers_and_clone():
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(16), temperature=np.float32(0.5), stop_token_ids=[np.int32(7)],
                            logit_bias={np.int64(3): np.float64(1.5)})
    assert (params.max_tokens, params.temperature, params.stop_token_ids, params.logit_bias) == (16, 0.5, [7], {3: 1.5})
    assert type(params.max_tokens) is int and type(params.temperature) is float
    with pytest.raises(ValueError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.float32(3.5))
    copied = params.clone()
    copied.stop_token_ids.append(8)
    assert params.stop_token_ids == [7] and copied.max_tokens == 16


def _model_with_its_own_code(root, smollm2_path):
    """A tiny Llama saved as a model type of its own, whose classes come from Python files beside its weights."""
    import json

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(root)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(root)
    (root / "configuration_shout.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass ShoutConfig(LlamaConfig):\n    model_type = 'shout'\n")
    (root / "modeling_shout.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_shout import ShoutConfig\n\n\n"
        "class ShoutForCausalLM(LlamaForCausalLM):\n    config_class = ShoutConfig\n")
    saved = json.loads((root / "config.json").read_text())
    saved.update(model_type="shout", architectures=["ShoutForCausalLM"],
                 auto_map={"AutoConfig": "configuration_shout.ShoutConfig",
                           "AutoModelForCausalLM": "modeling_shout.ShoutForCausalLM"})
    (root / "config.json").write_text(json.dumps(saved))
    return root


def test_a_model_with_its_own_code_runs_only_when_trusted(tmp_path, smollm2_path, capsys):
    from hf_paged.cli import main

    path = str(_model_with_its_own_code(tmp_path / "shout", smollm2_path))
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(path, device="cpu", num_blocks=16)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", path, "Hello", "--max-tokens", "3", "--device", "cpu", "--num-blocks", "16"])
    assert exit_info.value.code == 2 and "(--trust-remote-code runs it)" in capsys.readouterr().err
    trusted = LLM(path, device="cpu", trust_remote_code=True, num_blocks=16)
    assert type(trusted.generator.model).__name__ == "ShoutForCausalLM"
    [output] = trusted.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3
    assert main(["generate", path, "Hello", "--max-tokens", "3", "--device", "cpu", "--num-blocks", "16",
                 "--trust-remote-code"]) == 0


def test_a_tokenizer_other_than_the_models(tmp_path, smollm2_path):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(smollm2_path)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %} =>"
    other.save_pretrained(tmp_path / "tokenizer")
    llm = LLM(smollm2_path, device="cpu", tokenizer=str(tmp_path / "tokenizer"), num_blocks=16)
    [output] = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.prompt == "Hi =>"


def test_chat_on_the_terminal_keeps_the_conversation(smollm2_path, monkeypatch, capsys):
    """``hf-paged chat``: each line a turn, each reply the engine's greedy answer to the whole conversation so far;
    /clear forgets it; a turn the engine refuses is named and left out, and the chat goes on."""
    import io

    from hf_paged.cli import main

    llm = LLM(smollm2_path, device="cpu", num_blocks=64, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=8)

    def answer(*turns: str) -> str:
        messages = [{"role": "system", "content": "Be brief."}]
        for i, turn in enumerate(turns):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
        return llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text

    lines = ["What is the capital of France?", "/clear", "Name a fruit.", "word " * 300, "And a vegetable?", "/exit",
             "never read"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["chat", smollm2_path, "--system", "Be brief.", "--temperature", "0", "--max-tokens", "8",
                 "--num-blocks", "64", "--max-model-len", "256"]) == 0
    out, err = capsys.readouterr()
    first, fruit = answer(lines[0]), answer(lines[2])
    assert out.splitlines() == [first, fruit, answer(lines[2], fruit, lines[4])]
    assert "(the conversation is forgotten)" in err
    assert "hf-paged: error: the prompt is" in err and "(/clear starts the conversation over)" in err


def test_the_chat_says_where_a_reply_was_cut_and_sends_no_mistyped_command(smollm2_path, monkeypatch, capsys):
    """A reply cut at --max-tokens, or where the context ends (after which the next turn fails), says so; a one-word
    line starting with "/" that is no command is not sent to the model."""
    import io

    from hf_paged.cli import main

    def chat(lines: list[str], *options: str):
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
        assert main(["chat", smollm2_path, "--temperature", "0", "--num-blocks", "64", "--max-model-len", "128",
                     *options]) == 0
        return capsys.readouterr()

    out, err = chat(["/exti", "Tell me a story about a dragon."], "--max-tokens", "5")
    assert "(no command /exti)" in err and err.count("(the reply was cut at --max-tokens 5)") == 1  # one reply
    _, err = chat(["Tell me a long story about a dragon.", "And then?"])
    assert "(the reply was cut where the context ends: /clear starts the conversation over)" in err
    assert "hf-paged: error: the prompt is" in err


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(smollm2_path, monkeypatch):
    import io
    import signal

    from hf_paged.terminal import chat_params, converse

    llm = LLM(smollm2_path, device="cpu", num_blocks=64)
    written, raised = io.StringIO(), [signal.SIGINT]

    class Terminal:  # Ctrl+C as the first words of the first reply appear
        def write(self, text: str) -> None:
            if text and not written.getvalue():
                signal.raise_signal(raised[0])
            written.write(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr("sys.stdout", Terminal())
    turns = ["Tell me a long story about a dragon.", "Thanks!"]

    def read(prompt: str) -> str:
        if not turns:
            raise EOFError  # the input ends
        return turns.pop(0)

    assert converse(llm.generator, chat_params(llm.generator, temperature=0, max_tokens=40), read=read) == 0
    stopped, thanks = written.getvalue().splitlines()
    story = llm.chat([{"role": "user", "content": "Tell me a long story about a dragon."}],
                     SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0].text
    assert stopped and story.startswith(stopped) and len(stopped) < len(story)
    after = llm.chat([{"role": "user", "content": "Tell me a long story about a dragon."},
                      {"role": "assistant", "content": stopped}, {"role": "user", "content": "Thanks!"}],
                     SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0].text
    assert thanks == after
    assert llm.generator.stats().num_running == 0
    written.seek(0)
    written.truncate()
    turns[:] = ["Tell me a long story about a dragon.", "Thanks!"]
    raised[0] = signal.SIGTERM  # as a supervisor stops it
    with pytest.raises(SystemExit) as ended:
        converse(llm.generator, chat_params(llm.generator, temperature=0, max_tokens=40), read=read)
    assert ended.value.code == 128 + signal.SIGTERM and written.getvalue().strip() == stopped  # no second turn
    llm.generator.step()  # takes the reply's abort in
    assert llm.generator.stats().num_running == 0


def test_a_cached_hub_copy_and_random_weights_load_as_vllms_llm_takes_them(smollm2_path, smollm2, tmp_path):
    """vLLM's ``revision`` and ``download_dir`` pick a hub id's copy in a local cache (nothing is downloaded), and
    ``load_format="dummy"`` builds the model from its config with random weights; as for ``hf-paged serve``."""
    import dataclasses
    from pathlib import Path

    import torch

    from hf_paged import AsyncEngineArgs, AsyncLLM, EngineArgs

    repo = tmp_path / "models--acme--tiny-chat"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "v1").write_text("1" * 40)
    snapshot = repo / "snapshots" / ("1" * 40)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        if (Path(smollm2_path) / name).exists():
            (snapshot / name).symlink_to(Path(smollm2_path) / name)
    real = smollm2[0].model.embed_tokens.weight
    cached = LLM("acme/tiny-chat", revision="v1", download_dir=tmp_path, dtype="float32", num_blocks=16)
    assert cached.generator.model.name_or_path == str(snapshot)
    assert torch.equal(cached.generator.model.model.embed_tokens.weight, real)
    args = EngineArgs(model="acme/tiny-chat", revision="v1", download_dir=tmp_path, dtype="float32",
                      load_format="dummy", num_blocks=16)
    dummy = LLM(**dataclasses.asdict(args))
    assert not torch.equal(dummy.generator.model.model.embed_tokens.weight, real)
    assert len(dummy.generate(["Hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**dataclasses.asdict(args)))
    engine.shutdown()
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineArgs(load_format="gguf-ish")
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(load_format="gguf-ish")
    with pytest.raises(ValueError, match="at revision v2"):
        LLM("acme/tiny-chat", revision="v2", download_dir=tmp_path)
