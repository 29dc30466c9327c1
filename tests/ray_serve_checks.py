"""hf_paged on Ray Serve: a local Ray (2 CPUs) with 2 SmolLM2 replicas, driven over HTTP by the `openai` client.

One app serves the whole module (Ray and the replicas start once); the shared-prefix test adds a second ingress in
front of the same replicas, without prefix affinity, for its baseline.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import ray
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

import hf_paged
from hf_paged import ContinuousBatchGenerator, EngineConfig
from hf_paged.default_model import DEFAULT_MODEL_NAME
from hf_paged.server import create_app
from hf_paged.server.limits import ServerLimits
from hf_paged.serve_ray import APP_NAME, ReplicaSpec, ServeRayConfig, build_app, ingress
from hf_paged.serve_ray.affinity import AffinityTable, affinity_replica, prefix_hashes

pytestmark = pytest.mark.slow

ENGINE = EngineConfig(num_blocks=256, enable_lora=True)
LORA = "smol-lora"
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Name three rivers."}]]
PROMPTS = ["The three primary colors are", "Once upon a time"]
FILLER = ("Answer briefly and politely. Prefer plain words over jargon, give one example when it helps, say so when "
          "you do not know, and never invent facts, names or numbers. Keep every answer under three sentences unless "
          "the user asks for more detail, and end with a short question that checks the user understood.")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config(model_path: str, prefix_affinity: bool = True, adapter: str | None = None) -> ServeRayConfig:
    spec = ReplicaSpec(model_path, DEFAULT_MODEL_NAME, dtype="float32", engine=ENGINE,
                       lora_modules=((LORA, adapter, None),) if adapter else ())
    return ServeRayConfig(spec, num_replicas=2, replica_cpus=1, prefix_affinity=prefix_affinity)


@pytest.fixture(scope="module")
def adapter(smollm2_path, tmp_path_factory) -> str:
    """A random LoRA adapter of SmolLM2's attention, saved by PEFT."""
    import peft
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("adapter"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in tuned.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    tuned.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base(smollm2_path, adapter):
    """A local Ray with the app deployed; the base URL of Serve's HTTP proxy."""
    root = str(Path(hf_paged.__file__).parent.parent)  # replicas import this checkout's hf_paged
    env = {"PYTHONPATH": root, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, logging_level="warning")
    try:
        for attempt in range(3):  # another process may take the free port before Serve's proxy binds it
            port = free_port()
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
                break
            except Exception:
                serve.shutdown()
                if attempt == 2:
                    raise
        serve.run(build_app(config(smollm2_path, adapter=adapter)), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def totals(base: str) -> dict[str, float]:
    """The app's /metrics: the ``replica="all"`` samples (summed over their other labels) and the router's, by
    sample name, and ``"replicas"``: how many replicas reported."""
    out, replicas = {}, set()
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for sample in family.samples:
            replica = sample.labels.get("replica", "all")
            replicas.add(replica)
            if replica == "all" and "le" not in sample.labels:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    out["replicas"] = len(replicas - {"all"})
    return out


def test_affinity_table_prefers_the_longest_prefix_of_a_live_replica():
    tokens = list(range(100))
    hashes = prefix_hashes(tokens, 16)
    assert len(hashes) == 6 and prefix_hashes(tokens[:40], 16) == hashes[:2]
    table = AffinityTable(capacity=8)
    table.record(hashes[:2], "a")
    table.record(hashes[:5], "b")  # the last replica sent a block owns it
    table.record(hashes[:1], "c")
    assert table.best(hashes, {"a", "b", "c"}) == ("b", 5)
    assert table.best(hashes, {"a", "c"}) == ("c", 1)  # a dead replica's blocks do not count
    assert table.best(prefix_hashes(list(range(1, 100)), 16), {"a", "b", "c"}) == (None, 0)
    table.forget("c")
    assert table.best(hashes, {"a", "b"}) == ("b", 5) and table.matched(hashes, "c") == 0
    table.record(prefix_hashes(list(range(200, 300)), 16), "a")  # 6 more: the 2 least recent are dropped
    assert table.best(hashes, {"b"}) == ("b", 5) and table.best(hashes[:3], {"b"}) == (None, 0)


def test_a_replica_is_chosen_for_a_prefix_that_is_most_of_the_prompt_while_it_is_not_overloaded():
    """A short prefix every request shares (a template's default system prompt) sent every chat to one replica while
    the other idled: it takes more than half of the prompt's blocks, and the load within max_imbalance."""
    hashes = prefix_hashes(list(range(100)), 16)  # 6 blocks
    table = AffinityTable()
    table.record(hashes[:3], "a")
    assert affinity_replica(table, hashes, {"a": 0, "b": 0}, 8) is None  # half the prompt: balanced
    table.record(hashes[:4], "a")
    assert affinity_replica(table, hashes, {"a": 8, "b": 0}, 8) == "a"
    assert affinity_replica(table, hashes, {"a": 9, "b": 0}, 8) is None  # overloaded
    assert affinity_replica(table, hashes, {"b": 0}, 8) is None  # not alive
    assert affinity_replica(table, [], {"a": 0, "b": 0}, 8) is None  # a prompt of less than a block


def test_a_full_replica_takes_control_calls_only_and_a_full_app_holds_model_calls_back():
    """Each replica takes max_ongoing_requests model calls from the router; a probe or a listing (``control``) goes
    to any replica, in the slots kept for such calls, so /health answers however busy the replicas are."""
    import asyncio
    from collections import namedtuple
    from types import SimpleNamespace

    from hf_paged.serve_ray.router import PrefixAffinityRouter

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)
    router._deployment_id = SimpleNamespace(app_name="routing-check")
    router.initialize_state(max_ongoing_requests=2)
    replica_id = namedtuple("ReplicaID", "unique_id")
    a, b = (SimpleNamespace(replica_id=replica_id(name)) for name in "ab")

    def chosen(**kwargs) -> list[list[str]]:
        call = SimpleNamespace(kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False))
        return [[r.replica_id.unique_id for r in rank] for rank in asyncio.run(router.choose_replicas([a, b], call))]

    router.in_flight[a.replica_id] = 2
    assert chosen(prefix=None) == [["b"]]
    router.in_flight[b.replica_id] = 2
    assert chosen(prefix=None) == []  # held back in the router, which retries
    assert sorted(chosen(control=True)[0]) == ["a", "b"] and chosen(replica="a") == [["a"]]


