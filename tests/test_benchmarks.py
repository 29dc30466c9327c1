"""The benchmark scripts run end to end in their quick modes and report sane results (nothing here is timed).

Both run as subprocesses, exactly as a person would run them; they inherit ``TRITON_INTERPRET=1`` from conftest when
there is no GPU.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ENGINES = {"static", "hf_cb", "ours", "ceiling"}


def run_script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def saved_tiny_model(smollm2_path: str, tmp_path: Path) -> str:
    """A tiny random-weight model with SmolLM2's tokenizer, saved under ``tmp_path``: its directory."""
    from live_server import tiny_model

    model, tokenizer = tiny_model(smollm2_path)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def test_the_script_without_a_smoke_run_starts():
    """The other scripts run below (chaos.py is serve_load's); this one starts and explains itself (its import order
    once broke it: ``benchmarks/kernels.py`` shadowed the package Transformers probes for)."""
    assert "usage:" in run_script("random_heads_model.py", "--help", timeout=120).stdout


@pytest.mark.slow
def test_throughput_smoke_reports_every_engine(smollm2_path, tmp_path):
    out = tmp_path / "throughput.json"
    proc = run_script("throughput.py", "--smoke", "--model", smollm2_path, "--json", str(out), timeout=300)
    report = json.loads(out.read_text())

    rows = {row["engine"]: row for row in report["rows"]}
    assert set(rows) == ENGINES
    for engine, row in rows.items():
        assert row["error"] is None, f"{engine}: {row['error']}"
        assert row["output_tok_s"] > 0, engine
        assert row["peak_rss_mb"] > 0, engine
    for engine in ENGINES - {"ceiling"}:
        assert rows[engine]["total_tok_s"] > rows[engine]["output_tok_s"] > 0
        assert rows[engine]["ttft_p50"] > 0 and rows[engine]["tpot_p50"] > 0
    assert report["agreement"]["ours_vs_static"]["identical"] >= 0.8
    assert 0 <= report["kv_memory"]["ours"]["unused_fraction_of_cache"] < 1
    assert report["decode_efficiency"]["efficiency"] > 0
    assert "Transformers CB config" in proc.stdout and "ours" in proc.stdout

    # The same workload with a bf16 KV cache and bf16-rounded weights, compared with the run above.
    again = tmp_path / "kv_bf16.json"
    run_script("throughput.py", "--smoke", "--model", smollm2_path, "--engines", "ours", "--kv-cache-dtype",
               "bfloat16", "--round-weights", "bfloat16", "--compare-with", str(out), "--json", str(again),
               timeout=300)
    compared = json.loads(again.read_text())
    label = "ours float32+kv-bfloat16+weights-bfloat16/float32"
    assert compared["ratios"][label] > 0
    assert 0 <= compared["agreement"][label]["identical"] <= 1
    # Another workload cannot be compared request by request: refused before any engine runs.
    other = subprocess.run([sys.executable, str(BENCHMARKS / "throughput.py"), "--smoke", "--model", smollm2_path,
                            "--num-requests", "3", "--compare-with", str(out)], capture_output=True, text=True,
                           timeout=120)
    assert other.returncode != 0 and "ran another workload" in other.stderr
    # The input-grounded chat workload, with speculative decoding.
    grounded = tmp_path / "grounded.json"
    run_script("throughput.py", "--smoke", "--model", smollm2_path, "--engines", "ours", "--workload", "grounded",
               "--min-output", "24", "--max-output", "24", "--speculative-config", '{"method": "ngram"}',
               "--json", str(grounded), timeout=300)
    report = json.loads(grounded.read_text())
    assert report["rows"][0]["error"] is None and report["rows"][0]["output_tok_s"] > 0
    assert report["settings"]["workload"] == "grounded" and report["workload"]["prompt_tokens"] > 6 * 32


@pytest.mark.slow
def test_throughput_structured_reports_both_variants_and_compile_times(smollm2_path, tmp_path):
    out = tmp_path / "structured.json"
    proc = run_script("throughput.py", "--structured", "json", "--smoke", "--model", smollm2_path, "--num-requests",
                      "3", "--structured-items", "1", "--rounds", "1", "--max-output", "200", "--json", str(out),
                      timeout=300)
    report = json.loads(out.read_text())
    assert report["valid_json"] == 1 and report["output_tokens"] > 3
    assert report["output_tok_s"]["free"] > 0 and report["output_tok_s"]["constrained"] > 0
    assert 0 < report["grammar_share"] < 1
    assert 0 < report["compile"]["cached_p50_s"] < report["compile"]["first_max_s"]
    assert "ratio constrained/free" in proc.stdout


