"""Load test for any OpenAI-compatible server: N concurrent streaming chat clients, greedy, with usage.

    # against a running server
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1 --clients 64 --max-tokens 128
    # start `hf-paged serve` here, load it, then run the same requests offline for the HTTP/offline ratio
    python benchmarks/serve_load.py --start-server --offline --clients 64 --json results.json
    # the same load on `hf-paged serve-ray` with 2 replicas on a local Ray
    python benchmarks/serve_load.py --start-server --ray-replicas 2 --clients 64

    # chaos: a third of the clients disconnect, some read slowly, bad inputs, /health timed (see chaos.py)
    python benchmarks/serve_load.py --start-server --chaos --clients 64 --json chaos.json

Each client sends one request (``--requests`` to send more, ``--clients`` at a time). Prints completion tokens/s,
TTFT p50/p99 (first content token, seen by the client), wall time and failures. ``--offline`` runs the same
requests through a `ContinuousBatchGenerator` in this process, with the same engine options as ``--start-server``
and at most ``--clients`` requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field


import httpx
from chaos import run_chaos  # imports common first, as every script here must
from common import percentile

PROMPTS = [
    "What is the capital of France?",
    "Explain how a rainbow forms.",
    "Write a short poem about the ocean.",
    "What are three benefits of regular exercise?",
    "How does a computer store numbers?",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "Why do leaves change color in autumn?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "Describe how to make a paper airplane.",
    "What causes the seasons on Earth?",
    "List some tips for staying focused while studying.",
    "How do vaccines work?",
    "Tell me a fun fact about octopuses.",
    "What is photosynthesis?",
    "Explain what an algorithm is to a child.",
]


@dataclass
class Summary:
    """The numbers of one run."""

    mode: str
    requests: int
    failures: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    errors: list[str] = field(default_factory=list)

    def show(self) -> None:
        ttft = "n/a" if self.ttft_p50_s is None else \
            f"p50 {self.ttft_p50_s * 1000:.0f} ms, p99 {self.ttft_p99_s * 1000:.0f} ms"
        print(f"[{self.mode}] {self.requests} requests, {self.failures} failed, {self.completion_tokens} completion "
              f"tokens in {self.wall_s:.2f} s -> {self.tokens_per_s:.1f} tokens/s; TTFT {ttft}")
        for error in self.errors[:5]:
            print(f"[{self.mode}]   error: {error}")


def summarize(mode: str, results: list[tuple[int, float | None, str | None]], wall: float) -> Summary:
    tokens = sum(r[0] for r in results)
    ttfts = [r[1] for r in results if r[1] is not None and r[2] is None]
    errors = [r[2] for r in results if r[2] is not None]
    return Summary(mode, len(results), len(errors), tokens, wall, tokens / wall if wall else 0.0,
                   percentile(ttfts, 50), percentile(ttfts, 99), errors)


# ------------------------------------------------------------------------------------------------------ HTTP
async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, float | None, str | None]:
    """Stream one chat completion: (completion tokens, TTFT, error)."""
    start, ttft, tokens = time.perf_counter(), None, 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return 0, None, f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    return tokens, ttft, chunk["error"].get("message", "error")
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
    except httpx.HTTPError as err:
        return tokens, ttft, repr(err)
    return tokens, ttft, None


async def run_http(base_url: str, model: str | None, prompts: list[str], max_tokens: int, clients: int,
                   api_key: str | None) -> Summary:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as client:
        if model is None:
            model = (await client.get(f"{base_url}/models")).json()["data"][0]["id"]
        url = f"{base_url}/chat/completions"

        def body(prompt: str, tokens: int) -> dict:
            return {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                    "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}

        await one_request(client, url, body("Hello!", 4))  # warm-up, not counted
        gate = asyncio.Semaphore(clients)

        async def limited(prompt: str):
            async with gate:
                return await one_request(client, url, body(prompt, max_tokens))

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return summarize(f"http {base_url}", results, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------------- offline
def run_offline(args: argparse.Namespace, prompts: list[str]) -> Summary:
    """The same requests through a `ContinuousBatchGenerator` in this process."""
    from hf_paged import SamplingParams
    from hf_paged.cli import build_parser, load_generator

    parser = build_parser()
    engine_args = parser.parse_args(["serve", *engine_argv(args)])
    generator = load_generator(engine_args.command_parser, engine_args)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def timed_run() -> tuple[list, float]:
        """At most --clients requests in flight, as over HTTP; each one's TTFT counts from its submission."""
        generator.run([[{"role": "user", "content": "Hello!"}]], params.replace(max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        waiting, live, finished = list(enumerate(chats)), {}, {}
        while waiting or live:
            while waiting and len(live) < args.clients:
                index, chat = waiting.pop(0)
                live[generator.add_request(chat, params)] = index
            for output in generator.step():
                if output.finished:
                    finished[live.pop(output.request_id)] = output
        return [finished[i] for i in range(len(chats))], time.perf_counter() - start

    # On a worker thread, as the server's engine runs: on a busy CPU, torch's intra-op threads can make the very
    # same steps several times slower from the main thread than from any other one.
    with ThreadPoolExecutor(1) as pool:
        outputs, wall = pool.submit(timed_run).result()
    results = [(sum(len(o.token_ids) for o in out.outputs),
                out.metrics.first_token_time - out.metrics.arrival_time if out.metrics.first_token_time else None,
                out.error) for out in outputs]
    return summarize("offline", results, wall)


# ---------------------------------------------------------------------------------------------------- server
def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options shared by ``--start-server`` and ``--offline``, as `hf-paged` arguments."""
    argv = [args.model] if args.model else []
    argv += ["--dtype", args.dtype]
    if args.num_blocks is not None:
        argv += ["--num-blocks", str(args.num_blocks)]
    if args.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", args.kv_cache_memory]
    return argv


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve = ["serve-ray", "--num-replicas", str(args.ray_replicas)] if args.ray_replicas else ["serve"]
    command = [sys.executable, "-m", "hf_paged.cli", *serve, *engine_argv(args), "--port", str(port),
               "--log-level", "warning"]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with code {process.returncode}; see --server-log")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, f"{base}/v1"
        except httpx.HTTPError:
            time.sleep(0.5)
    process.terminate()
    raise SystemExit("the server did not come up within 300 s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Concurrent streaming chat load on an OpenAI-compatible server.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="server to load (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None, help="model field to send (default: ask /v1/models)")
    parser.add_argument("--api-key", default=None, help="bearer key for the server")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default: 64)")
    parser.add_argument("--requests", type=int, default=None, help="requests in all (default: one per client)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default: 128)")
    parser.add_argument("--start-server", action="store_true", help="run `hf-paged serve` on a free port and load it")
    parser.add_argument("--ray-replicas", type=int, default=0, metavar="N",
                        help="with --start-server, run `hf-paged serve-ray --num-replicas N` on a local Ray instead")
    parser.add_argument("--offline", action="store_true",
                        help="also run the same requests offline in this process, and print the HTTP/offline ratio")
    parser.add_argument("--model", default=None,
                        help="model directory for --start-server/--offline (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32", help="dtype for --start-server/--offline (default: float32)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks for --start-server/--offline")
    parser.add_argument("--kv-cache-memory", default=None, help="KV cache size for --start-server/--offline")
    parser.add_argument("--server-log", default=None, help="file for the started server's output")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the numbers as JSON to PATH")
    parser.add_argument("--chaos", action="store_true",
                        help="instead of the load, the chaos run: disconnects, slow readers, bad inputs, /health timed")
    parser.add_argument("--seed", type=int, default=0, help="the chaos run's random choices (default: 0)")
    parser.add_argument("--health-p99-ms", type=float, default=100.0,
                        help="the chaos run fails if /health's p99 is slower (default: 100)")
    parser.add_argument("--rss-growth-mb", type=float, default=256.0,
                        help="the chaos run fails if the started server's RSS grows more (default: 256)")
    args = parser.parse_args(argv)
    if args.chaos:
        chaos_main(args)
        return
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests or args.clients)]

    report: dict = {"clients": args.clients, "requests": len(prompts), "max_tokens": args.max_tokens}
    process, base_url = start_server(args) if args.start_server else (None, args.base_url)
    try:
        http = asyncio.run(run_http(base_url, args.served_model_name, prompts, args.max_tokens, args.clients,
                                    args.api_key))
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    http.show()
    report["http"] = asdict(http)
    if args.offline:
        offline = run_offline(args, prompts)
        offline.show()
        report["offline"] = asdict(offline)
        if offline.tokens_per_s:
            report["http_over_offline"] = http.tokens_per_s / offline.tokens_per_s
            print(f"HTTP throughput is {100 * report['http_over_offline']:.1f}% of offline")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def chaos_main(args: argparse.Namespace) -> None:
    process, base_url = start_server(args) if args.start_server else (None, args.base_url)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.served_model_name or httpx.get(f"{base_url}/models", timeout=30,
                                                    headers=headers).json()["data"][0]["id"]
        report = run_chaos(base_url, model, args.clients, args.max_tokens, PROMPTS, args.seed,
                           process.pid if process else None, args.api_key)
        report.engine_alive = report.engine_alive and (process is None or process.poll() is None)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    report.show()
    failures = report.failures(args.health_p99_ms, args.rss_growth_mb)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(report), "failures": failures}, f, indent=2)
    for failure in failures:
        print(f"[chaos] FAILED: {failure}")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