def test_a_lora_adapters_requests_are_routed_apart_from_the_base_models(smollm2_path):
    """An adapter's blocks are cached apart from the base model's: the router keys its requests' prefixes apart too,
    by the adapter named (``--lora-modules``); the base model's keys are the engine's own."""
    from transformers import AutoTokenizer

    from hf_paged.serve_ray.ingress import route_hashes

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = " ".join(["a long shared system prompt"] * 20)

    def hashes(model, path="/v1/completions", **fields):
        body = json.dumps({"model": model, "prompt": text, **fields}).encode()
        return route_hashes(path, body, tokenizer, "string", 16, adapters=(LORA,))

    base = hashes("smollm2")
    assert base == prefix_hashes(tokenizer(text).input_ids, 16) and len(base) > 2
    assert hashes("another-name-of-the-base-model") == base
    adapted = hashes(LORA)
    assert len(adapted) == len(base) and not set(adapted) & set(base)
    assert hashes(LORA, max_tokens=5) == adapted
    chat = json.dumps({"model": LORA, "messages": [{"role": "user", "content": text}]}).encode()
    chat_base = route_hashes("/v1/chat/completions", chat.replace(LORA.encode(), b"smollm2"), tokenizer, "string", 16)
    assert not set(route_hashes("/v1/chat/completions", chat, tokenizer, "string", 16, (LORA,))) & set(chat_base)
    assert hashes(LORA, prompt=12) is None  # malformed: the replica answers it


