"""CUDA graphs for decode and verifying steps (`hf_paged.generation.cuda_graphs`).

Without a GPU the graphs' own machinery still runs: a stand-in capture replays the step function on the graph's
buffers, over the Triton kernels (interpreted, ``HF_PAGED_KERNELS=triton``), and refuses every read of a tensor's
value on the host, which is what a CUDA graph cannot hold. So padding to a bucket, the buffers and the forward's
freedom from host syncs are tested here; the real capture is tested when a GPU is present."""

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PreTrainedTokenizerFast

from hf_paged import ContinuousBatchGenerator, SamplingParams
from hf_paged.generation.cuda_graphs import DecodeGraphs, capture_sizes
from tiny_models import tiny_model

# The tests that run the Triton kernels take the GPU where there is one (they run interpreted on CPU tensors only).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Prompts of several lengths whose outputs end at different steps, so the batch shrinks through every bucket.
PROMPTS = [[1, 5 + i, 9, 17 + 3 * i, 40, 3, 8][: 2 + i % 5] for i in range(7)]
PARAMS = [SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True) for i in range(7)]
HOST_READS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero, torch.ops.aten.item,
              torch.ops.aten.nonzero, torch.ops.aten.masked_select, torch.ops.aten.equal}


class NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READS:
            raise RuntimeError(f"{func} reads a tensor's value on the host")
        return func(*args, **(kwargs or {}))


class ReplayOnCpu:
    """A capture for CPU tensors: replaying runs the step function again, into the one logits tensor a graph keeps."""

    def __init__(self):
        self.replays = 0

    def __call__(self, step):
        with NoHostReads():
            logits = step()

        def replay():
            with NoHostReads():
                logits.copy_(step())
            self.replays += 1
            return logits

        return replay


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer of the tiny models' 256 tokens, built here: a GPU machine has no model files."""
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 256)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


_eager: dict[tuple[str, str], list[list[int]]] = {}


def eager_tokens(name, tokenizer, params=PARAMS):
    """The tiny model's tokens without graphs or speculation, through the same (Triton) kernels; computed once per
    model and parameters (the interpreted kernels are slow)."""
    key = (name, repr(params))
    if key not in _eager:
        _eager[key] = generate(tiny_model(name)[0].to(DEVICE), tokenizer, params=params)[0]
    return _eager[key]


def generate(model, tokenizer, capture=None, params=PARAMS, speculative_config=None):
    gen = ContinuousBatchGenerator(model, tokenizer, enforce_eager=True, num_blocks=64, block_size=4,
                                   max_num_seqs=8, speculative_config=speculative_config)
    if capture is not None:
        max_query_len = 1 + (speculative_config or {}).get("num_speculative_tokens", 0)
        gen.runner.graphs = DecodeGraphs(gen.runner.forward, gen.kv_storage, capture_sizes(8), 16, max_query_len,
                                         capture=capture)
    outputs = gen.run(PROMPTS, params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs], gen


def test_capture_sizes_are_vllms_buckets():
    assert capture_sizes(256)[:6] == (1, 2, 4, 8, 16, 24) and capture_sizes(256)[-1] == 256
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(10_000)[-1] == 256


def test_a_graph_takes_steps_whose_sequences_have_equal_new_tokens(tokenizer):
    model, _ = tiny_model("llama")
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=16, block_size=4)
    graphs = DecodeGraphs(gen.runner.forward, gen.kv_storage, capture_sizes(32), 16, max_query_len=4)
    for seq_id in (0, 1):
        gen.kv_manager.allocate(seq_id, 0, 16)

    def step(*query_lens):
        spans = [(seq_id, 8, [3] * n) for seq_id, n in enumerate(query_lens)]
        return gen.runner.pack(spans, list(range(sum(query_lens))))

    assert graphs.bucket(step(1, 1)) == (2, 1)
    assert graphs.bucket(step(3)) == (1, 3)
    assert graphs.bucket(step(4, 4)) == (2, 4)
    assert graphs.bucket(step(4, 2)) is None  # the sequences' guesses differ in number
    assert graphs.bucket(step(5)) is None  # more than 1 + num_speculative_tokens
    assert DecodeGraphs(gen.runner.forward, gen.kv_storage, (1, 2, 4), 16, 4).bucket(step(3, 3)) is None  # > 4 tokens


