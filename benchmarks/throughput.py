"""Offline throughput of hf_paged's ContinuousBatchGenerator against Transformers' own engines, on one workload.

Every engine serves the same seeded workload (all requests arrive at once, greedy decoding, every request produces
exactly its requested number of tokens), each in a fresh subprocess after a short warm-up, so peak RSS is per engine
and no warm state leaks from one engine to the next:

* ``static``  -- ``model.generate`` (sdpa), left-padded batches of ``--static-batch-size`` in arrival order; a batch
  runs until its longest request is done and only the requested tokens count as output.
* ``hf_cb``   -- Transformers' continuous batching (``init_continuous_batching`` + ``add_request``, sdpa).
* ``ours``    -- hf_paged's ``ContinuousBatchGenerator``.
* ``ceiling`` -- the model's bare forward (``use_cache=False``, input ``[B, 1]``) timed at the decode batch sizes
  ``ours`` actually ran: the speed of a decode step with no attention to past tokens and no engine overhead. It runs
  the same linear kernels as ``ours`` (on CPU, oneDNN with packed weights unless ``--no-prepack-weights``).

Prompts are windows of a built-in English paragraph (repeated), starting at distinct offsets so that no two prompts
share a prefix unless ``--shared-prefix`` asks for one. The report gives, per engine: output and total tokens/s,
requests/s, time to first token and time per output token (p50/p99), peak RSS; then ours / each peer, greedy token
agreement between engines, KV-cache slots allocated but unused at peak, and ours' decode speed per batch size against
the bare-forward ceiling ("engine efficiency").

``--structured json`` measures something else, in one process on ours only: the same requests (a mix of the test
suite's JSON schemas, each as an array of ``--structured-items`` items so that decoding outweighs the prompt,
temperature 1) with their constraint and without it (the same prompts, seeds and output lengths, ``ignore_eos``), in
interleaved rounds; then grammar compile time per schema, first and cached.

Usage:
    python benchmarks/throughput.py                      # 64 requests, prompts 16-512, outputs 16-256 tokens
    python benchmarks/throughput.py --smoke --json out.json
    python benchmarks/throughput.py --engines ours,ceiling --num-requests 16 --shared-prefix 256
    python benchmarks/throughput.py --structured json --num-requests 32
    python benchmarks/throughput.py --engines ours --tensor-parallel-size 2 --threads 1   # two ranks, a core each
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import HelpFormatter, percentile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENGINES = ("static", "hf_cb", "ours", "ceiling")
# --smoke: a workload that every engine serves in seconds; one torch thread is steadier on a shared CI machine.
SMOKE_DEFAULTS = dict(num_requests=6, min_prompt=8, max_prompt=32, min_output=4, max_output=12, static_batch_size=4,
                      kv_tokens=2048, threads=1)

# Transformers CB settings, chosen on a 2-core CPU (one thread, 16 requests, prompts 16-256, outputs 16-64, two
# interleaved rounds): pages of 32, 64 or 256 tokens ran within 2% of each other (64 by a hair), and 1024 tokens per
# step instead of 512 gave no throughput but a 55% longer TTFT, so it gets the same step budget as ours
# (--max-batch-tokens). `num_blocks` follows --kv-tokens; flash attention is off (sdpa, as asked, and none on CPU).
HF_CB_CONFIG = dict(page_size=64, allow_block_sharing=True, auto_switch_to_flash=False)

PARAGRAPH = (
    "The lighthouse on the northern cape was built in the spring of a wet year, when the fishing boats had lost three "
    "crews to the rocks below the cliff. The builders carried every stone up the narrow path by hand, and the keeper "
    "who came after them kept a careful journal of the weather, the passing ships and the birds that rested on the "
    "gallery rail. In the long winters he repaired the lamp, trimmed the wicks and polished the great lens until it "
    "threw a clean white beam twenty miles across the water. Sailors learned to count its flashes, two short and one "
    "long, and to steer wide of the point when the light was on their left. Children from the village walked out on "
    "Sundays to hear his stories about storms, wrecks and the strange lights that sometimes moved under the waves. "
    "When the electric lamp arrived many years later, the journal stopped, but people still say that on calm nights "
    "you can see a second, fainter beam turning slowly above the first, as if someone were still keeping watch. "
)
CODE = '''import json
from pathlib import Path


def load_orders(path):
    orders = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            orders.append(json.loads(line))
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        name = order["customer"]
        totals[name] = totals.get(name, 0) + order["quantity"] * order["price"]
    return totals


def largest_orders(orders, count=3):
    ranked = sorted(orders, key=lambda order: order["quantity"] * order["price"], reverse=True)
    return ranked[:count]


def write_report(orders, path):
    lines = [f"{name}: {total:.2f}" for name, total in sorted(total_by_customer(orders).items())]
    Path(path).write_text("\\n".join(lines) + "\\n")
'''
# --workload grounded: requests alternate between these asks about a window of the paragraph or of the code.
# SmolLM2-135M-Instruct answers both by copying most of the window (asks it did not follow were left out).
GROUNDED_ASKS = (("Fix any spelling mistakes in this passage and give back the whole corrected passage:", PARAGRAPH),
                 ("Add type hints to this Python code:", CODE))
SYSTEM_TEXT = (
    "You are a patient assistant who answers questions about coastal history, navigation and the sea. Keep every "
    "answer short, accurate and friendly, and say so plainly when you do not know something. "
)


# ----------------------------------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--model", default=None, help="local model directory (default: the embedded SmolLM2-135M-Instruct)")
    add("--dtype", choices=("float32", "bfloat16", "float64"), default="float32",
        help="weights and KV cache dtype (all engines; float64 is slow, for numerical references)")
    add("--device", default="cpu", help="where the model runs, cpu or cuda (default: cpu)")
    add("--engines", default=",".join(ENGINES), help=f"comma list, a subset of {','.join(ENGINES)}")
    add("--num-requests", type=int, default=64, help="number of requests in the workload")
    add("--min-prompt", type=int, default=16, help="shortest prompt, in tokens (before --shared-prefix)")
    add("--max-prompt", type=int, default=512, help="longest prompt, in tokens (before --shared-prefix)")
    add("--min-output", type=int, default=16, help="fewest output tokens of a request")
    add("--max-output", type=int, default=256, help="most output tokens of a request")
    add("--seed", type=int, default=0, help="seed of the workload (prompt and output lengths, prompt offsets)")
    add("--shared-prefix", type=int, default=0, help="prepend the same N-token system prompt to every prompt")
    add("--workload", choices=("windows", "grounded"), default="windows",
        help="windows: each prompt a window of a paragraph, to be continued; grounded: chat requests to correct "
             "a window of a paragraph or to add type hints to a window of code, whose answers copy much of the "
             "prompt (--min/--max-prompt size the window)")
    add("--mix", default=None, type=parse_mix,
        help="draw the requests from several groups, 'N:PMIN-PMAX:OMIN-OMAX,...' (N requests with prompts and outputs "
             "in those token ranges), shuffled together; e.g. '12:16-64:16-64,4:64-256:128-256' for short chats "
             "and a few long answers, whose tail runs at a small batch. Replaces --num-requests and the length flags")
    add("--enforce-eager", action="store_true",
        help="ours: every step through the model's Transformers forward (no native CPU decoder)")
    add("--speculative-config", default=None,
        help="ours: speculative decoding, as JSON (see `hf-paged serve --help`), e.g. '{\"method\": \"ngram\"}'")
    add("--static-batch-size", type=int, default=32, help="batch size of the static `generate` engine")
    add("--kv-tokens", type=int, default=32768, help="KV-cache capacity in tokens of both continuous engines")
    add("--kv-cache-memory", default=None,
        help="ours: KV-cache size in bytes per rank (e.g. 64MiB) instead of --kv-tokens; with --tensor-parallel-size "
             "each rank holds its own KV heads only, so the same bytes hold more tokens")
    add("--tensor-parallel-size", type=int, default=1,
        help="ours: split the model over N ranks (torchrun on this host, gloo on CPU); --threads is per rank")
    add("--block-size", type=int, default=16, help="KV block size of ours")
    add("--max-batch-tokens", type=int, default=512, help="most tokens per step of both continuous engines")
    add("--max-num-seqs", type=int, default=256, help="most sequences per step of both continuous engines")
    add("--kv-cache-dtype", choices=("float32", "bfloat16", "float16"), default=None,
        help="KV cache dtype of ours (default: --dtype)")
    add("--round-weights", choices=("bfloat16", "float16"), default=None,
        help="round every weight to this dtype and back before the run, then compute in --dtype as usual: with "
             "--compare-with an unrounded run, the token agreement that the rounded weights alone allow")
    add("--no-prefix-caching", action="store_true", help="ours: no prefix caching (every prompt prefilled in full)")
    add("--no-prepack-weights", action="store_true",
        help="ours and ceiling: plain torch linear layers instead of oneDNN with packed weights (CPU)")
    add("--hf-cb-config", default=None, help="JSON dict overriding the Transformers ContinuousBatchingConfig fields")
    add("--threads", type=int, default=None,
        help="torch threads per engine process (default: torch's choice; use 1 on a machine shared with other jobs)")
    add("--engine-timeout", type=float, default=3600, help="seconds before an engine's subprocess is killed")
    add("--json", default=None, help="also write the report to this JSON file")
    add("--compare-with", default=None,
        help="a --json report of an earlier run on the same workload (e.g. fp32): per-engine ratio and token agreement")
    add("--structured", choices=("json",), default=None,
        help="constrained decoding instead of the engine comparison: --num-requests JSON-schema requests at once, "
             "constrained against unconstrained, and grammar compile times (--rounds rounds, ours only)")
    add("--structured-items", type=int, default=4, help="--structured: each schema is an array of this many items")
    add("--rounds", type=int, default=3, help="--structured: interleaved rounds of each variant (best is reported)")
    add("--smoke", action="store_true",
        help="tiny workload for CI (default flags become: 6 requests, prompts 8-32, outputs 4-12, static batch 4, "
             "2048 KV tokens, 1 thread)")
    add("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one engine, see run_worker()
    add("--worker-io", nargs=2, default=None, help=argparse.SUPPRESS)
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**SMOKE_DEFAULTS)  # flags given explicitly still win
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {','.join(ENGINES)}")
    if args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size must be >= 1")
    if args.kv_cache_memory is not None:
        from hf_paged.cli import parse_memory

        args.kv_cache_memory = parse_memory(str(args.kv_cache_memory))
    if not (1 <= args.min_prompt <= args.max_prompt and 1 <= args.min_output <= args.max_output):
        parser.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-output <= --max-output")
    if args.mix:
        args.num_requests = sum(group[0] for group in args.mix)
        args.max_prompt = max(group[2] for group in args.mix)
    return args


def parse_mix(text: str) -> list[tuple[int, int, int, int, int]]:
    """``--mix``: ``(count, min prompt, max prompt, min output, max output)`` per group."""
    groups = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+):(\d+)-(\d+):(\d+)-(\d+)\s*", part)
        if not match:
            raise argparse.ArgumentTypeError(f"{part!r} is not N:PMIN-PMAX:OMIN-OMAX")
        n, p0, p1, o0, o1 = map(int, match.groups())
        if not (n >= 1 and 1 <= p0 <= p1 and 1 <= o0 <= o1):
            raise argparse.ArgumentTypeError(f"{part!r}: need N >= 1, 1 <= PMIN <= PMAX and 1 <= OMIN <= OMAX")
        groups.append((n, p0, p1, o0, o1))
    return groups


# ------------------------------------------------------------------------------------------------------ workload
def repeat_to(tokens: list[int], length: int) -> list[int]:
    return (tokens * (length // len(tokens) + 1))[:length]


def make_workload(args, tokenizer) -> dict:
    """Prompts (token ids) and output lengths; prompt ``i`` is a window of the repeated paragraph (``--workload
    grounded``: a chat request about a window of the paragraph or of the code)."""
    rng = random.Random(args.seed)
    n = args.num_requests
    groups = args.mix or [(n, args.min_prompt, args.max_prompt, args.min_output, args.max_output)]
    prompt_lens, output_lens = [], []
    for count, p0, p1, o0, o1 in groups:  # prompts first, then outputs: the same draws as before --mix existed
        prompt_lens += [rng.randint(p0, p1) for _ in range(count)]
        output_lens += [rng.randint(o0, o1) for _ in range(count)]
    if args.mix:
        order = list(range(n))
        rng.shuffle(order)
        prompt_lens, output_lens = [prompt_lens[i] for i in order], [output_lens[i] for i in order]
    if args.workload == "grounded":
        return dict(prompts=grounded_prompts(tokenizer, rng, prompt_lens, args.shared_prefix), output_lens=output_lens)
    text = tokenizer(PARAGRAPH, add_special_tokens=False).input_ids
    offsets = rng.sample(range(len(text)), n) if n <= len(text) else [rng.randrange(len(text)) for _ in range(n)]
    stream = repeat_to(text, len(text) + args.max_prompt)
    prefix = repeat_to(tokenizer(SYSTEM_TEXT, add_special_tokens=False).input_ids, args.shared_prefix)
    prompts = [prefix + stream[o : o + length] for o, length in zip(offsets, prompt_lens)]
    return dict(prompts=prompts, output_lens=output_lens)


def grounded_prompts(tokenizer, rng: random.Random, window_lens: list[int], shared_prefix: int) -> list[list[int]]:
    """Chat requests alternating between `GROUNDED_ASKS`, each about a window of its text (repeated as needed)."""
    texts = [tokenizer(text, add_special_tokens=False).input_ids for _, text in GROUNDED_ASKS]
    system = tokenizer.decode(repeat_to(tokenizer(SYSTEM_TEXT, add_special_tokens=False).input_ids, shared_prefix))
    prompts = []
    for i, length in enumerate(window_lens):
        (ask, _), text = GROUNDED_ASKS[i % 2], texts[i % 2]
        start = rng.randrange(len(text))
        messages = [{"role": "user", "content": f"{ask}\n\n{tokenizer.decode(repeat_to(text[start:] + text, length))}"}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"])
    return prompts


def warmup_workload(vocab_ids: list[int], seed: int = 1234) -> dict:
    """A few short requests of random tokens: nothing in them can match a prefix of the real workload."""
    rng = random.Random(seed)
    prompts = [[rng.choice(vocab_ids) for _ in range(rng.randint(24, 48))] for _ in range(4)]
    return dict(prompts=prompts, output_lens=[rng.randint(4, 8) for _ in prompts])


# ------------------------------------------------------------------------------------------------ measurements
def latency_summary(ttft: list[float], tpot: list[float]) -> dict:
    return dict(ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
                tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99))


def per_token_time(first: float, last: float, num_tokens: int) -> float | None:
    return (last - first) / (num_tokens - 1) if num_tokens > 1 else None


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class StepRecorder:
    """Wraps a generator's ``_step`` (under ``step``, ``run`` and ``stream``) and ``runner.execute`` to log each
    step's batch and time, and the KV use at peak.

    A step record is ``(num_decode_seqs, num_prefill_tokens, step_seconds)``. The KV sample is taken after the step
    (outside its timing) and only when the number of used blocks reaches a new high.
    """

    def __init__(self, generator):
        self.generator = generator
        self.steps: list[tuple[int, int, float]] = []
        self.peak = dict(used_blocks=0, stored_tokens=0)
        self._batch = None
        execute, step = generator.runner.execute, generator._step  # what step(), run() and stream() all call

        def recording_execute(batch):
            # A sequence decodes one token, or verifies its guesses after it (1 + k tokens); the rest are prompts.
            decodes = [n == 1 or seq.seq_id in batch.spec_token_ids for seq, n in zip(batch.seqs, batch.num_tokens)]
            self._batch = (sum(decodes), sum(n for n, decode in zip(batch.num_tokens, decodes) if not decode))
            return execute(batch)

        def recording_step(only):
            self._batch = None
            start = time.perf_counter()
            outputs = step(only)
            elapsed = time.perf_counter() - start
            if self._batch is not None:
                self.steps.append((*self._batch, elapsed))
                self._sample_kv()
            return outputs

        generator.runner.execute = recording_execute
        generator._step = recording_step

    def _sample_kv(self) -> None:
        kv = self.generator.kv_manager
        used = kv.pool.num_used_blocks
        if used <= self.peak["used_blocks"]:
            return
        bs, filled = kv.block_size, {}
        for seq in self.generator.scheduler.running:
            for i, block in enumerate(kv.block_table(seq.seq_id)):
                filled[block] = max(filled.get(block, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
        self.peak = dict(used_blocks=used, stored_tokens=sum(filled.values()))

    def kv_report(self) -> dict:
        pool = self.generator.kv_manager.pool
        total = pool.num_blocks * pool.block_size
        allocated = self.peak["used_blocks"] * pool.block_size
        unused = allocated - self.peak["stored_tokens"]
        return dict(total_slots=total, peak_allocated_slots=allocated, peak_stored_tokens=self.peak["stored_tokens"],
                    unused_fraction_of_cache=unused / total, unused_fraction_of_allocated=unused / max(1, allocated))


# ------------------------------------------------------------------------------------------------------ engines
def load_model(path: str, dtype: str, attn: str, round_weights: str | None = None, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged.quantization import quantized_load_kwargs  # GPTQ/AWQ: the same CPU kernels for every engine

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=getattr(torch, dtype),
                                                 device_map=device, **quantized_load_kwargs(path, device))
    if round_weights:
        round_parameters(model, getattr(torch, round_weights))
    return model.eval(), tokenizer


def round_parameters(model, dtype) -> None:
    """Round every floating-point parameter to ``dtype`` and back, in place (the model keeps its own dtype)."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.copy_(param.to(dtype).to(param.dtype))