def test_a_huge_prompt_is_placed_by_its_first_characters_without_tokenizing_it_whole(smollm2_path):
    from transformers import AutoTokenizer

    from hf_paged.serve_ray.ingress import ROUTE_CHARS, route_hashes

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = "word " * ROUTE_CHARS  # 5 x ROUTE_CHARS characters
    body = json.dumps({"prompt": text}).encode()
    cut = prefix_hashes(tokenizer(text[:ROUTE_CHARS]).input_ids, 16)
    assert route_hashes("/v1/completions", body, tokenizer, "string", 16) == cut and len(cut) > 100
    def chat(*messages) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": m} for m in messages]}).encode()

    def chat_hashes(body: bytes, content_format: str = "string") -> list[bytes]:
        return route_hashes("/v1/chat/completions", body, tokenizer, content_format, 16)

    assert chat_hashes(chat(text)) == chat_hashes(chat(text[:ROUTE_CHARS]))
    many = [f"message {i}: " + "x" * 3000 for i in range(100)]  # each under the limit, ten times it together
    kept = ROUTE_CHARS // 3011 + 1
    assert chat_hashes(chat(*many)) == chat_hashes(chat(*many[:kept - 1], many[kept - 1][:ROUTE_CHARS % 3011]))
    parts = [[{"type": "text", "text": m}] for m in many]
    assert chat_hashes(chat(*parts), "openai") == chat_hashes(chat(*many), "openai")


def test_a_replica_writes_hf_pageds_records_at_the_log_level_serve_ray_was_given(capfd):
    """Requests' records (``--enable-log-requests``) reach the replica's log as serve's reach its terminal."""
    import logging

    spec = ReplicaSpec("unused", DEFAULT_MODEL_NAME, log_level="info")
    logger = logging.getLogger("hf_paged")
    try:
        spec.configure_logging()
        spec.configure_logging()  # a replica restarted in the same worker process: still once
        logging.getLogger("hf_paged.server.serving").info("request r queued")
        logging.getLogger("hf_paged.server.serving").debug("below the level")
        written = capfd.readouterr().err
    finally:
        logger.handlers = [h for h in logger.handlers if type(h).__name__ != "_ReplicaLog"]
        logger.propagate, logger.level = True, logging.NOTSET
    assert written.count("INFO hf_paged.server.serving: request r queued") == 1 and "below" not in written


@pytest.mark.parametrize("prefix", ["hf_paged", "vllm"])
def test_rates_are_averaged_over_replicas_and_a_dead_engine_fails_the_health_check(prefix):
    from types import SimpleNamespace

    from hf_paged.serve_ray.metrics import merged_metrics
    from hf_paged.serve_ray.replica import EngineReplica

    def text(rate: float, accepted: int, drafted: int) -> str:
        return (f"# TYPE hf_paged:spec_decode_acceptance_rate gauge\nhf_paged:spec_decode_acceptance_rate {rate}\n"
                f"# TYPE hf_paged:spec_decode_num_accepted_tokens_total counter\n"  # as generate_latest writes it
                f"hf_paged:spec_decode_num_accepted_tokens_total {accepted}\n"
                f"# TYPE hf_paged:spec_decode_num_draft_tokens_total counter\n"
                f"hf_paged:spec_decode_num_draft_tokens_total {drafted}\n"
                f"# TYPE hf_paged:num_requests_running gauge\nhf_paged:num_requests_running 2.0\n"
                ).replace("hf_paged:", f"{prefix}:")  # --metrics-prefix

    # 60 of 100 guesses kept, 0 of 1, and a replica that never speculated (its gauge reads 0).
    merged = merged_metrics({"a": text(0.6, 60, 100), "b": text(0.0, 0, 1), "c": text(0.0, 0, 0)}, None).decode()
    assert f'{prefix}:spec_decode_acceptance_rate{{replica="all"}} ' + str(60 / 101) in merged
    assert f'{prefix}:num_requests_running{{replica="all"}} 6.0' in merged
    # A replica gone (replaced, or too slow to answer): its counters stay in the totals, its gauges do not.
    merged = merged_metrics({"a": text(0.6, 60, 100)}, None, gone={"d": text(0.8, 40, 50)}).decode()
    assert f'{prefix}:spec_decode_num_accepted_tokens_total{{replica="all"}} 100.0' in merged
    assert f'{prefix}:spec_decode_acceptance_rate{{replica="all"}} ' + str(100 / 150) in merged
    assert f'{prefix}:num_requests_running{{replica="all"}} 2.0' in merged and 'replica="d"' not in merged
    info = '# TYPE hf_paged:cache_config_info gauge\nhf_paged:cache_config_info{block_size="16"} 1.0\n'
    merged = merged_metrics({"a": info, "b": info}, None, num_replicas=3).decode()
    assert 'hf_paged:cache_config_info{block_size="16",replica="all"} 1.0' in merged  # the same 1, not a sum
    assert "hf_paged:router_replicas 3.0" in merged  # those routed to, answering or not
    replica = lambda healthy: SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(  # noqa: E731
        engine=SimpleNamespace(healthy=healthy))))
    EngineReplica.func_or_class.check_health(replica(True))
    with pytest.raises(RuntimeError, match="unrecoverable"):  # Serve then replaces the replica
        EngineReplica.func_or_class.check_health(replica(False))