def test_a_verifying_graph_padded_with_empty_sequences_gives_the_eager_logits(tokenizer, monkeypatch):
    """Three sequences of two new tokens run the graph of four: the fourth attends to nothing and writes nothing."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    model = tiny_model("llama")[0].to(DEVICE)
    gen = ContinuousBatchGenerator(model, tokenizer, enforce_eager=True, num_blocks=16, block_size=4)
    graphs = DecodeGraphs(gen.runner.forward, gen.kv_storage, capture_sizes(8), 16, max_query_len=2,
                          capture=ReplayOnCpu())
    for seq_id in range(3):
        gen.kv_manager.allocate(seq_id, 0, 10)
    step = gen.runner.pack([(seq_id, 8, [5 + seq_id, 9]) for seq_id in range(3)], [0, 1, 2, 3, 4, 5])
    assert graphs.bucket(step) == (4, 2)
    eager = gen.runner.forward(step)
    replayed = graphs.run(step)
    torch.testing.assert_close(replayed, eager)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


def test_the_engine_captures_graphs_on_gpu_only(tokenizer):
    model, _ = tiny_model("llama")
    assert ContinuousBatchGenerator(model, tokenizer, num_blocks=16).runner.graphs is None  # on CPU


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3n"])  # plain, sliding window, layers sharing KV
def test_decode_steps_from_graphs_give_the_eager_tokens(name, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    eager = eager_tokens(name, tokenizer)
    capture = ReplayOnCpu()
    replayed, gen = generate(tiny_model(name)[0].to(DEVICE), tokenizer, capture)
    assert replayed == eager
    graphs = gen.runner.graphs
    assert graphs.disabled is None and sorted(graphs.replays) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    assert capture.replays >= max(p.max_tokens for p in PARAMS) - 2  # every decode step after the prefills


@pytest.mark.parametrize(("name", "schedule"), [("llama", "constant"), ("llama", "heuristic"), ("gemma3n", "constant")])
def test_verifying_steps_replay_graphs_of_their_own(name, schedule, tokenizer, monkeypatch):
    """A step in which every sequence verifies k guesses runs the graph of k + 1 tokens per sequence, and the tokens
    are those of decoding without speculation."""
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
            "disable_by_batch_size": 2, "num_speculative_tokens_schedule": schedule}
    # The last two speculate once the others are done, together (their guesses may differ in number), then alone.
    params = PARAMS[:-2] + [PARAMS[-2].replace(max_tokens=20), PARAMS[-1].replace(max_tokens=36)]
    eager = eager_tokens(name, tokenizer, params)
    capture = ReplayOnCpu()
    replayed, gen = generate(tiny_model(name)[0].to(DEVICE), tokenizer, capture, params=params,
                             speculative_config=spec)
    assert replayed == eager
    graphs = gen.runner.graphs
    verifying = {shape for shape in graphs.replays if shape[1] > 1}
    assert graphs.disabled is None and verifying and gen.stats().spec_decode_num_drafts > 0
    assert all(size * q <= 8 for size, q in graphs.replays)  # no graph larger than the largest decode graph


def test_a_forward_that_reads_tensors_on_the_host_turns_the_graphs_off(tokenizer, monkeypatch, caplog):
    """A plain all-ones mask makes the paged mask function check it for padding: a host read. The capture fails,
    the graphs go off with a warning that says why, and every step runs eagerly to the same tokens."""
    import hf_paged.generation.model_runner as model_runner

    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    eager = eager_tokens("llama", tokenizer)
    monkeypatch.setattr(model_runner, "unpadded_mask", lambda n, device: torch.ones(1, n, dtype=torch.bool))
    capture = ReplayOnCpu()
    with caplog.at_level(logging.WARNING, logger="hf_paged.generation.cuda_graphs"):
        replayed, gen = generate(tiny_model("llama")[0].to(DEVICE), tokenizer, capture)
    assert replayed == eager
    assert "is_nonzero" in gen.runner.graphs.disabled and capture.replays == 0
    assert "CUDA graphs are off" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graphs_give_the_eager_tokens_on_gpu(tokenizer):
    model, _ = tiny_model("llama")
    model = model.cuda()
    eager, _ = generate(model, tokenizer)
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, block_size=4, max_num_seqs=8)
    assert gen.runner.graphs is not None
    outputs = gen.run(PROMPTS, PARAMS, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == eager
    assert gen.runner.graphs.disabled is None and sorted(gen.runner.graphs.replays) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    spec = {"model": model, "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, block_size=4, max_num_seqs=8,
                                   speculative_config=spec)
    outputs = gen.run(PROMPTS, PARAMS, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == eager
    assert any(q > 1 for _, q in gen.runner.graphs.replays)  # the target's verifying steps, once few sequences remain
    assert gen.speculator.draft.runner.graphs.replays  # the draft's one-token steps too