class StepClock:
    """A `generate` streamer that only timestamps: ``put`` comes once with the prompt, then once per new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, _) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_batch(model, tokenizer, prompts: list[list[int]], wanted: list[int]):
    """One left-padded ``generate`` call run to the batch's longest request.

    EOS is disabled (-1), as in the other engines (ours ``ignore_eos``, Transformers CB -1): it neither stops a row
    nor is banned, so greedy tokens after a predicted EOS stay comparable.

    Returns each request's requested tokens, the step clock and the generated tensor's shape.
    """
    import torch
    from transformers import GenerationConfig

    enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    most = max(wanted)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=most, pad_token_id=pad, eos_token_id=-1)
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(**enc, generation_config=config, streamer=clock)
    width = enc["input_ids"].shape[1]
    return [out[row, width : width + m].tolist() for row, m in enumerate(wanted)], clock, tuple(out.shape)


def run_static(args, model, tokenizer, workload: dict) -> dict:
    """``generate`` on left-padded batches of --static-batch-size, in arrival order, after a warm-up batch."""
    tokenizer.padding_side = "left"
    warm = warmup_workload(vocab_ids(tokenizer))
    generate_batch(model, tokenizer, warm["prompts"], warm["output_lens"])
    prompts, lens, size = workload["prompts"], workload["output_lens"], args.static_batch_size
    tokens, ttft, tpot, allocated, stored = [], [], [], 0, 0
    start = time.perf_counter()
    for b in range(0, len(prompts), size):
        batch, wanted = prompts[b : b + size], lens[b : b + size]
        batch_tokens, clock, shape = generate_batch(model, tokenizer, batch, wanted)
        tokens += batch_tokens
        ttft += [clock.times[1] - start] * len(wanted)  # every request arrived at `start`
        tpot += [per_token_time(clock.times[1], clock.times[m], m) for m in wanted]
        if shape[0] * shape[1] > allocated:  # the batch's KV at its end: every row as long as the longest
            allocated, stored = shape[0] * shape[1], sum(len(p) + m for p, m in zip(batch, wanted))
    wall = time.perf_counter() - start
    kv = dict(peak_allocated_slots=allocated, peak_stored_tokens=stored,
              unused_fraction_of_allocated=(allocated - stored) / max(1, allocated))
    return dict(wall_s=wall, tokens=tokens, **latency_summary(ttft, [t for t in tpot if t is not None]), kv=kv)


def hf_cb_settings(args) -> dict:
    settings = dict(HF_CB_CONFIG, max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.max_num_seqs)
    settings.update(json.loads(args.hf_cb_config or "{}"))
    settings.setdefault("num_blocks", args.kv_tokens // settings["page_size"])
    return settings


def run_hf_cb_requests(manager, workload: dict, tag: str) -> tuple[dict, float]:
    """Submit every request, wait for all of them; returns the finished outputs by index and the wall time."""
    start = time.perf_counter()
    for i, (prompt, m) in enumerate(zip(workload["prompts"], workload["output_lens"])):
        manager.add_request(prompt, request_id=f"{tag}{i}", max_new_tokens=m, eos_token_id=-1, record_timestamps=True)
    done = {}
    while len(done) < len(workload["prompts"]):
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError(f"Transformers CB stopped with {len(done)} of {len(workload['prompts'])} requests done")
        if result.error:
            raise RuntimeError(f"Transformers CB request {result.request_id} failed: {result.error}")
        if result.is_finished():
            done[int(result.request_id[len(tag):])] = result
    return done, time.perf_counter() - start


def run_hf_cb(args, model, tokenizer, workload: dict) -> dict:
    """Transformers' continuous batching; EOS is disabled (-1) so that every request runs to its length."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    settings = hf_cb_settings(args)
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id or 0)
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=ContinuousBatchingConfig(**settings))
    manager.start()
    try:
        run_hf_cb_requests(manager, warmup_workload(vocab_ids(tokenizer)), "warm")
        done, wall = run_hf_cb_requests(manager, workload, "r")
    finally:
        manager.stop(block=True)
    results = [done[i] for i in range(len(done))]
    short = sum(len(r.generated_tokens) != m for r, m in zip(results, workload["output_lens"]))
    if short:
        raise RuntimeError(f"Transformers CB returned the wrong number of tokens for {short} requests")
    ttft = [r.timestamps[0] - r.created_time for r in results]
    tpot = [per_token_time(r.timestamps[0], r.timestamps[-1], len(r.timestamps)) for r in results]
    return dict(wall_s=wall, tokens=[list(r.generated_tokens) for r in results], config=settings,
                **latency_summary(ttft, [t for t in tpot if t is not None]))