def test_cli_serve_ray_builds_its_config_from_the_options(smollm2_path, adapter, monkeypatch, capsys):
    import hf_paged.serve_ray
    from hf_paged.cli import main

    deployed = []
    free = ["--port", str(free_port())]  # the local cluster's proxy port is checked first
    monkeypatch.setattr(hf_paged.serve_ray, "serve_forever", lambda *args: deployed.append(args))
    main(["serve-ray", smollm2_path, "--min-replicas", "2", "--max-replicas", "4", "--num-blocks", "64",
          "--no-prefix-routing", "--address", "auto", "--port", "9000", "--api-key", "k", "--max-n", "3",
          "--max-body-size", "1MiB", "--allowed-origins", "https://a.example, https://b.example"])
    (config, address, host, port), = deployed
    assert (address, host, port) == ("auto", "127.0.0.1", 9000)
    assert config.replica.engine == EngineConfig(num_blocks=64) and config.replica.api_key == "k"
    assert config.replica.limits == ServerLimits(max_n=3, max_body_bytes=1 << 20)
    assert config.replica.allowed_origins == ("https://a.example", "https://b.example")
    assert not config.prefix_affinity and config.scaling()["autoscaling_config"] == {
        "min_replicas": 2, "max_replicas": 4, "initial_replicas": 2, "target_ongoing_requests": 32}
    assert config.scaling()["graceful_shutdown_timeout_s"] == 300  # a replica scaled down finishes its streams
    with pytest.raises(SystemExit):
        main(["serve-ray", smollm2_path, *free, "--num-replicas", "5", "--min-replicas", "1", "--max-replicas", "4"])
    assert "num_replicas (5) must lie between" in capsys.readouterr().err
    for option, value, message in [("--replica-cpus", "-1", "replica_cpus must be >= 0, got -1.0"),
                                   ("--target-ongoing-requests", "0", "target_ongoing_requests must be >= 1, got 0")]:
        with pytest.raises(SystemExit) as exit_info:  # refused before Ray starts (a traceback from Ray before)
            main(["serve-ray", smollm2_path, *free, "--min-replicas", "1", "--max-replicas", "2", option, value])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not deployed[1:]
    main(["serve-ray", smollm2_path, *free, "--enable-lora", "--lora-modules", f"{LORA}={adapter}", "--log-level",
          "debug"])
    assert deployed[1][0].replica.lora_modules == ((LORA, adapter, None),)
    assert (deployed[0][0].replica.log_level, deployed[1][0].replica.log_level) == ("info", "debug")
    with pytest.raises(SystemExit) as exit_info:  # read before Ray starts, not by every replica
        main(["serve-ray", smollm2_path, *free, "--enable-lora", "--lora-modules", f"{LORA}={adapter}/missing"])
    assert exit_info.value.code == 2 and "no adapter_config.json" in capsys.readouterr().err
    import ray._private.utils

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as taken:  # a port in use is named before Ray starts, as serve names it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda *_: None)  # no local cluster to join
        with pytest.raises(SystemExit) as exit_info:
            main(["serve-ray", smollm2_path, "--port", str(taken.getsockname()[1])])
        assert exit_info.value.code == 2 and "cannot listen on 127.0.0.1:" in capsys.readouterr().err
        # A running local cluster is joined: its Serve may be the one listening there.
        monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda *_: "127.0.0.1:6379")
        main(["serve-ray", smollm2_path, "--port", str(taken.getsockname()[1])])
    assert len(deployed) == 3


