"""The chaos run of ``serve_load.py --chaos``: concurrent streaming clients that misbehave, against a live server.

A third of the clients disconnect at a random moment (some before the first event), some read very slowly, a few
send malformed, oversized or invalid requests, while a background client times ``/health``. Afterwards every
completed greedy answer is compared with the same request served alone, and the server must be alive with no KV
block in use (``/metrics``) and, when its process is known, an RSS that grew by less than the bound.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
from common import percentile

BAD_INPUTS = [  # (what, content, headers): each must get a 4xx in OpenAI's error shape
    ("malformed JSON", b'{"messages": [{"role": "user", "content": "hi"}', {}),
    ("oversized body", b'{"messages": "' + b"x" * (6 << 20) + b'"}', {}),
    ("negative temperature", {"temperature": -1}, {}),
    ("a hundred stop strings", {"stop": [f"s{i}" for i in range(100)]}, {}),
    ("n of a million", {"n": 10**6}, {}),
    ("tokens outside the vocabulary", {"logit_bias": {"999999999": 5}}, {}),
    ("no messages", {"messages": []}, {}),
    ("a prompt of 4 MB", {"messages": [{"role": "user", "content": "a " * (2 << 20)}]}, {}),
    ("wrong content type", b"hello", {"Content-Type": "text/plain"}),
    ("unknown model", {"model": "gpt-nope"}, {}),
]


@dataclass
class ChaosReport:
    clients: int
    served: int = 0  # streams that completed
    disconnects: int = 0  # clients that left mid-stream
    slow_readers: int = 0
    bad_inputs: int = 0
    refused_busy: int = 0  # 503s from admission control: allowed, counted
    compared: int = 0  # completed answers compared with the same request served alone
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # anything a well-behaved server would not answer
    health_checks: int = 0
    health_p50_ms: float | None = None
    health_p99_ms: float | None = None
    health_max_ms: float | None = None
    kv_cache_usage_after: float | None = None
    requests_running_after: float | None = None
    engine_alive: bool = False
    rss_before_mb: float | None = None
    rss_after_mb: float | None = None
    wall_s: float = 0.0

    def show(self) -> None:
        print(f"[chaos] {self.clients} clients: {self.served} served, {self.disconnects} disconnects survived, "
              f"{self.slow_readers} slow readers, {self.bad_inputs} bad inputs tried, {self.refused_busy} refused "
              f"busy, in {self.wall_s:.1f} s")
        print(f"[chaos] {self.compared} answers compared with the same request alone: {len(self.mismatches)} differ")
        print(f"[chaos] /health: {self.health_checks} checks, p50 {self.health_p50_ms:.1f} ms, p99 "
              f"{self.health_p99_ms:.1f} ms, max {self.health_max_ms:.1f} ms")
        print(f"[chaos] after: KV cache usage {self.kv_cache_usage_after}, requests running "
              f"{self.requests_running_after}, engine alive {self.engine_alive}")
        if self.rss_before_mb is not None:
            print(f"[chaos] server RSS {self.rss_before_mb:.0f} MB before, {self.rss_after_mb:.0f} MB after")
        for problem in (self.errors + self.mismatches)[:10]:
            print(f"[chaos]   problem: {problem}")

    def failures(self, health_p99_ms: float, rss_growth_mb: float) -> list[str]:
        """What makes the run a failure: errors, answers that differ, leaked blocks, a dead or slow or bloated
        server."""
        failed = [f"{len(self.errors)} errors"] if self.errors else []
        failed += [f"{len(self.mismatches)} answers differ from the same request alone"] if self.mismatches else []
        if self.kv_cache_usage_after != 0:
            failed.append(f"KV blocks leaked: usage {self.kv_cache_usage_after} once idle")
        if not self.engine_alive:
            failed.append("the server is not alive")
        if self.health_p99_ms is None or self.health_p99_ms > health_p99_ms:
            failed.append(f"/health p99 {self.health_p99_ms} ms is over {health_p99_ms} ms")
        if self.rss_before_mb is not None and self.rss_after_mb - self.rss_before_mb > rss_growth_mb:
            failed.append(f"the server's RSS grew by {self.rss_after_mb - self.rss_before_mb:.0f} MB, over "
                          f"{rss_growth_mb} MB")
        return failed


def chat_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}


async def stream_answer(client: httpx.AsyncClient, url: str, body: dict, leave_after: int | None = None,
                        delay_s: float = 0.0) -> tuple[str, str | None, int]:
    """(text, finish reason, status) of a streamed chat call; leaves after ``leave_after`` events if given."""
    text, reason, events = "", None, 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return (await response.aread()).decode(errors="replace")[:200], None, response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if leave_after is not None and events >= leave_after:
                return text, None, 200
            events += 1
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return chunk["error"]["message"], None, 500
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                reason = choice["finish_reason"] or reason
            if delay_s:
                await asyncio.sleep(delay_s)
    return text, reason, 200


class Chaos:
    def __init__(self, base_url: str, model: str, clients: int, max_tokens: int, prompts: list[str], seed: int,
                 server_pid: int | None, api_key: str | None = None):
        self.base, self.model, self.prompts = base_url.removesuffix("/v1"), model, prompts
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # a bad input may replace it
        self.url = f"{self.base}/v1/chat/completions"
        self.max_tokens, self.rng, self.pid = max_tokens, random.Random(seed), server_pid
        self.report = ChaosReport(clients)
        self.completed: list[tuple[str, int, str]] = []  # (prompt, max_tokens, text)
        self.health: list[float] = []

    async def client(self, client: httpx.AsyncClient, i: int) -> None:
        prompt = self.prompts[i % len(self.prompts)]
        max_tokens = self.rng.randint(self.max_tokens // 2, self.max_tokens)
        kind = "disconnect" if i % 3 == 0 else "slow" if i % 6 == 1 else "normal"
        await asyncio.sleep(self.rng.uniform(0, 0.5))
        leave = self.rng.randint(0, max_tokens // 2) if kind == "disconnect" else None
        delay = self.rng.uniform(0.05, 0.2) if kind == "slow" else 0.0
        try:
            if leave == 0 and self.rng.random() < 0.5:  # gone before the first event
                await asyncio.wait_for(stream_answer(client, self.url, chat_body(self.model, prompt, max_tokens)),
                                       timeout=self.rng.uniform(0.01, 0.3))
                return
            text, reason, status = await stream_answer(client, self.url, chat_body(self.model, prompt, max_tokens),
                                                       leave, delay)
        except asyncio.TimeoutError:
            self.report.disconnects += 1
            return
        except httpx.HTTPError as err:
            self.report.errors.append(f"client {i}: {err!r}")
            return
        if status == 503:
            self.report.refused_busy += 1
        elif status != 200:
            self.report.errors.append(f"client {i}: HTTP {status}: {text}")
        elif reason is None and leave is not None:
            self.report.disconnects += 1
        elif reason is None:
            self.report.errors.append(f"client {i}: the stream ended without a finish reason")
        else:
            self.report.served += 1
            self.report.slow_readers += kind == "slow"
            self.completed.append((prompt, max_tokens, text))

    async def bad_input(self, client: httpx.AsyncClient, what: str, content, headers: dict) -> None:
        self.report.bad_inputs += 1
        if isinstance(content, dict):
            content = json.dumps({**chat_body(self.model, "hi", 4), "stream": False, **content}).encode()
        response = await client.post(self.url, content=content, headers={"Content-Type": "application/json",
                                                                          **headers})
        try:
            error = response.json()["error"]
            shaped = set(error) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            shaped = False
        if not 400 <= response.status_code < 500 or not shaped:
            self.report.errors.append(f"bad input '{what}': HTTP {response.status_code}: {response.text[:200]}")

    def watch_health(self, stop: threading.Event) -> None:
        """On a thread of its own, so the clients' work on this side never counts as the server's latency."""
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                start = time.perf_counter()
                response = client.get(f"{self.base}/health")
                self.health.append(time.perf_counter() - start)
                if response.status_code != 200:
                    self.report.errors.append(f"/health answered {response.status_code}")
                stop.wait(0.02)

    async def compare_with_alone(self, client: httpx.AsyncClient) -> None:
        alone: dict[tuple[str, int], str] = {}
        for prompt, max_tokens, text in self.completed:
            if (prompt, max_tokens) not in alone:
                alone[prompt, max_tokens], _, _ = await stream_answer(client, self.url,
                                                                      chat_body(self.model, prompt, max_tokens))
            self.report.compared += 1
            if alone[prompt, max_tokens] != text:
                self.report.mismatches.append(f"{prompt!r} ({max_tokens} tokens): {text!r} alone was "
                                              f"{alone[prompt, max_tokens]!r}")

    async def run(self) -> ChaosReport:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, headers=self.headers) as client:
            await stream_answer(client, self.url, chat_body(self.model, "Hello!", 4))  # warm-up
            self.report.rss_before_mb = self.rss_mb()
            stop = threading.Event()
            watcher = threading.Thread(target=self.watch_health, args=(stop,))
            watcher.start()
            start = time.perf_counter()
            await asyncio.gather(*(self.client(client, i) for i in range(self.report.clients)),
                                 *(self.bad_input(client, *bad) for bad in BAD_INPUTS))
            self.report.wall_s = time.perf_counter() - start
            stop.set()
            watcher.join()
            await self.compare_with_alone(client)
            await self.check_after(client)
        return self.report

    async def check_after(self, client: httpx.AsyncClient) -> None:
        report = self.report
        ms = [s * 1000 for s in self.health]
        report.health_checks = len(ms)
        report.health_p50_ms, report.health_p99_ms = percentile(ms, 50), percentile(ms, 99)
        report.health_max_ms = max(ms)
        deadline = time.monotonic() + 30
        while True:  # aborted requests are freed at the engine's next step
            text = (await client.get(f"{self.base}/metrics")).text
            report.kv_cache_usage_after = metric(text, "hf_paged:kv_cache_usage_perc")
            report.requests_running_after = metric(text, "hf_paged:num_requests_running")
            if report.kv_cache_usage_after == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        report.engine_alive = (await client.get(f"{self.base}/health")).status_code == 200
        report.rss_after_mb = self.rss_mb()

    def rss_mb(self) -> float | None:
        if self.pid is None:
            return None
        with open(f"/proc/{self.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def run_chaos(base_url: str, model: str, clients: int, max_tokens: int, prompts: list[str], seed: int = 0,
              server_pid: int | None = None, api_key: str | None = None) -> ChaosReport:
    return asyncio.run(Chaos(base_url, model, clients, max_tokens, prompts, seed, server_pid, api_key).run())
