"""`hf-paged run-batch` (`hf_paged.batch`): OpenAI's batch file format answered by the server's own app in-process."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("fastapi")

from live_server import MODEL, tiny_generator  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from hf_paged.batch import run_batch  # noqa: E402
from hf_paged.cli import main  # noqa: E402
from hf_paged.server import ServerLimits, create_app  # noqa: E402

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_a_batch_file_is_answered_in_order_as_the_server_answers(smollm2_path):
    """Every request in flight at once (up to the limit given), each answered as the server answers it, its error
    included; lines that are no request get an error of their own and the others run on."""
    requests = {
        "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **GREEDY}),
        "text": ("/v1/completions", {"prompt": "Once upon a time", **GREEDY}),
        "embed": ("/v1/embeddings", {"input": "a text"}),
        "score": ("/score", {"text_1": "a", "text_2": ["b", "c"]}),
        "bad": ("/v1/completions", {"prompt": "x", "temperature": -1}),
        **{f"many-{i}": ("/v1/completions", {"prompt": f"story number {i}", **GREEDY}) for i in range(10)},
    }
    lines = [line(name, url, body) for name, (url, body) in requests.items()]
    lines[3:3] = ["", "{not json", line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
                  line("models", "/v1/models", {}, method="GET"), line("nowhere", "/v1/files", {})]
    lines.append(line("chat", "/v1/completions", {"prompt": "again"}))
    generator = tiny_generator(smollm2_path)
    app = create_app(generator, MODEL, limits=ServerLimits(max_concurrent_requests=4))
    schedule, running = generator.scheduler.schedule, []

    def watched(*args):
        out = schedule(*args)
        running.append(len(generator.scheduler.running))
        return out

    generator.scheduler.schedule = watched
    records = asyncio.run(run_batch(app, lines, concurrency=4))
    assert 2 <= max(running) <= 4  # batched, never more in flight than asked
    by_id = {record["custom_id"]: record for record in reversed(records)}  # each id's first record
    assert [record["custom_id"] for record in records] == [*list(requests)[:3], None, "streamed", "models", "nowhere",
                                                           *list(requests)[3:], "chat"]
    assert len({record["id"] for record in records}) == len(records)
    for name, words in ((None, "line 5: not JSON"), ("streamed", "line 6: a batch request is answered whole"),
                        ("models", "method must be POST, got 'GET'"), ("nowhere", "url must be one of")):
        record = next(r for r in records if r["custom_id"] == name)
        assert record["response"] is None and words in record["error"]["message"], record
    assert records[-1]["response"] is None and "line 21: custom_id 'chat' is line 1's already" in \
        records[-1]["error"]["message"]
    assert by_id["chat"]["response"]["status_code"] == 200  # the first line of that id
    refused = by_id["bad"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    assert by_id["bad"]["error"] is None
    answered = [r for r in records if r["response"] is not None and r["custom_id"] != "bad"]
    assert len(answered) == 14 and all(r["response"]["status_code"] == 200 for r in answered)
    assert all(r["response"]["request_id"] for r in answered)
    assert len(by_id["score"]["response"]["body"]["data"]) == 2
    with TestClient(create_app(tiny_generator(smollm2_path), MODEL)) as client:  # the same calls, one at a time
        for name in ("chat", "text", "embed", "many-7"):
            url, body = requests[name]
            alone = client.post(url, json=body).json()
            batched = by_id[name]["response"]["body"]
            if name == "embed":
                assert batched["data"][0]["embedding"] == pytest.approx(alone["data"][0]["embedding"], abs=1e-6)
            else:
                assert batched["choices"] == alone["choices"] and batched["usage"] == alone["usage"], name
    assert generator.stats().num_used_blocks == 0


def test_a_busy_server_is_asked_again_and_lines_end_at_newlines_only(smollm2_path):
    """More sequences than the engine queues are in flight at once: those refused with 503 and Retry-After wait and
    go again, so every request is answered. A prompt holding U+2028 (valid in a JSON string) stays one line."""
    generator = tiny_generator(smollm2_path, max_num_seqs=4)
    app = create_app(generator, MODEL, limits=ServerLimits(max_num_waiting=1))
    lines = [line(f"r{i}", "/v1/completions", {"prompt": f"story {i}", "n": 2, **GREEDY}) for i in range(8)]
    text = "\n".join(lines) + "\n" + json.dumps({"custom_id": "sep", "method": "POST", "url": "/v1/completions",
                                                 "body": {"prompt": "a\u2028b", **GREEDY}}, ensure_ascii=False)
    assert "\u2028" in text and len(text.splitlines()) == 10  # what str.splitlines would make of it
    records = asyncio.run(run_batch(app, text.split("\n"), concurrency=8))
    assert [r["custom_id"] for r in records] == [*(f"r{i}" for i in range(8)), "sep"]
    assert all(r["response"]["status_code"] == 200 for r in records), [r["response"]["body"] for r in records]
    assert all(len(r["response"]["body"]["choices"]) == 2 for r in records[:8])


def test_a_line_that_cannot_be_read_gets_its_error_and_the_others_run(smollm2_path):
    """A custom_id that is no string, and JSON nested past what Python reads, crashed the whole batch."""
    app = create_app(tiny_generator(smollm2_path), MODEL)
    lines = [json.dumps({"custom_id": ["x"], "method": "POST", "url": "/v1/completions", "body": {}}),
             "[" * 100_000 + "]" * 100_000, line("ok", "/v1/completions", {"prompt": "Hi", **GREEDY})]
    records = asyncio.run(run_batch(app, lines, concurrency=2))
    assert [record["custom_id"] for record in records] == [None, None, "ok"]
    assert "line 1: custom_id must be a non-empty string" in records[0]["error"]["message"]
    assert "line 2: nested too deeply" in records[1]["error"]["message"]
    assert records[2]["response"]["status_code"] == 200


def test_the_run_batch_command_writes_the_answers(smollm2_path, tmp_path, capsys):
    given, answers = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    given.write_text("\n".join([line("a", "/v1/completions", {"prompt": "Hello", **GREEDY}),
                                line("b", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                   "max_completion_tokens": 4}),
                                line("c", "/v1/completions", {"prompt": "x", "n": 0}),
                                line("d\ud800", "/v1/completions", {"prompt": "Hi", **GREEDY})]) + "\n")
    assert main(["run-batch", smollm2_path, "-i", str(given), "-o", str(answers), "--num-blocks", "64",
                 "--served-model-name", "smol"]) == 0
    records = [json.loads(text) for text in answers.read_text().split("\n") if text]
    assert [(r["custom_id"], r["response"]["status_code"]) for r in records] == [("a", 200), ("b", 200), ("c", 400),
                                                                                ("d\ud800", 200)]
    assert records[0]["response"]["body"]["usage"]["completion_tokens"] == 8
    assert records[1]["response"]["body"]["model"] == "smol"
    assert "4 requests, 3 answered, 1 refused or failed" in capsys.readouterr().err
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"prompt": "caf\u00e9"}}, ensure_ascii=False).encode("latin-1"))
    for argv, words in ((["-i", str(tmp_path / "none.jsonl"), "-o", str(answers)], "--input-file: no such file"),
                        (["-i", str(given), "-o", str(tmp_path / "no" / "dir.jsonl")], "--output-file: cannot write"),
                        (["-i", str(given), "-o", str(tmp_path)], "--output-file: cannot write"),
                        (["-i", str(latin), "-o", str(answers)], "--input-file: cannot read")):
        with pytest.raises(SystemExit) as exit_info:
            main(["run-batch", smollm2_path, *argv, "--num-blocks", "64"])
        assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_run_batch_reads_and_sends_over_http_as_vllms(smollm2_path, tmp_path, capsys):
    """vLLM's run-batch takes URLs: the requests are read with GET and the answers sent with PUT; a URL that does not
    take them leaves them in a file the error names."""
    import http.server
    import threading

    requests = (line("a", "/v1/completions", {"prompt": "Hello", **GREEDY}) + "\n").encode()
    received = {}

    class Files(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(requests)

        def do_PUT(self):  # noqa: N802
            received[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200 if self.path == "/answers.jsonl" else 403)
            self.end_headers()

        def log_message(self, *args):
            pass

    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    try:
        assert main(["run-batch", smollm2_path, "-i", f"{base}/requests.jsonl", "-o", f"{base}/answers.jsonl",
                     "--num-blocks", "64"]) == 0
        [record] = [json.loads(text) for text in received["/answers.jsonl"].decode().split("\n") if text]
        assert record["custom_id"] == "a" and record["response"]["body"]["usage"]["completion_tokens"] == 8
        assert main(["run-batch", smollm2_path, "-i", f"{base}/requests.jsonl", "-o", f"{base}/refused.jsonl",
                     "--num-blocks", "64"]) == 1
        kept = re.search(r"they are in (\S+\.jsonl)", capsys.readouterr().err).group(1)
        with open(kept) as answers:
            assert json.loads(answers.readline())["custom_id"] == "a"
    finally:
        files.shutdown()


def test_run_batch_fails_when_the_engine_dies(smollm2_path, tmp_path, capsys, monkeypatch):
    import hf_paged.cli

    load = hf_paged.cli.load_generator

    def broken():
        raise RuntimeError("the model crashed")

    def loaded(*args):
        generator = load(*args)
        generator.step = broken
        return generator

    monkeypatch.setattr(hf_paged.cli, "load_generator", loaded)
    # The first failing step kills the engine: with more, whether it died before the batch ended would be a race
    monkeypatch.setattr("hf_paged.engine_loop.FATAL_CONSECUTIVE_FAILURES", 1)
    given, answers = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    given.write_text(line("a", "/v1/completions", {"prompt": "Hello", **GREEDY}) + "\n")
    assert main(["run-batch", smollm2_path, "-i", str(given), "-o", str(answers), "--num-blocks", "64"]) == 1
    assert "the engine stopped after an unrecoverable error" in capsys.readouterr().err
    assert json.loads(answers.read_text())["response"]["status_code"] >= 500


def test_ctrl_c_during_run_batch_says_that_nothing_was_written(smollm2_path, tmp_path, capsys, monkeypatch):
    import signal

    import hf_paged.cli

    load = hf_paged.cli.load_generator

    def loaded(*args):
        generator = load(*args)
        step = generator.step

        def interrupted():
            generator.step = step
            signal.raise_signal(signal.SIGINT)  # Ctrl+C while the batch runs
            return step()

        generator.step = interrupted
        return generator

    monkeypatch.setattr(hf_paged.cli, "load_generator", loaded)
    given, answers = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    given.write_text(line("a", "/v1/completions", {"prompt": "Hello", **GREEDY}) + "\n")
    assert main(["run-batch", smollm2_path, "-i", str(given), "-o", str(answers), "--num-blocks", "64"]) == 130
    assert "hf-paged run-batch: interrupted: no answers written" in capsys.readouterr().err
    assert not answers.exists()