def test_the_ingress_refuses_an_oversized_body_before_reading_it(base):
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 40000000\r\n\r\n{")  # 40 MB announced, one byte sent
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_openai_client_streams_and_greedy_answers_equal_a_single_server(base, client, smollm2):
    model, tokenizer = smollm2
    with TestClient(create_app(ContinuousBatchGenerator(model, tokenizer, ENGINE), DEFAULT_MODEL_NAME)) as local:
        single = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=local)
        greedy = {"model": DEFAULT_MODEL_NAME, "temperature": 0, "max_tokens": 12}
        for messages in CHATS:
            expected = single.chat.completions.create(messages=messages, **greedy).choices[0].message.content
            stream = client.chat.completions.create(messages=messages, stream=True, **greedy)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
            assert client.chat.completions.create(messages=messages, **greedy).choices[0].message.content == expected
        for prompt in PROMPTS:
            expected = single.completions.create(prompt=prompt, **greedy).choices[0].text
            stream = client.completions.create(prompt=prompt, stream=True, **greedy)
            assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME, LORA]
    with pytest.raises(openai.BadRequestError, match="temperature"):  # the replica's own validation answers
        client.chat.completions.create(messages=CHATS[0], model=DEFAULT_MODEL_NAME, temperature=-1)
    metrics = totals(base)
    assert metrics["replicas"] == 2
    assert metrics["hf_paged:request_success_total"] == 2 * len(CHATS) + len(PROMPTS)
    assert metrics["hf_paged:router_requests_total"] >= 2 * len(CHATS) + len(PROMPTS)


def stream_and_record(client: openai.OpenAI, prompt: str, record: dict, started: threading.Event) -> None:
    """Stream one completion into ``record``: the replica that serves it, its text, the error that ended it."""
    record.update(replica=None, text="", finish=None, error=None)
    try:
        raw = client.completions.with_raw_response.create(
            model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=128, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        record["replica"] = raw.headers["x-hf-paged-replica"]
        for chunk in raw.parse():
            record["text"] += chunk.choices[0].text
            record["finish"] = chunk.choices[0].finish_reason or record["finish"]
            if record["text"]:  # after it is written: the killer picks the replica of a record with text
                started.set()
    except openai.APIError as err:
        record["error"] = str(err)


def replica_ids(base: str) -> set[str]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {s.labels["replica"] for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("replica", "all") != "all"}


def test_a_killed_replica_fails_its_requests_only_and_is_replaced(base, client):
    prompts = [f"Story number {i}: a long tale about a {animal}" for i, animal in
               enumerate(["cat", "dog", "fox", "owl", "bee", "elk", "yak", "ant"])]
    records = [{} for _ in prompts]
    started = threading.Event()
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_and_record, client, p, r, started) for p, r in zip(prompts, records)]
        assert started.wait(timeout=120)
        victim = next(r["replica"] for r in records if r["text"])  # 128 tokens take seconds: it is mid-stream
        counted = totals(base)
        # Serve names a replica's actor SERVE_REPLICA::<app>#<deployment>#<replica id>; this is a hard kill.
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Engine#{victim}", namespace="serve"), no_restart=True)
        for future in futures:
            future.result(timeout=120)  # nothing hangs
    survived = [r for r in records if r["replica"] not in (victim, None)]
    failed = [r for r in records if r["replica"] in (victim, None)]  # None: the replica died before it answered
    print(f"\nkilled replica {victim}: {len(failed)} requests failed, {len(survived)} completed on the other")
    assert survived and failed
    assert all(r["error"] is None and r["finish"] == "length" for r in survived), survived
    assert all(r["error"] is not None and "failed" in r["error"] for r in failed), failed
    deadline = time.monotonic() + 180
    while (ids := replica_ids(base)) and (len(ids) != 2 or victim in ids):  # Serve starts a replacement
        assert time.monotonic() < deadline, f"the killed replica was not replaced: {ids}"
        time.sleep(1)
    answer = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=prompts[0], max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    after = totals(base)  # the counters' totals keep the killed replica's last values: they never go down
    assert all(after[name] >= counted[name] for name in counted if name.endswith(("_total", "_count", "_sum"))
               and name.startswith("hf_paged:") and not name.startswith("hf_paged:router"))
    assert after["hf_paged:prompt_tokens_total"] > counted["hf_paged:prompt_tokens_total"]


