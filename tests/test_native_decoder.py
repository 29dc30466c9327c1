"""The native CPU decoder (``hf_paged/native_decoder.py``, ``kernels/cpu_decoder.cpp``) against the Transformers
forward it stands in for: the same tokens and logprobs, what it recognises, and its matrix-vector kernel."""

import ctypes
import subprocess

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hf_paged import ContinuousBatchGenerator, SamplingParams
from hf_paged.cache import PagedMetadata
from hf_paged.kernels import cpu_decoder, native
from hf_paged.native_decoder import NativeDecoder
from tiny_models import ARCHITECTURES, COMMON, tiny_model

# Without a C++ compiler there is no native decoder and every step runs the Transformers forward (tested elsewhere).
pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler: hf_paged has no native kernels")

NATIVE = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    """SmolLM2's tokenizer: the tiny models' 256 ids are its first 256 tokens."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def tiny(arch: str, dtype=torch.float32) -> nn.Module:
    if arch != "qwen2":
        return tiny_model(arch)[0].to(dtype)
    from transformers import AutoModelForCausalLM, Qwen2Config

    # Biases on q, k and v; its second layer slides (window 6), its first does not.
    config = Qwen2Config(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=128,
                         use_sliding_window=True, sliding_window=6, max_window_layers=1, **COMMON)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="paged", dtype=dtype).eval()


PROMPTS = [[5, 9, 13, 200, 31, 7, 77, 3, 18, 90, 41, 12], [8, 100, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


def generate(model, tokenizer, enforce_eager: bool, logprobs: int | None = None, max_tokens: int = 24, **options):
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, block_size=4, enforce_eager=enforce_eager,
                                   **options)
    assert (gen.runner.native is not None) == (not enforce_eager)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return gen.run(PROMPTS, params, use_tqdm=False)


@pytest.mark.parametrize("arch", NATIVE)
def test_native_steps_give_the_transformers_forwards_tokens_and_logprobs(arch, tokenizer):
    """Three sequences past the sliding windows (Mistral 8, Qwen2 6), with prompts of 3-12 tokens: every step is
    native (up to 64 tokens; longer ones are tested below)."""
    eager = generate(tiny(arch), tokenizer, enforce_eager=True, logprobs=3)
    fast = generate(tiny(arch), tokenizer, enforce_eager=False, logprobs=3)
    for a, b in zip(eager, fast):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            assert torch.allclose(torch.tensor(list(step_a.values())), torch.tensor(list(step_b.values())),
                                  atol=1e-4)


def record_steps(gen) -> tuple[list[int], list[int]]:
    """The token counts of the steps ``gen`` runs natively and through the Transformers forward, as they run."""
    native_steps, forward_steps = [], []
    native_forward, forward = gen.runner.native.forward, gen.runner.forward

    def native(ids, *rest, **options):
        native_steps.append(ids.shape[1])
        return native_forward(ids, *rest, **options)

    gen.runner.native.forward = native
    gen.runner.forward = lambda step: forward_steps.append(step.num_tokens) or forward(step)
    return native_steps, forward_steps


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_steps_of_more_than_one_pass_of_rows_are_native_and_give_the_same_tokens(arch, tokenizer):
    """Ten prompts of 3-90 tokens prefill in one native step of 284 tokens (each weight panel multiplied by 8 rows
    a pass, 36 passes), then decode together (8 rows, then 2 more)."""
    torch.manual_seed(1)
    prompts = [torch.randint(3, 250, (n,)).tolist() for n in (3, 9, 17, 30, 5, 70, 12, 8, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = []
    for enforce_eager in (True, False):
        gen = ContinuousBatchGenerator(tiny(arch), tokenizer, num_blocks=512, block_size=4,
                                       enforce_eager=enforce_eager)
        if not enforce_eager:
            gen.runner.native.max_tokens = cpu_decoder.MAX_TOKENS  # the decoder's reach, whatever this CPU's limit
            native_steps, forward_steps = record_steps(gen)
        outs.append(gen.run(prompts, params, use_tqdm=False))
    assert native_steps[0] == 284 and 10 in native_steps and not forward_steps
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert torch.allclose(torch.tensor(list(step_a.values())), torch.tensor(list(step_b.values())),
                                  atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_longer_than_the_decoders_run_the_transformers_forward(dtype, tokenizer):
    """Steps of up to 512 tokens (`cpu_decoder.MAX_TOKENS`) can run natively, prompts included; longer ones (asked
    for with ``max_num_batched_tokens``) run the Transformers forward, and the decode steps after them are native
    again. By default, where the decoder is the faster for steps of all the sizes it takes (all but fp32 on AVX2 alone),
    a model's steps are no longer than it takes: all of them run natively."""
    torch.manual_seed(2)
    steps = {}
    for lengths, budget in (((3, 9, 17, 30, 5, 70, 12, 8, 40, 90), 2048), ((200, 150, 170), 2048),
                            ((200, 150, 170), None)):  # first steps of 284 and 520 tokens
        prompts = [torch.randint(3, 250, (n,)).tolist() for n in lengths]
        gen = ContinuousBatchGenerator(tiny("llama", dtype), tokenizer, num_blocks=512, block_size=4,
                                       max_num_batched_tokens=budget)
        assert gen.runner.native.max_tokens == cpu_decoder.faster_tokens(dtype) in (160, 512)
        native_steps_only = gen.runner.native.takes_whole_steps
        assert native_steps_only == (cpu_decoder.faster_tokens(dtype) == 512)
        assert gen.config.max_num_batched_tokens == (budget or (512 if native_steps_only else 2048))
        gen.runner.native.max_tokens = cpu_decoder.MAX_TOKENS
        native_steps, forward_steps = record_steps(gen)
        outputs = gen.run(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        steps[sum(lengths), budget] = native_steps, forward_steps, [o.outputs[0].token_ids for o in outputs]
    assert cpu_decoder.MAX_TOKENS == 512
    # The prompts' step, then three decode steps of every sequence.
    assert steps[284, 2048][:2] == ([284] + [10] * 3, [])
    assert steps[520, 2048][:2] == ([3] * 3, [520])
    # Never below max_num_seqs: a step decodes every running sequence.
    wide = ContinuousBatchGenerator(tiny("llama", dtype), tokenizer, num_blocks=64, block_size=4, max_num_seqs=600)
    assert wide.config.max_num_batched_tokens == (600 if native_steps_only else 2048)
    if native_steps_only:  # the first two prompts and the third's first 162 tokens, then its 8 more beside two decodes
        assert steps[520, None][:2] == ([512, 8 + 2, 3, 3, 1], [])
        assert steps[520, None][2] == steps[520, 2048][2]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_native_steps_round_like_transformers(arch, tokenizer):
    """bf16 rounds every elementwise step as Transformers does; only the products' summation order differs, so the
    logprobs agree to bf16's precision."""
    eager = generate(tiny(arch, torch.bfloat16), tokenizer, enforce_eager=True, logprobs=1, max_tokens=8)
    fast = generate(tiny(arch, torch.bfloat16), tokenizer, enforce_eager=False, logprobs=1, max_tokens=8)
    for a, b in zip(eager, fast):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert first_a.keys() == first_b.keys()  # the first step has no earlier difference to inherit
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 0.05 * len(
            a.outputs[0].token_ids)


def _cpu_flags() -> set[str]:
    try:
        line = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


@pytest.fixture(scope="module")
def avx2_library(tmp_path_factory):
    """The native library built for AVX2 without AVX-512 (``-march=haswell``), whatever this CPU has beyond that:
    the kernels blocked for AVX2's 16 registers run here too, not only on the CPUs whose own build picks them."""
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("an AVX2 build cannot run on this CPU")
    out, compiler, objects = tmp_path_factory.mktemp("avx2"), native.compiler(), []
    for source, flags in native.SOURCES.items():
        objects.append(str(out / f"{source.stem}.o"))
        subprocess.run([compiler, *flags, "-march=haswell", f"-I{source.parent}", "-c", str(source), "-o",
                        objects[-1]], check=True)
    subprocess.run([compiler, *native.LINK_FLAGS, *objects, "-o", str(out / "avx2.so")], check=True)
    library = ctypes.CDLL(str(out / "avx2.so"))
    cpu_decoder._bind(library)
    assert library.hf_paged_linear_rows() == 2  # the AVX2 kernels, not the AVX-512 ones
    return library


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_gives_the_transformers_forwards_tokens(dtype, tokenizer, avx2_library, monkeypatch):
    """Ten prompts in one 284-token step (panels 16 rows at a time: 17 passes and 12 rows), then decodes of 10 and 8
    rows (pairs of rows, and an odd one), through the AVX2 build."""
    torch.manual_seed(1)
    prompts = [torch.randint(3, 250, (n,)).tolist() for n in (3, 9, 17, 30, 5, 70, 12, 8, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = []
    for enforce_eager in (True, False):
        gen = ContinuousBatchGenerator(tiny("llama", dtype), tokenizer, num_blocks=512, block_size=4,
                                       enforce_eager=enforce_eager)
        if not enforce_eager:
            monkeypatch.setattr(cpu_decoder, "_library", avx2_library)
            gen.runner.native.max_tokens = cpu_decoder.MAX_TOKENS  # past the AVX2 build's fp32 limit (next test)
            native_steps, forward_steps = record_steps(gen)
        outs.append(gen.run(prompts, params, use_tqdm=False))
    assert native_steps[0] == 284 and not forward_steps
    for a, b in zip(*outs):
        if dtype == torch.float32:
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert torch.allclose(torch.tensor(list(step_a.values())), torch.tensor(list(step_b.values())),
                                      atol=1e-4)
        else:  # as test_bf16_native_steps_round_like_transformers
            assert a.outputs[0].logprobs[0].keys() == b.outputs[0].logprobs[0].keys()
            assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 0.05 * len(
                a.outputs[0].token_ids)


def test_the_avx2_build_leaves_long_fp32_steps_to_the_transformers_forward(tokenizer, avx2_library, monkeypatch):
    """With AVX2 alone oneDNN's fp32 GEMMs beat the panel products from about 170 tokens on: there fp32 steps of more
    than 160 tokens run the Transformers forward, shorter ones and the decodes after them the native decoder. bf16
    keeps all 512."""
    monkeypatch.setattr(cpu_decoder, "_library", avx2_library)
    assert (cpu_decoder.faster_tokens(torch.float32), cpu_decoder.faster_tokens(torch.bfloat16)) == (160, 512)
    torch.manual_seed(3)
    steps = {}
    for lengths in ((100, 60), (100, 61)):  # first steps of 160 and 161 tokens
        gen = ContinuousBatchGenerator(tiny("llama"), tokenizer, num_blocks=256, block_size=4)
        assert gen.runner.native.max_tokens == 160 and gen.config.max_num_batched_tokens == 2048
        native_steps, forward_steps = record_steps(gen)
        prompts = [torch.randint(3, 250, (n,)).tolist() for n in lengths]
        gen.run(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        steps[sum(lengths)] = native_steps, forward_steps
    assert steps[160] == ([160, 2, 2], [])
    assert steps[161] == ([2, 2], [161])


def test_a_spec_decode_step_verifies_guesses_natively(tokenizer):
    """Prompt lookup on a repetitive prompt: verifying steps (1 + 4 tokens) are native and keep the tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    repeat = [[7, 8, 9, 10, 11, 12] * 3]
    outs = []
    for enforce_eager in (True, False):
        gen = ContinuousBatchGenerator(tiny("llama"), tokenizer, num_blocks=64, block_size=4,
                                       enforce_eager=enforce_eager, speculative_config=spec)
        outs.append(gen.run(repeat, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False))
        assert gen.stats().spec_decode_num_drafts > 0
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_path):
    """SmolLM2 in bf16: its 576- and 1536-long products round differently on tiles, which a tiny model's hide."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16, attn_implementation="paged")


def test_bf16_speculation_keeps_the_tokens_of_native_decoding(tokenizer, smollm2_bf16):
    """Verified guesses are generated tokens: in bf16 they take the vector kernels, as one-token decode steps do, so
    the guesses kept and the tokens after them are those of decoding without speculation (prompts on tiles both
    ways). SmolLM2 asked to repeat a text keeps some guesses."""
    text = "The quick brown fox jumps over the lazy dog, then runs into the forest and hides behind an old oak tree."
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {text}"}],
                                           add_generation_prompt=True, tokenize=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 8}):
        gen = ContinuousBatchGenerator(smollm2_bf16, tokenizer, num_blocks=64, block_size=16,
                                       speculative_config=spec)
        outs.append(gen.run([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        assert spec is None or gen.stats().spec_decode_num_accepted_tokens > 0
    assert outs[0] == outs[1]


def _bf16_outputs(gen, late: list[int] | None = None, after: int = 0, **params) -> dict[str, tuple]:
    """Greedy tokens and logprobs of PROMPTS (and of ``late``, added after ``after`` steps: it prefills while the
    others decode), by request id."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **params)
    for i, prompt in enumerate(PROMPTS):
        gen.add_request(prompt, params, request_id=str(i))
    done, steps = {}, 0
    while gen.has_unfinished_requests() or (late is not None and "late" not in done):
        if late is not None and steps == after:
            gen.add_request(late, params, request_id="late")
        steps += 1
        for out in gen.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = o.token_ids, [list(lp.values()) for lp in (o.logprobs or [])]
    return done


def test_bf16_rows_are_computed_alike_in_every_batch_and_chunking(tokenizer, smollm2_bf16):
    """bf16 prompt tokens take AMX tiles where the CPU has them, generated tokens the vector kernels: each in any
    step alike. A prompt prefilled while others decode, or in chunks of 5 tokens (short tiles), gives the same
    logprobs to the bit as alone in one step, and so do the sequences decoding beside it."""
    late = tokenizer("Paged attention keeps the keys and values of every sequence in fixed-size blocks, and a block "
                     "table maps each sequence's positions to the blocks that hold them, as pages do.").input_ids
    assert len(late) > 2 * 16  # alone, in one step: two whole tiles and a short one

    def engine(**options):
        return ContinuousBatchGenerator(smollm2_bf16, tokenizer, num_blocks=128, block_size=4, **options)

    together = _bf16_outputs(engine(), late, after=3, logprobs=2)
    alone = _bf16_outputs(engine(), logprobs=2)
    alone["late"] = _bf16_outputs(engine(max_num_batched_tokens=32), late, logprobs=2)["late"]
    chunked = _bf16_outputs(engine(max_num_batched_tokens=5, max_num_seqs=1), late, logprobs=2)
    assert together == alone
    assert chunked["late"] == alone["late"]


def test_bf16_prompt_tokens_take_tiles_where_the_cpu_has_them(tokenizer, smollm2_bf16):
    """Without the prompt lengths every row takes the vector kernels. With AMX, SmolLM2's prompt rows, on tiles, sum
    in another order: the first tokens' logprobs differ by a bf16 rounding of the logits, not more. Without AMX nothing
    changes."""
    texts = ("The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3,")
    prompts = [tokenizer(text).input_ids for text in texts]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    firsts = []
    for drop_prompt_lens in (False, True):
        gen = ContinuousBatchGenerator(smollm2_bf16, tokenizer, num_blocks=16, block_size=16)
        if drop_prompt_lens:
            forward = gen.runner.native.forward
            gen.runner.native.forward = lambda *args, **kw: forward(*args[:4], **kw)
        firsts.append([out.outputs[0].logprobs[0] for out in gen.run(prompts, params, use_tqdm=False)])
    differences = [abs(a[t] - b[t]) for a, b in zip(*firsts) for t in a.keys() & b.keys()]
    assert len(differences) >= 12 and max(differences) < 0.25  # a logit of 16-32 moves in bf16 steps of 0.125
    assert (max(differences) > 0) == cpu_decoder.prompt_tiles()


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) - set(NATIVE) - {"falcon"}))  # Falcon: refused
def test_other_architectures_run_the_transformers_forward(arch, tokenizer):
    model, _ = tiny_model(arch)
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64)
    assert gen.runner.native is None


def test_heads_wider_than_the_decoder_takes_run_the_transformers_forward(tokenizer):
    """The native decoder takes heads of dim up to 512; a model of wider ones decodes, through Transformers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(num_attention_heads=2, num_key_value_heads=1, head_dim=576, hidden_size=64,
                         intermediate_size=128, **COMMON)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
    wide = generate(model, tokenizer, enforce_eager=True, max_tokens=8)
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, block_size=4)
    assert gen.runner.native is None
    outputs = gen.run(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in wide]


class LoraLikeLinear(nn.Linear):
    """A subclass of nn.Linear with a forward of its own, as adapters and quantized layers have."""


def test_a_modified_layer_or_a_cache_in_another_dtype_is_not_recognised(tokenizer):
    model = tiny("llama")
    old = model.model.layers[1].self_attn.q_proj
    model.model.layers[1].self_attn.q_proj = LoraLikeLinear(old.in_features, old.out_features, bias=False)
    assert ContinuousBatchGenerator(model, tokenizer, num_blocks=64).runner.native is None
    gen = ContinuousBatchGenerator(tiny("llama"), tokenizer, num_blocks=64, kv_cache_dtype="bfloat16")
    assert gen.runner.native is None


def test_modified_classes_and_norms_are_not_recognised(tokenizer):
    """Whatever the native call would skip or misread runs the Transformers forward: a subclass's own forward (of the
    model or of an attention), norms Llama's attention would not apply (q_norm/k_norm are Qwen3's), a norm weight in
    another dtype or layout."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention

    class Biased(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class Scaled(LlamaAttention):
        pass

    def modified(change):
        model = tiny("llama")
        change(model)
        return ContinuousBatchGenerator(model, tokenizer, num_blocks=64).runner.native

    reference = tiny("llama")
    assert modified(lambda model: None) is not None
    assert modified(lambda model: setattr(model, "__class__", Biased)) is None
    assert modified(lambda model: setattr(model.model.layers[1].self_attn, "__class__", Scaled)) is None
    assert modified(lambda model: setattr(model.model.layers[0].self_attn, "q_norm", nn.Identity())) is None
    norm = reference.model.layers[0].input_layernorm.weight
    assert modified(lambda model: setattr(model.model.layers[0].input_layernorm, "weight",
                                          nn.Parameter(norm.detach().bfloat16()))) is None
    assert modified(lambda model: setattr(model.model.norm, "weight",
                                          nn.Parameter(torch.stack([norm.detach()] * 2, 1)[:, 0]))) is None


def test_a_part_of_the_model_converted_after_the_engine_was_built_is_read_again(tokenizer):
    """Converting one layer gives its parameters new storage (and here bf16-rounded values) that the Transformers
    forward reads at once."""
    model = tiny("llama")
    options = dict(num_blocks=64, block_size=4, enable_prefix_caching=False)
    gen = ContinuousBatchGenerator(model, tokenizer, **options)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    before = gen.run(PROMPTS, params, use_tqdm=False)
    model.model.layers[0].mlp.to(torch.bfloat16).to(torch.float32)
    model.model.norm.weight.data = model.model.norm.weight.detach() * 2  # new storage, not a new Parameter
    after = gen.run(PROMPTS, params, use_tqdm=False)
    eager = ContinuousBatchGenerator(model, tokenizer, enforce_eager=True, **options).run(PROMPTS, params,
                                                                                           use_tqdm=False)
    assert gen.runner.native is not None
    first = [[next(iter(o.outputs[0].logprobs[0].values())) for o in outs] for outs in (before, after, eager)]
    assert first[1] != first[0] and first[1] == pytest.approx(first[2], abs=1e-4)


def test_a_model_converted_after_the_engine_was_built_is_read_again_or_left_to_transformers(tokenizer):
    """``model.to()`` gives every parameter new storage: the decoder re-reads the weights, or, when they no longer fit
    (bf16 weights over the fp32 cache), steps run the Transformers forward instead of reading freed memory."""
    model = tiny("llama")
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = gen.run(PROMPTS, params, use_tqdm=False)
    model.to(torch.float64).to(torch.float32)  # same values, new storage
    assert [o.outputs for o in gen.run(PROMPTS, params, use_tqdm=False)] == [o.outputs for o in before]
    assert gen.runner.native is not None
    model.to(torch.bfloat16)
    assert all(o.error is None for o in gen.run(PROMPTS, params, use_tqdm=False))
    assert gen.runner.native is None


def test_weights_changed_in_place_are_packed_again(tokenizer):
    """The decoder multiplies by its own packed copy of the weights: loading other weights in place (same storage)
    must reach it, as it reaches the Transformers forward. (Prefix caching off: the cached prompts' keys and values
    were computed with the old weights.)"""
    model, other = tiny("llama"), tiny("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn_like(p) * p.std() + p.mean() if p.ndim > 1 else p)
    options = dict(num_blocks=64, block_size=4, enable_prefix_caching=False)
    gen = ContinuousBatchGenerator(model, tokenizer, **options)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = gen.run(PROMPTS, params, use_tqdm=False)
    model.load_state_dict(other.state_dict())
    after = gen.run(PROMPTS, params, use_tqdm=False)
    eager = ContinuousBatchGenerator(model, tokenizer, enforce_eager=True, **options)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in
                                                       eager.run(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]
    assert gen.runner.native is not None


def greedy_tokens(gen) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in gen.run(PROMPTS, params, use_tqdm=False)]


def test_reset_prefix_cache_drops_the_keys_and_values_of_old_weights(tokenizer):
    """With prefix caching on, the prompts' cached blocks hold keys and values of the weights they were computed
    with: after new weights, `reset_prefix_cache` (vLLM's call for an RL loop's update) makes the engine compute them
    again. It is refused while a request is in flight."""
    model, other = tiny("llama"), tiny("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn_like(p) * p.std() + p.mean() if p.ndim > 1 else p)
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, block_size=4)
    greedy_tokens(gen)
    model.load_state_dict(other.state_dict())
    fresh = greedy_tokens(ContinuousBatchGenerator(model, tokenizer, num_blocks=64, block_size=4))
    assert greedy_tokens(gen) != fresh  # read from the cache
    request = gen.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
    assert not gen.reset_prefix_cache()
    while gen.has_unfinished_requests():
        gen.step()
    assert request not in gen.requests and gen.reset_prefix_cache()
    hits = gen.stats().prefix_cache_hits
    assert greedy_tokens(gen) == fresh and gen.stats().prefix_cache_hits == hits


def test_parameters_and_modules_replaced_after_the_engine_was_built_are_read(tokenizer):
    """Weights given as new Parameters or in new modules (an adapter swapped in, say) reach the native steps as they
    reach the Transformers forward, whichever weights the decoder checked its addresses on."""
    options = dict(num_blocks=64, block_size=4, enable_prefix_caching=False)
    model = tiny("llama")
    gen = ContinuousBatchGenerator(model, tokenizer, **options)
    before = greedy_tokens(gen)
    torch.manual_seed(1)
    model.model.norm.weight = nn.Parameter(torch.rand_like(model.model.norm.weight) * 3)
    old = model.model.layers[1].self_attn.o_proj
    model.model.layers[1].self_attn.o_proj = nn.Linear(old.in_features, old.out_features, bias=False)
    eager = ContinuousBatchGenerator(model, tokenizer, enforce_eager=True, **options)
    after = greedy_tokens(gen)
    assert after == greedy_tokens(eager) and after != before
    assert gen.runner.native is not None


def test_forward_hooks_run_through_the_transformers_forward_while_they_are_on(tokenizer):
    options = dict(num_blocks=64, block_size=4, enable_prefix_caching=False)
    model = tiny("llama")
    gen = ContinuousBatchGenerator(model, tokenizer, **options)
    plain = greedy_tokens(gen)
    for module, kind in ((model.model.layers[1].mlp, "hook"), (model.model.layers[0], "pre_hook"), (model, "hook")):
        if kind == "hook":
            handle = module.register_forward_hook(lambda mod, args, out: out * 0 if torch.is_tensor(out) else out)
        else:
            handle = module.register_forward_pre_hook(lambda mod, args, kwargs: (args, kwargs), with_kwargs=True)
        hooked = greedy_tokens(gen)
        assert hooked == greedy_tokens(ContinuousBatchGenerator(model, tokenizer, enforce_eager=True, **options))
        assert (hooked != plain) == (module is model.model.layers[1].mlp)
        handle.remove()
    model.model.layers[1].mlp.forward = lambda x: torch.zeros_like(x)  # an instance's own forward, likewise
    assert greedy_tokens(gen) == greedy_tokens(ContinuousBatchGenerator(model, tokenizer, enforce_eager=True,
                                                                        **options)) != plain
    del model.model.layers[1].mlp.forward
    assert greedy_tokens(gen) == plain and gen.runner.native is not None and gen.runner.native.ready()


def test_a_llama_config_with_a_sliding_window_slides_nothing(tokenizer):
    """Llama's attention has no window, whatever the config says (converted Qwen2 configs carry one)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                         sliding_window=4, **COMMON)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
    fast = [o.outputs[0].token_ids for o in generate(model, tokenizer, enforce_eager=False, max_tokens=10)]
    eager = [o.outputs[0].token_ids for o in generate(model, tokenizer, enforce_eager=True, max_tokens=10)]
    assert fast == eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_lays_weights_out_in_zero_padded_panels(dtype):
    n, k, panel = 100, 6, cpu_decoder.PANEL
    weight = torch.arange(n * k, dtype=torch.float32).view(n, k).to(dtype)
    packed = cpu_decoder.pack(weight)
    rows = torch.cat([weight, weight.new_zeros(3 * panel - n, k)])
    for r, c in [(0, 0), (1, 5), (47, 2), (48, 3), (99, 5), (143, 1)]:
        p, i = divmod(r, panel)
        at = packed[p, c, i] if dtype == torch.float32 else packed[p, c // 2, i, c % 2]
        assert at == rows[r, c]
    assert packed.numel() == rows.numel() and packed.is_contiguous()
    if dtype == torch.bfloat16:
        with pytest.raises(ValueError, match="even number of columns"):
            cpu_decoder.pack(weight[:, :5].contiguous())


def test_a_bad_block_table_is_refused_not_read(tokenizer):
    gen = ContinuousBatchGenerator(tiny("llama"), tokenizer, num_blocks=8, block_size=4)
    decoder: NativeDecoder = gen.runner.native
    metadata = PagedMetadata.build(gen.kv_storage, [[99]], [1], [1], [0])
    with pytest.raises(ValueError, match="block table lists a block outside 0..7"):
        decoder.forward(torch.tensor([[5]]), torch.tensor([[0]]), metadata, torch.tensor([0]))


@pytest.mark.parametrize("prompt_lens", [torch.tensor([1, 1], dtype=torch.int32), torch.tensor([1])])
def test_prompt_lengths_other_than_one_int32_per_sequence_are_refused(tokenizer, prompt_lens):
    gen = ContinuousBatchGenerator(tiny("llama", torch.bfloat16), tokenizer, num_blocks=8, block_size=4)
    metadata = PagedMetadata.build(gen.kv_storage, [[0]], [1], [1], [0])
    with pytest.raises(ValueError, match="prompt_lens must be 1 contiguous int32 values, one per sequence"):
        gen.runner.native.forward(torch.tensor([[5]]), torch.tensor([[0]]), metadata, torch.tensor([0]), prompt_lens)


# ------------------------------------------------------------------------------------ matrix-vector products
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n, bias", [(64, 48, False), (37, 13, True), (576, 200, True), (96, 1, False)])
def test_linear_matches_f_linear_and_each_row_is_independent_of_the_others(dtype, k, n, bias):
    torch.manual_seed(0)
    layer = nn.Linear(k, n, bias=bias).to(dtype)
    x = torch.randn(cpu_decoder.MAX_ROWS, k, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for rows in range(1, cpu_decoder.MAX_ROWS + 1):
            assert cpu_decoder.linear_fits(x[:rows], layer.weight, layer.bias) == (rows <= cpu_decoder.linear_rows())
        full = cpu_decoder.linear(x, layer.weight, layer.bias)
        expected = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
        assert torch.allclose(full.double(), expected, rtol=tolerance, atol=tolerance)
        for rows in range(1, cpu_decoder.MAX_ROWS + 1):
            assert torch.equal(cpu_decoder.linear(x[:rows], layer.weight, layer.bias), full[:rows])
        assert torch.equal(cpu_decoder.linear(x[3:4].view(1, 1, k), layer.weight, layer.bias)[0, 0], full[3])


def test_linear_takes_only_what_it_can_read():
    weight = torch.randn(8, 16)
    assert cpu_decoder.linear_rows() in (2, cpu_decoder.MAX_ROWS)  # 2 with AVX2 alone, where oneDNN is faster
    assert not cpu_decoder.linear_fits(torch.randn(9, 16), weight, None)  # more rows than the kernel's
    assert not cpu_decoder.linear_fits(torch.randn(2, 16, dtype=torch.float64), weight.double(), None)
    assert not cpu_decoder.linear_fits(torch.randn(2, 16), weight.t().contiguous().t(), None)
    assert not cpu_decoder.linear_fits(torch.randn(2, 32)[:, ::2], weight, None)
    assert not cpu_decoder.linear_fits(torch.randn(2, 16), weight, torch.randn(8, dtype=torch.float64))