def make_generator(args, model, tokenizer):
    from hf_paged import ContinuousBatchGenerator, EngineConfig

    sized = dict(kv_cache_memory=args.kv_cache_memory) if args.kv_cache_memory else dict(
        num_blocks=args.kv_tokens // args.block_size)
    eager = dict(enforce_eager=True) if args.enforce_eager else {}
    config = EngineConfig(block_size=args.block_size, **sized, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_batch_tokens, prepack_weights=not args.no_prepack_weights,
                          kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=not args.no_prefix_caching,
                          speculative_config=args.speculative_config, **eager)
    return ContinuousBatchGenerator(model, tokenizer, config)


def run_ours(args, model, tokenizer, workload: dict) -> dict:
    """hf_paged's generator, with a StepRecorder on it for the per-step batch sizes and the KV use at peak."""
    from hf_paged import SamplingParams

    def params(lens):
        return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lens]

    generator = make_generator(args, model, tokenizer)
    if not generator.is_driver:  # another tensor-parallel rank: it steps with rank 0 and reports nothing
        generator.run_worker()
        return {}
    warm = warmup_workload(vocab_ids(tokenizer))
    generator.run(warm["prompts"], params(warm["output_lens"]), use_tqdm=False)
    recorder = StepRecorder(generator)
    start = time.perf_counter()
    outputs = generator.run(workload["prompts"], params(workload["output_lens"]), use_tqdm=False)
    wall = time.perf_counter() - start
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests refused, e.g. {errors[0]}")
    short = sum(len(o.outputs[0].token_ids) != m for o, m in zip(outputs, workload["output_lens"]))
    if short:  # e.g. cut at max_model_len (--kv-tokens): the rows count requested tokens
        raise RuntimeError(f"hf_paged returned the wrong number of tokens for {short} requests")
    metrics = [o.metrics for o in outputs]
    ttft = [m.first_token_time - m.arrival_time for m in metrics]
    tpot = [per_token_time(m.first_token_time, m.finished_time, len(o.outputs[0].token_ids))
            for m, o in zip(metrics, outputs)]
    stats = generator.stats()
    generator.stop_workers()
    cache = generator.kv_storage
    kv_rank = dict(num_blocks=cache.num_blocks, tokens=cache.num_blocks * cache.block_size,
                   num_kv_heads=cache.spec.num_kv_heads,
                   bytes=sum(t.numel() * t.element_size() for t in (*cache.key_cache, *cache.value_cache)))
    return dict(wall_s=wall, kv_per_rank=kv_rank, tokens=[o.outputs[0].token_ids for o in outputs],
                steps=recorder.steps,
                kv=recorder.kv_report(), num_preemptions=stats.num_preemptions,
                prefix_cache_hit_tokens=stats.prefix_cache_hits,
                spec_acceptance_rate=stats.spec_decode_acceptance_rate,
                spec_mean_accepted_length=stats.spec_decode_mean_accepted_length,
                **latency_summary(ttft, [t for t in tpot if t is not None]))