def shared_prefix_hit_rate(base: str, client: openai.OpenAI, team: str, groups: int = 20, rounds: int = 3):
    """Send ``rounds`` rounds of one chat per group at once, each group with its own long system prompt; the
    replicas' prefix cache hit rate (in tokens) and the app's router's predicted one (in blocks) meanwhile."""
    before = totals(base)

    def ask(group: int, turn: int) -> None:
        system = f"You are {team} assistant number {group}, who helps group {group} only. {FILLER}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {turn}: hi?"}]
        client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=1, temperature=0)

    with ThreadPoolExecutor(groups) as pool:
        for turn in range(rounds):
            list(pool.map(ask, range(groups), [turn] * groups))
    after = totals(base)

    def rate(hits: str, queries: str) -> float:
        asked = after[queries] - before[queries]
        return (after[hits] - before[hits]) / asked if asked else 0.0

    return (rate("hf_paged:prefix_cache_hits_total", "hf_paged:prefix_cache_queries_total"),
            rate("hf_paged:router_matched_blocks_total", "hf_paged:router_prompt_blocks_total"))


def test_prefix_affinity_routing_beats_random_routing_on_shared_prefixes(base, client, smollm2_path):
    affinity, predicted = shared_prefix_hit_rate(base, client, "red")
    engine = serve.get_deployment_handle("Engine", app_name=APP_NAME)
    serve.run(ingress(engine, config(smollm2_path, prefix_affinity=False)), name="random", route_prefix="/random")
    try:
        random_client = openai.OpenAI(base_url=f"{base}/random/v1", api_key="none", max_retries=0, timeout=120)
        random_routing, _ = shared_prefix_hit_rate(base, random_client, "blue")
    finally:
        serve.delete("random")
    print(f"\nprefix cache hit rate over 20 groups x 3 rounds: affinity routing {affinity:.1%} (router predicted "
          f"{predicted:.1%}), random routing {random_routing:.1%}")
    # Ideal affinity: every request after a group's first hits its system prompt, 2/3 of requests here.
    assert affinity > 0.5 and abs(affinity - predicted) < 0.1
    assert affinity > random_routing + 0.08


def test_an_ingress_with_a_key_checks_its_limits_and_lets_cors_preflights_through(base, smollm2_path):
    """The serve options reach the ingress: its key and body limit, and preflights (which carry no key) answered by
    the replicas' CORS. (Last: its call adds to the replicas' request counts.)"""
    engine = serve.get_deployment_handle("Engine", app_name=APP_NAME)
    keyed = config(smollm2_path)
    keyed.replica.api_key, keyed.replica.limits = "k", ServerLimits(max_body_bytes=2000)
    serve.run(ingress(engine, keyed), name="keyed", route_prefix="/keyed")
    try:
        url, body = f"{base}/keyed/v1/completions", {"prompt": "Hi", "max_tokens": 1}
        preflight = httpx.options(url, headers={"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "authorization"}, timeout=60)
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        key = {"Authorization": "Bearer k"}
        assert httpx.post(url, json={**body, "prompt": "Hi" * 1000}, headers=key, timeout=60).status_code == 413
        answer = httpx.post(url, json=body, headers={**key, "Origin": "https://a.example"}, timeout=60)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    finally:
        serve.delete("keyed")


def test_replicas_serve_a_lora_adapter_by_its_name_as_a_single_server(base, client, smollm2, adapter):
    """``--lora-modules`` reach every replica. (After the tests that count the replicas' requests.)"""
    model, tokenizer = smollm2
    app = create_app(ContinuousBatchGenerator(model, tokenizer, ENGINE), DEFAULT_MODEL_NAME,
                     lora_modules=[(LORA, adapter)])
    with TestClient(app) as local:
        single = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=local)
        greedy = {"temperature": 0, "max_tokens": 12}
        for prompt in PROMPTS:
            expected = single.completions.create(model=LORA, prompt=prompt, **greedy).choices[0].text
            assert expected != single.completions.create(model=DEFAULT_MODEL_NAME, prompt=prompt,
                                                         **greedy).choices[0].text
            answer = client.completions.create(model=LORA, prompt=prompt, **greedy)
            assert answer.choices[0].text == expected and answer.model == LORA
    # vLLM's lora_requests_info is the time of its last update: over replicas, the latest, not their sum
    assert time.time() - 600 < totals(base)["hf_paged:lora_requests_info"] <= time.time() + 1


def test_a_runtime_adapter_update_reaches_every_replica(base, adapter):
    """vLLM's ``/v1/load_lora_adapter`` loads on every replica and ``/v1/unload_lora_adapter`` drops from every one,
    so that any replica serves the name, one started later too; a new adapter that one replica refuses is left on
    none but that one."""
    from hf_paged.server.asgi import HTTPRequest
    from hf_paged.serve_ray.registry import router_of

    engine = serve.get_deployment_handle("Engine", app_name=APP_NAME)
    engine.metrics.remote().result()  # this process's router, which sends a call to the replica it names
    replicas = [r.unique_id for r in router_of(APP_NAME).curr_replicas]
    assert len(replicas) == 2

    def call(replica: str, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        content = json.dumps(body).encode() if body else b""
        pieces = list(engine.options(stream=True).remote(HTTPRequest(method, path, b"", [
            (b"content-type", b"application/json")], content), replica=replica))
        return pieces[0].status, pieces[0].body + b"".join(pieces[1:])

    def names(replica: str) -> set[str]:
        return {m["id"] for m in json.loads(call(replica, "GET", "/v1/models")[1])["data"]}

    loaded = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter}, timeout=120)
    assert loaded.status_code == 200, loaded.text
    assert all("late" in names(replica) for replica in replicas)
    for prompt in [f"{i} little pigs" for i in range(4)]:
        answer = httpx.post(f"{base}/v1/completions", json={"model": "late", "prompt": prompt, "max_tokens": 2},
                            timeout=120)
        assert answer.status_code == 200 and answer.json()["model"] == "late", answer.text
    # A replica Serve starts to replace one loads it too.
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Engine#{replicas[0]}", namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 180
    while len(now := [r.unique_id for r in router_of(APP_NAME).curr_replicas if r.unique_id != replicas[0]]) < 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1)
    replicas = now
    assert all("late" in names(replica) for replica in replicas)
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=120).status_code == 200
    assert not any("late" in names(replica) for replica in replicas)
    # Either replica refusing (its name taken there), whichever the ingress asks first: undone on the other.
    for taken, other in (replicas, replicas[::-1]):
        name = f"taken-on-{taken}"
        assert call(taken, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": adapter})[0] == 200
        refused = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapter},
                             timeout=120)
        assert refused.status_code == 400 and "taken already" in refused.text, refused.text
        assert name in names(taken) and name not in names(other)