@pytest.mark.slow
def test_outputs_cut_short_are_an_error_not_a_speed(smollm2_path, tmp_path):
    """A cache too small for the requested lengths cuts ours' outputs at max_model_len: the row must say so instead
    of counting tokens that were never made."""
    out = tmp_path / "short.json"
    run_script("throughput.py", "--smoke", "--model", smollm2_path, "--engines", "ours", "--kv-tokens", "32",
               "--min-prompt", "20", "--max-prompt", "24", "--min-output", "12", "--max-output", "12",
               "--json", str(out), timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert "wrong number of tokens" in row["error"] and "output_tok_s" not in row


@pytest.mark.slow
def test_serve_load_smoke_drives_a_real_server(smollm2_path, tmp_path):
    out = tmp_path / "serve_load.json"
    run_script("serve_load.py", "--start-server", "--offline", "--model", smollm2_path, "--clients", "3",
               "--requests", "5", "--max-tokens", "6", "--json", str(out), timeout=300)
    report = json.loads(out.read_text())
    for mode in ("http", "offline"):
        assert report[mode]["failures"] == 0 and report[mode]["errors"] == []
        assert 0 < report[mode]["completion_tokens"] <= 5 * 6
        assert report[mode]["tokens_per_s"] > 0 and report[mode]["ttft_p50_s"] > 0
    assert report["http_over_offline"] > 0


def test_embeddings_benchmark_compares_with_transformers(smollm2_path):
    """Both sides embed the same inputs: their vectors agree, and the ratio is printed."""
    proc = run_script("embeddings.py", "--model", smollm2_path, "--num-inputs", "12", "--max-words", "20", "--rounds",
                      "1", timeout=300)
    summary = re.search(r"= ([\d.]+)x; largest vector difference ([\d.e+-]+)", proc.stdout)
    assert summary, proc.stdout
    assert float(summary.group(1)) > 0 and float(summary.group(2)) < 1e-4


def test_lora_benchmark_compares_with_peft(smollm2_path):
    """The three sides run the same requests: hf_paged's answers under adapters are PEFT's, and the ratios print."""
    pytest.importorskip("peft")
    proc = run_script("lora.py", "--model", smollm2_path, "--num-requests", "4", "--num-adapters", "2", "--base-share",
                      "3", "--rank", "4", "--max-tokens", "6", "--rounds", "1", timeout=300)
    summary = re.search(r"hf_paged / peft = ([\d.]+)x, hf_paged / hf_paged base = ([\d.]+)x; (\d+) of 4 answers",
                        proc.stdout)
    assert summary, proc.stdout
    assert float(summary.group(1)) > 0 and float(summary.group(2)) > 0 and int(summary.group(3)) >= 3


def test_beam_search_benchmark_compares_with_transformers(smollm2_path):
    """Both sides search the same prompts: the beams agree (unpadded prompts of one length round alike), the ratio
    prints."""
    proc = run_script("beam_search.py", "--model", smollm2_path, "--num-requests", "3", "--beam-width", "3",
                      "--max-tokens", "6", "--rounds", "1", timeout=300)
    summary = re.search(r"hf_paged / transformers = ([\d.]+)x; (\d+) of 3 prompts' beams identical", proc.stdout)
    assert summary, proc.stdout
    assert float(summary.group(1)) > 0 and int(summary.group(2)) >= 2


def load_benchmark(name: str):
    """A benchmark script as a module (its ``common`` helper first, as the script expects); sys.path is restored."""
    saved_path, modules = list(sys.path), {}
    try:
        for module_name in ("common", name):
            spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{module_name}.py")
            modules[module_name] = sys.modules[module_name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[module_name])
    finally:
        sys.path[:] = saved_path
        for module_name in modules:
            sys.modules.pop(module_name, None)
    return modules[name]


def test_round_parameters_leaves_only_representable_values():
    from tiny_models import tiny_model

    throughput = load_benchmark("throughput")
    model, _ = tiny_model("llama")
    before = {name: p.clone() for name, p in model.named_parameters()}
    throughput.round_parameters(model, torch.bfloat16)
    changed = 0
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32
        torch.testing.assert_close(param, param.to(torch.bfloat16).float(), rtol=0, atol=0)
        torch.testing.assert_close(param, before[name], rtol=2**-8, atol=0)
        changed += not torch.equal(param, before[name])
    assert changed > 0


def test_bucket_efficiency_agrees_with_the_overall_one():
    """Steps of 2 and 3 sequences at the 2-sequence forward time: ours ran exactly as fast as the ceiling's steps."""
    throughput = load_benchmark("throughput")
    report = throughput.efficiency_report([(2, 0, 0.1), (3, 0, 0.1), (1, 8, 0.5)], {"2": 0.1})
    (bucket,) = report["buckets"]
    assert bucket["efficiency"] == pytest.approx(1.0) == report["efficiency"]
    assert bucket["ceiling_tok_s"] == pytest.approx(25.0) == report["ceiling_decode_tok_s"]
    assert report["prefill_step_share"] == pytest.approx(0.5 / 0.7)


def test_kernels_smoke_is_correct(tmp_path):
    out = tmp_path / "kernels.json"
    proc = run_script("kernels.py", "--smoke", "--json", str(out), timeout=300)
    report = json.loads(out.read_text())

    assert report["all_correct"] and "all checked points correct" in proc.stdout
    checked = [row for row in report["rows"] if row.get("rel_err") is not None]
    assert {row["kind"] for row in checked} == {"decode", "prefill"}
    assert all(row["triton_ms"] > 0 and row["sdpa_ms"] > 0 for row in report["rows"])


def test_cpu_attention_smoke_times_every_kernel_and_checks_it(tmp_path):
    out = tmp_path / "cpu_attention.json"
    proc = run_script("cpu_attention.py", "--smoke", "--json", str(out), timeout=120)
    report = json.loads(out.read_text())
    from hf_paged.kernels import cpu_ops

    assert report["all_correct"] and "all correct" in proc.stdout
    assert report["tiles"] == cpu_ops.tile_attention(torch.bfloat16, 64)
    kernels = {"rows", "sdpa"} | ({"tiles"} if report["tiles"] else set())
    for row in report["rows"]:
        assert {k[:-3] for k in row if k.endswith("_ms")} == kernels
        assert all(row[f"{k}_ms"] > 0 and row[f"{k}_err"] < 2e-2 for k in kernels)


def test_mix_draws_each_group_in_its_own_ranges():
    throughput = load_benchmark("throughput")
    args = throughput.parse_args(["--mix", "3:8-16:4-8,2:100-120:50-60", "--seed", "5"])
    assert args.num_requests == 5 and args.max_prompt == 120
    workload = throughput.make_workload(args, _Tokenizer())
    pairs = sorted(zip(map(len, workload["prompts"]), workload["output_lens"]))
    assert all(8 <= p <= 16 and 4 <= o <= 8 for p, o in pairs[:3])
    assert all(100 <= p <= 120 and 50 <= o <= 60 for p, o in pairs[3:])
    for bad in ("3:8-16", "0:8-16:4-8", "2:16-8:4-8"):
        with pytest.raises(SystemExit):
            throughput.parse_args(["--mix", bad])


class _Tokenizer:
    """Token ids for the benchmark's paragraph: one per character."""

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": [ord(c) for c in text]})


def test_decode_reads_llama_batched_bench_tables():
    decode = load_benchmark("decode")
    table = """|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.125 |  1025.95 |    1.648 |    77.69 |    1.772 |   144.44 |
|   128 |    128 |    4 |   1024 |    0.433 |  1182.15 |    2.479 |   206.53 |    2.912 |   351.63 |"""
    assert decode.decode_speeds(table) == {1: 77.69, 4: 206.53}


@pytest.mark.slow
def test_decode_puts_every_variant_side_by_side(smollm2_path, tmp_path):
    """A tiny model, one round: ours, ours with --enforce-eager, this checkout again as the baseline, and generate."""
    tiny = saved_tiny_model(smollm2_path, tmp_path)
    out = tmp_path / "decode.json"
    proc = run_script("decode.py", "--model", tiny, "--batch-sizes", "2", "--dtypes", "float32",
                      "--rounds", "1", "--prompt", "8", "--output", "6", "--threads", "1",
                      "--baseline", str(BENCHMARKS.parent), "--json", str(out), timeout=300)
    cells = json.loads(out.read_text())["results"]["float32"]["2"]
    assert set(cells) == {"ours", "eager", "baseline", "generate"}  # llama.cpp needs --llama-bench and --gguf
    assert all(len(speeds) == 1 and speeds[0] > 0 for speeds in cells.values())
    assert "ours/baseline" in proc.stdout and "ours/generate" in proc.stdout


@pytest.mark.slow
def test_speculation_compares_both_variants_in_one_process(smollm2_path, tmp_path):
    """Two grounded requests one at a time, with and without prompt lookup: the same greedy tokens, guesses kept."""
    out = tmp_path / "speculation.json"
    proc = run_script("speculation.py", "--model", smollm2_path, "--workload", "grounded", "--num-requests", "2",
                      "--min-prompt", "48", "--max-prompt", "48", "--min-output", "24", "--max-output", "24",
                      "--rounds", "2", "--threads", "1", "--speculative-config", '{"method": "ngram"}',
                      "--json", str(out), timeout=300)
    report = json.loads(out.read_text())
    assert report["identical"] == 2
    assert len(report["ratios"]) == 2 and all(r > 0 for r in report["ratios"])
    assert all(len(speeds) == 2 and min(speeds) > 0 for speeds in report["output_tok_s"].values())
    # Decode time leaves each request's prompt and first token out of its wall time.
    for name, seconds in report["decode_seconds"].items():
        assert all(0 < d < w for d, w in zip(seconds, report["seconds"][name]))
        assert all(s > 0 for s in report["decode_tok_s"][name])
    assert len(report["decode_ratios"]) == 2 and report["decode_ratio_median"] > 0
    assert 0 < report["acceptance_rate"] <= 1 and report["tokens_per_verification"] > 1
    assert report["settings"]["no_prefix_caching"] is True
    assert "ratio on/off" in proc.stdout and "decode tok/s" in proc.stdout and "identical: 2 of 2" in proc.stdout


def test_mixed_load_times_chats_behind_a_long_prompt_for_every_variant(smollm2_path, tmp_path):
    """A tiny model, one round: this checkout and the same under another option, each a fresh process."""
    tiny = saved_tiny_model(smollm2_path, tmp_path)
    out = tmp_path / "mixed.json"
    proc = run_script("mixed_load.py", "--model", tiny, "--long-prompt", "96", "--chats", "2",
                      "--chat-output", "5", "--first-chat-at", "0", "--interval", "0.01", "--rounds", "1",
                      "--threads", "1", "--variant", 'uncapped={"long_prefill_token_threshold": 0}',
                      "--json", str(out), timeout=300)
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"ours", "uncapped"}
    for (figures,) in report["results"].values():
        assert 0 < figures["chat_ttft_p50"] <= figures["chat_ttft_max"] <= figures["wall"]
        assert 0 < figures["long_ttft"] <= figures["wall"] and figures["chat_gap_max"] > 0
    assert "ttft p50 / ours" in proc.stdout and "uncapped" in proc.stdout