def time_forward(model, batch_size: int, min_seconds: float, vocab: list[int]) -> float:
    """Median seconds of ``model(input_ids [B, 1], use_cache=False)`` over enough repetitions."""
    import torch

    ids = torch.tensor([[vocab[i % len(vocab)]] for i in range(batch_size)], device=model.device)
    times = []
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
        while sum(times) < min_seconds or len(times) < 3:
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - start)
            if len(times) >= 20:
                break
    return percentile(times, 50)


def run_ceiling(args, model, tokenizer, batch_sizes: list[int]) -> dict:
    from hf_paged.kernels.cpu_linear import prepack_linear_layers

    if not args.no_prepack_weights and model.device.type == "cpu":
        prepack_linear_layers(model)
    vocab = vocab_ids(tokenizer)
    min_seconds = 0.2 if args.smoke else 1.0
    return dict(forward_s={str(b): time_forward(model, b, min_seconds, vocab) for b in batch_sizes})


def vocab_ids(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


# ------------------------------------------------------------------------------------------------ subprocesses
def run_worker(args) -> None:
    """Inside an engine subprocess: load the model, run one engine, write its result (and peak RSS) as JSON."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    in_path, out_path = args.worker_io
    job = json.loads(Path(in_path).read_text())
    if args.worker == "ours":
        import hf_paged  # noqa: F401  (registers the "paged" attention)
    if args.worker == "ours" and args.tensor_parallel_size > 1:
        from hf_paged.loading import load_model as load_sharded

        model, tokenizer = load_sharded(args.model, args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    else:
        model, tokenizer = load_model(args.model, args.dtype, "paged" if args.worker == "ours" else "sdpa",
                                      args.round_weights, args.device)
    runners = dict(static=run_static, hf_cb=run_hf_cb, ours=run_ours)
    if args.worker == "ceiling":
        result = run_ceiling(args, model, tokenizer, job["ceiling_batches"])
    else:
        result = runners[args.worker](args, model, tokenizer, job["workload"])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if os.environ.get("RANK", "0") != "0":
        return
    result["peak_rss_mb"] = peak_rss_mb()
    Path(out_path).write_text(json.dumps(result))


def spawn_engine(engine: str, argv: list[str], job: dict, timeout: float) -> dict:
    """Run one engine in a fresh interpreter; returns its result, or ``{"error": ...}`` if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        in_path, out_path = Path(tmp, "job.json"), Path(tmp, "result.json")
        in_path.write_text(json.dumps(job))
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", engine,
               "--worker-io", str(in_path), str(out_path)]
        ranks = int(argv[argv.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in argv else 1
        env = dict(os.environ)
        if engine == "ours" and ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *cmd[1:]]
            if "--threads" in argv:
                env["OMP_NUM_THREADS"] = argv[argv.index("--threads") + 1]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return dict(error=f"timed out after {timeout:.0f} s")
        if proc.returncode != 0 or not out_path.exists():
            return dict(error=f"exit code {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return json.loads(out_path.read_text())


def worker_argv(args) -> list[str]:
    """The parent's settings as command-line flags for a worker (the worker re-parses them)."""
    argv = ["--model", args.model, "--dtype", args.dtype, "--static-batch-size", str(args.static_batch_size),
            "--kv-tokens", str(args.kv_tokens), "--block-size", str(args.block_size),
            "--max-batch-tokens", str(args.max_batch_tokens), "--max-num-seqs", str(args.max_num_seqs)]
    if args.hf_cb_config:
        argv += ["--hf-cb-config", args.hf_cb_config]
    if args.no_prepack_weights:
        argv += ["--no-prepack-weights"]
    if args.no_prefix_caching:
        argv += ["--no-prefix-caching"]
    if args.kv_cache_dtype:
        argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.round_weights:
        argv += ["--round-weights", args.round_weights]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.device != "cpu":
        argv += ["--device", args.device]
    if args.kv_cache_memory:
        argv += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.smoke:
        argv += ["--smoke"]
    if args.speculative_config:
        argv += ["--speculative-config", args.speculative_config]
    if args.enforce_eager:
        argv += ["--enforce-eager"]
    return argv


# ------------------------------------------------------------------------------------------------------ analysis
def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket: 1, 2-3, 4-7, 8-15, ..."""
    return 1 << (batch_size.bit_length() - 1)


def decode_buckets(steps: list) -> dict[int, dict]:
    """Ours' pure-decode steps grouped by batch size: steps, tokens, seconds and the mean batch size of each group."""
    buckets: dict[int, dict] = {}
    for decodes, prefill_tokens, seconds in steps:
        if prefill_tokens or not decodes:
            continue
        b = buckets.setdefault(bucket_of(decodes), dict(steps=0, tokens=0, seconds=0.0))
        b["steps"] += 1
        b["tokens"] += decodes
        b["seconds"] += seconds
    for b in buckets.values():
        b["batch_size"] = round(b["tokens"] / b["steps"])
    return dict(sorted(buckets.items()))


def efficiency_report(steps: list, forward_s: dict) -> dict:
    """Ours' decode tokens/s per batch-size bucket against the bare forward at that bucket's mean batch size.

    Efficiency is time over time: the bucket's steps at the bare forward's step time against ours' seconds (the
    ceiling's tokens/s are the bucket's tokens in that ideal time), so a rounded mean batch size does not skew it.
    """
    rows, ideal, actual, tokens = [], 0.0, 0.0, 0
    for bucket, b in decode_buckets(steps).items():
        t_forward = forward_s.get(str(b["batch_size"]))
        ours = b["tokens"] / b["seconds"]
        ceiling = b["tokens"] / (b["steps"] * t_forward) if t_forward else None
        rows.append(dict(bucket=f"{bucket}-{2 * bucket - 1}", batch_size=b["batch_size"], steps=b["steps"],
                         ours_tok_s=ours, ceiling_tok_s=ceiling, efficiency=ours / ceiling if ceiling else None))
        if t_forward:
            ideal += b["steps"] * t_forward
            actual += b["seconds"]
            tokens += b["tokens"]
    mixed = sum(s for d, p, s in steps if p)
    return dict(buckets=rows, decode_tokens=tokens, ours_decode_tok_s=tokens / actual if actual else None,
                ceiling_decode_tok_s=tokens / ideal if ideal else None,
                efficiency=ideal / actual if actual else None,
                prefill_step_share=mixed / max(1e-9, sum(s for *_, s in steps)))


def dtype_label(settings: dict) -> str:
    """``float32``, ``bfloat16``, or e.g. ``float32+kv-bfloat16`` for a KV cache in another dtype and
    ``float32+weights-bfloat16`` for rounded weights."""
    kv, rounded = settings.get("kv_cache_dtype"), settings.get("round_weights")
    label = settings["dtype"] + (f"+kv-{kv}" if kv and kv != settings["dtype"] else "")
    return label + (f"+weights-{rounded}" if rounded else "")


def compare_runs(report: dict, other: dict) -> None:
    """Each engine in this run against itself in an earlier run (e.g. bf16 against fp32): throughput ratio and
    greedy-token agreement. Transformers' own engines in both runs show how far the dtype alone moves the tokens."""
    mine = {r["engine"]: r.get("output_tok_s") for r in report["rows"]}
    theirs = {r["engine"]: r.get("output_tok_s") for r in other["rows"]}
    label = f"{dtype_label(report['settings'])}/{dtype_label(other['settings'])}"
    for engine in ("ours", "static", "hf_cb"):
        if mine.get(engine) and theirs.get(engine):
            report["ratios"][f"{engine} {label}"] = mine[engine] / theirs[engine]
        a, b = report["tokens"].get(engine), other.get("tokens", {}).get(engine)
        if a and b:
            report["agreement"][f"{engine} {label}"] = agreement(a, b)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Fraction of requests with identical greedy tokens, and the mean share of tokens before the first difference."""
    same, prefix = 0, []
    for x, y in zip(a, b):
        same += x == y
        common = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix.append(common / max(1, len(x)))
    return dict(identical=same / len(a), mean_common_prefix=sum(prefix) / len(prefix))


def throughput_row(engine: str, result: dict, workload: dict) -> dict:
    """The table row of one engine: throughput from the wall time, latencies and RSS from the result."""
    row = dict(engine=engine, error=result.get("error"), peak_rss_mb=result.get("peak_rss_mb"))
    if "wall_s" not in result:
        return row
    wall = result["wall_s"]
    out = sum(workload["output_lens"])
    total = out + sum(len(p) for p in workload["prompts"])
    row.update(wall_s=wall, output_tok_s=out / wall, total_tok_s=total / wall,
               requests_s=len(workload["prompts"]) / wall)
    row.update({k: result.get(k) for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")})
    return row


def workload_summary(workload: dict) -> dict:
    return dict(num_requests=len(workload["prompts"]), prompt_tokens=sum(len(p) for p in workload["prompts"]),
                output_tokens=sum(workload["output_lens"]))


def build_report(args, workload: dict, results: dict) -> dict:
    rows = [throughput_row(e, results[e], workload) for e in args.engines if e != "ceiling"]
    report = dict(settings={k: v for k, v in vars(args).items() if not k.startswith("worker")},
                  workload=workload_summary(workload), rows=rows, ratios={}, agreement={}, kv_memory={})
    ours = results.get("ours", {})
    if "hf_cb" in results and "config" in results["hf_cb"]:
        report["hf_cb_config"] = results["hf_cb"]["config"]
    if "ceiling" in results:
        report["ceiling_forward_s"] = results["ceiling"].get("forward_s")
        eff = efficiency_report(ours.get("steps", []), results["ceiling"].get("forward_s", {}))
        report["decode_efficiency"] = eff
        rows.append(dict(engine="ceiling", error=results["ceiling"].get("error"),
                         peak_rss_mb=results["ceiling"].get("peak_rss_mb"), output_tok_s=eff["ceiling_decode_tok_s"]))
        if eff["efficiency"] is not None:
            report["ratios"]["ours_decode/ceiling"] = eff["efficiency"]
    by_engine = {r["engine"]: r for r in rows}
    if by_engine.get("ours", {}).get("output_tok_s"):
        for peer in ("static", "hf_cb"):
            if by_engine.get(peer, {}).get("output_tok_s"):
                report["ratios"][f"ours/{peer}"] = by_engine["ours"]["output_tok_s"] / by_engine[peer]["output_tok_s"]
    tokens = {e: r["tokens"] for e, r in results.items() if "tokens" in r}
    report["tokens"] = tokens
    for a, b in (("ours", "static"), ("ours", "hf_cb"), ("hf_cb", "static")):
        if a in tokens and b in tokens:
            report["agreement"][f"{a}_vs_{b}"] = agreement(tokens[a], tokens[b])
    for engine in ("ours", "static"):
        if "kv" in results.get(engine, {}):
            report["kv_memory"][engine] = results[engine]["kv"]
    if "kv_per_rank" in ours:
        report["kv_per_rank"] = dict(ours["kv_per_rank"], tensor_parallel_size=args.tensor_parallel_size)
    if "num_preemptions" in ours:
        report["ours_preemptions"] = ours["num_preemptions"]
        report["ours_prefix_cache_hit_tokens"] = ours["prefix_cache_hit_tokens"]
    if ours.get("spec_acceptance_rate") is not None:
        report["ours_spec_decode"] = dict(acceptance_rate=ours["spec_acceptance_rate"],
                                          mean_accepted_length=ours["spec_mean_accepted_length"])
    return report


# ------------------------------------------------------------------------------------------------------ printing
def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(report: dict) -> None:
    w = report["workload"]
    print(f"\n{w['num_requests']} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens")
    if "hf_cb_config" in report:
        print(f"Transformers CB config: {report['hf_cb_config']}")
    header = f"{'engine':<9}{'out tok/s':>10}{'tot tok/s':>10}{'req/s':>7}{'TTFT p50':>9}{'TTFT p99':>9}" \
             f"{'TPOT p50':>10}{'TPOT p99':>10}{'RSS MB':>8}{'wall s':>8}"
    print(header + "\n" + "-" * len(header))
    for r in report["rows"]:
        if r.get("error"):
            print(f"{r['engine']:<9} FAILED: {r['error'][-300:]}")
            continue
        ms = lambda key: fmt(r.get(key) and r[key] * 1000, ".0f")  # noqa: E731
        print(f"{r['engine']:<9}{fmt(r.get('output_tok_s')):>10}{fmt(r.get('total_tok_s')):>10}"
              f"{fmt(r.get('requests_s'), '.2f'):>7}{ms('ttft_p50'):>9}{ms('ttft_p99'):>9}{ms('tpot_p50'):>10}"
              f"{ms('tpot_p99'):>10}{fmt(r.get('peak_rss_mb'), '.0f'):>8}{fmt(r.get('wall_s')):>8}")
    print("(TTFT/TPOT in ms; ceiling = bare forward at ours' decode batch sizes, decode tokens/s only)")
    for name, value in report["ratios"].items():
        print(f"ratio {name}: {value:.2f}x")
    for name, a in report["agreement"].items():
        print(f"greedy agreement {name}: {a['identical']:.0%} of requests identical, "
              f"mean common prefix {a['mean_common_prefix']:.0%}")
    for engine, kv in report["kv_memory"].items():
        of_cache = kv.get("unused_fraction_of_cache")
        print(f"KV at peak ({engine}): {kv['peak_allocated_slots']} slots allocated, {kv['peak_stored_tokens']} tokens "
              f"stored, unused {kv['unused_fraction_of_allocated']:.1%} of allocated"
              + (f", {of_cache:.1%} of the whole cache" if of_cache is not None else ""))
    if "kv_per_rank" in report:
        kv = report["kv_per_rank"]
        print(f"ours KV cache per rank (tensor-parallel size {kv['tensor_parallel_size']}): {kv['num_blocks']} blocks "
              f"= {kv['tokens']} tokens of {kv['num_kv_heads']} KV heads, {kv['bytes'] / 2**20:.1f} MiB")
    if "ours_preemptions" in report:
        print(f"ours: {report['ours_preemptions']} preemptions, {report['ours_prefix_cache_hit_tokens']} prompt tokens "
              "served from the prefix cache")
    if "ours_spec_decode" in report:
        spec = report["ours_spec_decode"]
        print(f"ours speculative decoding: {spec['acceptance_rate']:.0%} of guesses kept, "
              f"{spec['mean_accepted_length']:.2f} tokens per verifying step")
    if report.get("ceiling_forward_s"):
        timings = ", ".join(f"B={b}: {s * 1000:.0f}" for b, s in report["ceiling_forward_s"].items())
        print(f"bare forward [B, 1], ms: {timings}")
    eff = report.get("decode_efficiency")
    if eff and eff["buckets"]:
        print("ours decode vs bare forward, by batch size:")
        for b in eff["buckets"]:
            print(f"  B {b['bucket']:>7} (mean {b['batch_size']:>3}, {b['steps']:>4} steps): ours "
                  f"{fmt(b['ours_tok_s']):>8} tok/s, ceiling {fmt(b['ceiling_tok_s']):>8} tok/s, "
                  f"efficiency {fmt(b['efficiency'], '.0%')}")
        print(f"  mixed prefill steps: {eff['prefill_step_share']:.0%} of ours' step time (not in the efficiency)")


# ------------------------------------------------------------------------------------------ structured outputs
STRUCTURED_PROMPT = [{"role": "user", "content": "Reply with a JSON example."}]


def time_compiles(generator, schemas: list[dict]) -> dict:
    """Seconds to compile each schema on the generator's grammar compiler: first time, then from its cache."""
    from hf_paged import StructuredOutputsParams

    start = time.perf_counter()
    generator.grammars.compile(StructuredOutputsParams(regex="warm-up")).result()  # reads the vocabulary once
    setup, first, cached = time.perf_counter() - start, [], []
    for schema in schemas:
        for times in (first, cached):
            start = time.perf_counter()
            generator.grammars.compile(StructuredOutputsParams(json=schema)).result()
            times.append(time.perf_counter() - start)
    return dict(vocabulary_setup_s=setup, first_p50_s=percentile(first, 50), first_max_s=max(first),
                cached_p50_s=percentile(cached, 50), cached_max_s=max(cached))


def array_of(schema: dict, items: int) -> dict:
    """An array of exactly ``items`` values of ``schema`` (its ``$defs`` moved to the root, where refs point)."""
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    defs = {"$defs": schema["$defs"]} if "$defs" in schema else {}
    return {"type": "array", "items": inner, "minItems": items, "maxItems": items, **defs}


class GrammarClock:
    """Times the structured-output work of the engine (bitmask filling, masking, matchers accepting tokens) while
    ``counting``: its share of a run's time is the overhead, measured in the same moments as the run, which a shared
    machine's drift between runs cannot blur."""

    def __init__(self):
        from hf_paged.generation import sampler
        from hf_paged.generation.structured_outputs import GrammarMatcher

        self.seconds, self.on = 0.0, False
        for owner, name in ((sampler, "fill_bitmask"), (sampler, "apply_bitmask"), (GrammarMatcher, "advance")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += (time.perf_counter() - start) if self.on else 0.0

        return timed

    @contextlib.contextmanager
    def counting(self, on: bool):
        self.on = on
        try:
            yield
        finally:
            self.on = False


def timed_run(generator, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = generator.run(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def run_structured(args) -> dict:
    """--structured json: the same requests with and without their JSON-schema constraint, on one generator."""
    import torch

    from hf_paged import SamplingParams, StructuredOutputsParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from structured_schemas import SCHEMAS

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, args.dtype, "paged", args.round_weights, args.device)
    generator = make_generator(args, model, tokenizer)
    compile_times = time_compiles(generator, SCHEMAS)  # before the run's schemas: none of them is cached yet
    schemas = [array_of(SCHEMAS[i % len(SCHEMAS)], args.structured_items) for i in range(args.num_requests)]
    prompts = [STRUCTURED_PROMPT] * len(schemas)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_output,
                                  structured_outputs=StructuredOutputsParams(json=schema))
                   for i, schema in enumerate(schemas)]
    generator.run(prompts[:4], constrained[:4], use_tqdm=False)  # warm-up
    _, outputs = timed_run(generator, prompts, constrained)
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests refused, e.g. {errors[0]}")
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    valid = sum(o.outputs[0].finish_reason == "stop" and _parses(o.outputs[0].text) for o in outputs)
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    seconds, grammar_clock = dict(free=[], constrained=[]), GrammarClock()
    for _ in range(args.rounds):
        for name, params in (("free", free), ("constrained", constrained)):
            with grammar_clock.counting(name == "constrained"):
                wall, outputs = timed_run(generator, prompts, params)
            if [len(o.outputs[0].token_ids) for o in outputs] != lengths:
                raise RuntimeError(f"the {name} run produced other output lengths than the first constrained run")
            seconds[name].append(wall)
    tok_s = {name: sum(lengths) / min(walls) for name, walls in seconds.items()}
    return dict(settings={k: v for k, v in vars(args).items() if not k.startswith("worker")},
                grammar_share=grammar_clock.seconds / sum(seconds["constrained"]),
                num_requests=len(schemas), output_tokens=sum(lengths), valid_json=valid / len(schemas),
                seconds=seconds, output_tok_s=tok_s, ratio=tok_s["constrained"] / tok_s["free"],
                compile=compile_times, num_schemas=len(SCHEMAS))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def print_structured(report: dict) -> None:
    c = report["compile"]
    print(f"\n{report['num_requests']} JSON-schema requests at once ({report['num_schemas']} schemas), "
          f"{report['output_tokens']} output tokens; {report['valid_json']:.0%} ended as valid JSON")
    for name, tok_s in report["output_tok_s"].items():
        rounds = ", ".join(f"{s:.2f}" for s in report["seconds"][name])
        print(f"{name:<12} {tok_s:8.1f} output tok/s (best of rounds: {rounds} s)")
    print(f"ratio constrained/free: {report['ratio']:.1%}; bitmask filling, masking and matcher updates took "
          f"{report['grammar_share']:.1%} of the constrained runs' time")
    print(f"grammar compile per schema: first p50 {c['first_p50_s'] * 1000:.1f} ms (max {c['first_max_s'] * 1000:.1f}),"
          f" cached p50 {c['cached_p50_s'] * 1e6:.0f} us (max {c['cached_max_s'] * 1e6:.0f}); importing xgrammar and "
          f"reading the vocabulary {c['vocabulary_setup_s'] * 1000:.0f} ms once")


# ---------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return None
    from transformers import AutoTokenizer

    from hf_paged.default_model import resolve_model

    args.model = resolve_model(args.model)
    if args.structured:
        report = run_structured(args)
        print_structured(report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return report
    workload = make_workload(args, AutoTokenizer.from_pretrained(args.model))
    earlier = json.loads(Path(args.compare_with).read_text()) if args.compare_with else None
    if earlier is not None and earlier["workload"] != workload_summary(workload):
        raise SystemExit(f"--compare-with {args.compare_with} ran another workload ({earlier['workload']}, this one "
                         f"{workload_summary(workload)}): give the same model, seed, request count and lengths")
    job = dict(workload=workload, ceiling_batches=[])
    results = {}
    for engine in [e for e in ENGINES if e in args.engines]:
        if engine == "ceiling":
            buckets = decode_buckets(results.get("ours", {}).get("steps", []))
            job["ceiling_batches"] = sorted({b["batch_size"] for b in buckets.values()}) or [1, 2, 4, 8, 16, 32]
        print(f"running {engine} ...", file=sys.stderr, flush=True)
        results[engine] = spawn_engine(engine, worker_argv(args), job, args.engine_timeout)
    report = build_report(args, workload, results)
    if earlier is not None:
        compare_runs(report, earlier)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