def test_probes_and_listings_are_answered_while_every_replica_is_full(base, smollm2_path):
    """A replica full of model calls (max_ongoing_requests) still answers /health, /v1/models and /metrics (Serve
    held them behind the streams before), and the model call beyond the limit waits in the router, then runs."""
    busy = config(smollm2_path)
    busy.num_replicas, busy.max_ongoing_requests, busy.replica_cpus = 1, 1, 0
    serve.run(build_app(busy), name="busy", route_prefix="/busy")
    try:
        url = f"{base}/busy"
        long = {"prompt": "Count to a thousand:", "max_tokens": 150, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:  # more waiting than Serve's router has routing tasks (2 per replica)
            calls = [pool.submit(httpx.post, f"{url}/v1/completions", json=long, timeout=300) for _ in range(4)]
            deadline = time.monotonic() + 60
            while totals(url).get("hf_paged:num_requests_running", 0) < 1:
                assert time.monotonic() < deadline, "the first call never ran"
                time.sleep(0.2)
            for path in ("/health", "/v1/models", "/metrics"):
                started = time.monotonic()
                assert httpx.get(f"{url}{path}", timeout=20).status_code == 200, path
                assert time.monotonic() - started < 10, path
            counts = totals(url)  # the others wait for the slot, not in the replica
            assert (counts["hf_paged:num_requests_running"], counts["hf_paged:num_requests_waiting"]) == (1, 0)
            answers = [call.result() for call in calls]
        assert all(a.status_code == 200 and a.json()["usage"]["completion_tokens"] == 150 for a in answers)
        assert "hf_paged:router_replicas 1.0" in httpx.get(f"{url}/metrics", timeout=30).text
        traced = httpx.get(f"{url}/v1/models", headers={"X-Request-Id": "trace-1"}, timeout=30)
        assert traced.headers.get_list("x-request-id") == ["trace-1"]  # Serve's proxy's, not twice
    finally:
        serve.delete("busy")
