"""The benchmark scripts run end to end in their quick modes and report sane results (nothing here is timed).

Both run as subprocesses, exactly as a person would run them; they inherit ``TRITON_INTERPRET=1`` from conftest when
there is no GPU.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ENGINES = {"static", "hf_cb", "ours", "ceiling"}


def run_script(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=BENCHMARKS.parent)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


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

    # The same workload with a bf16 KV cache, compared with the run above.
    again = tmp_path / "kv_bf16.json"
    run_script("throughput.py", "--smoke", "--model", smollm2_path, "--engines", "ours", "--kv-cache-dtype",
               "bfloat16", "--compare-with", str(out), "--json", str(again), timeout=300)
    compared = json.loads(again.read_text())
    assert compared["ratios"]["ours float32+kv-bfloat16/float32"] > 0
    assert 0 <= compared["agreement"]["ours float32+kv-bfloat16/float32"]["identical"] <= 1


def test_kernels_smoke_is_correct(tmp_path):
    out = tmp_path / "kernels.json"
    proc = run_script("kernels.py", "--smoke", "--json", str(out), timeout=300)
    report = json.loads(out.read_text())

    assert report["all_correct"] and "all checked points correct" in proc.stdout
    checked = [row for row in report["rows"] if row.get("rel_err") is not None]
    assert {row["kind"] for row in checked} == {"decode", "prefill"}
    assert all(row["triton_ms"] > 0 and row["sdpa_ms"] > 0 for row in report["rows"])