def test_mixed_load_runs_the_baseline_trees_own_code(tmp_path):
    """``--baseline`` runs the hf_paged of the tree it names, not this checkout's (a tree that cannot be imported
    fails the run, naming it); a variant's options must be a JSON object."""
    (tmp_path / "hf_paged").mkdir()
    (tmp_path / "hf_paged" / "__init__.py").write_text("raise ImportError('the baseline tree was imported')\n")
    mixed_load = load_benchmark("mixed_load")
    args = mixed_load.parse_args(["--baseline", str(tmp_path), "--threads", "1"])
    with pytest.raises(RuntimeError, match="the baseline tree was imported"):
        mixed_load.run_variant(args, *args.variants["baseline"])
    for bad in ("x", "x=[1]", "x={1:", "={}"):
        with pytest.raises(SystemExit):
            mixed_load.parse_args(["--variant", bad])


@pytest.mark.slow
def test_native_ab_times_each_build_of_the_decoder(smollm2_path, tmp_path):
    """Two builds of the decoder (the package's source, once with an extra flag) taking turns on a tiny model."""
    from hf_paged.kernels import native

    if native.compiler() is None:
        pytest.skip("no C++ compiler: there is no native decoder to build")
    tiny = saved_tiny_model(smollm2_path, tmp_path)
    source = str(BENCHMARKS.parent / "hf_paged" / "kernels" / "cpu_decoder.cpp")
    out = tmp_path / "ab.json"
    proc = run_script("native_ab.py", source, f"{source}@-DNDEBUG", "--model", tiny,
                      "--dtypes", "float32", "--batch-sizes", "1,3", "--prompt", "8", "--output", "6", "--threads", "1",
                      "--json", str(out), timeout=300)
    steps = json.loads(out.read_text())["median_step_s"]["float32"]
    assert set(steps) == {"1", "3"} and all(len(medians) == 2 and min(medians) > 0 for medians in steps.values())
    assert "float32 B=3:" in proc.stdout


def test_the_step_recorder_counts_verifying_steps_as_decodes(smollm2):
    """A sequence checking k guesses computes 1 + k tokens: a decode, not a prompt, in the efficiency figures."""
    from hf_paged import ContinuousBatchGenerator, SamplingParams

    throughput = load_benchmark("throughput")
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64,
                                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    recorder = throughput.StepRecorder(gen)
    prompt = tokenizer("one two three four five six one two three four five six one two three").input_ids
    gen.run([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert gen.stats().spec_decode_num_drafts > 0
    assert sum(prefill for _, prefill, _ in recorder.steps) == len(prompt)
    assert all(decodes == 1 for decodes, _, _ in recorder.steps[1:])
