"""Tensor parallelism on CPU with gloo: real torchrun launches on this host, compared token for token with one process."""

from __future__ import annotations

import json
import shutil
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, LlamaConfig

from tiny_models import COMMON, tiny_model
from tp_worker import run_model

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
TINY = ("llama", "qwen2", "gemma2", "gemma")  # GQA; biases; softcap + sliding window; 1 KV head on 2 ranks
PROMPT = "The three primary colors are"


def _env() -> dict:
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(*args: str, nproc: int = 2, rendezvous: tuple[str, ...] = ("--standalone",)) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}", *args]


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def tokenizer_path(smollm2_path) -> str:
    return smollm2_path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tokenizer_path) -> dict[str, str]:
    """The tiny architectures saved with SmolLM2's tokenizer (their prompts are token ids below their vocabulary)."""
    root = tmp_path_factory.mktemp("tp_models")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    dirs = {}
    for name in TINY:
        model, _ = tiny_model(name, attn_implementation="eager")
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, tokenizer_path) -> str:
    """A tiny random Llama over SmolLM2's whole vocabulary, for the command line and the server (text prompts)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tp_text") / "llama"
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                         **{**COMMON, "vocab_size": 49152})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(path)
    return str(path)


def _check_ranks_match_one_process(out: Path, paths: list[str], world: int, whole_samples: bool = True) -> None:
    """Greedy tokens equal one process's; seeded samples and beams too (``whole_samples``), or their first tokens:
    the sharded matrix products round differently, which can move a later draw of a flat distribution to a
    neighbour."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for path in paths:
        name = os.path.basename(path)
        reference = run_model(path, tensor_parallel_size=1)
        got = ranks[0][name]
        assert got["generate"] == reference["generate"], name
        assert got["engine"] == reference["engine"], name
        if whole_samples:
            assert got["sampled"] == reference["sampled"], name
            assert got["beams"] == reference["beams"], name  # every rank searched alike, from the same logits
        else:
            first = lambda sampled: [[tokens[0] for tokens in prompt] for prompt in sampled]  # noqa: E731
            assert first(got["sampled"]) == first(reference["sampled"]), name
            assert first(got["beams"]) == first(reference["beams"]), name
        for other in ranks[1:]:
            assert other[name]["generate"] == got["generate"], name
            assert other[name]["digest"] == got["digest"], f"{name}: the ranks sampled different tokens"
            assert other[name]["num_blocks"] == got["num_blocks"] == 48, name  # the fewest any rank asked for
        config = json.loads(Path(path, "config.json").read_text())
        kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        assert got["kv_heads"] == max(1, kv_heads // world), name


def test_two_ranks_match_one_process_on_three_architectures(tiny_dirs, tmp_path):
    paths = list(tiny_dirs.values())
    _run(_torchrun(str(ROOT / "tests" / "tp_worker.py"), str(tmp_path), *paths), timeout=240)
    _check_ranks_match_one_process(tmp_path, paths, world=2)


def test_smollm2_on_three_ranks_matches_one_process(smollm2_path, tmp_path):
    # 9 query heads and 3 KV heads: one KV head and three query heads a rank.
    _run(_torchrun(str(ROOT / "tests" / "tp_worker.py"), str(tmp_path), smollm2_path, nproc=3), timeout=300)
    _check_ranks_match_one_process(tmp_path, [smollm2_path], world=3, whole_samples=False)


def _one_process_text(path: str, max_tokens: int = 12) -> str:
    from hf_paged import ContinuousBatchGenerator, SamplingParams
    from hf_paged.loading import load_model

    model, tokenizer = load_model(path)
    generator = ContinuousBatchGenerator(model, tokenizer, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return generator.run([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def test_command_line_starts_its_own_ranks(text_model):
    command = [sys.executable, "-m", "hf_paged.cli", "generate", text_model, PROMPT, "--tensor-parallel-size", "2",
               "--temperature", "0", "--max-tokens", "12", "--no-chat", "--cpu-bind", "1"]
    done = _run(command, timeout=180)
    assert done.stdout.rstrip("\n") == _one_process_text(text_model)


def test_run_batch_reads_its_standard_input_once_under_tensor_parallelism(text_model):
    """Every rank inherited the command's stdin and read it: the lines went to whichever rank read first (rank 0 could
    get none of them, and answered nothing with exit code 0). Rank 0 reads it alone now."""
    requests = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": f"{PROMPT} {'word ' * 300}{i}", "max_tokens": 1}} for i in range(60)]
    batch = "".join(json.dumps(request) + "\n" for request in requests)
    assert len(batch) > 1 << 16  # more than a pipe holds at once
    command = [sys.executable, "-m", "hf_paged.cli", "run-batch", text_model, "-tp", "2", "-i", "-", "-o", "-"]
    done = subprocess.run(command, env=_env(), input=batch, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["custom_id"] for r in records] == [r["custom_id"] for r in requests]
    assert all(r["response"]["status_code"] == 200 for r in records)


def test_ctrl_c_during_generate_stops_every_rank_as_one_process_would(text_model):
    """Ctrl+C landed on rank 0 inside a step's collectives, and its clean-up started another: the ranks mismatched
    (a gloo size error, or a wait until the timeout) and the command failed. Now the step ends first: exit code 130."""
    command = [sys.executable, "-m", "hf_paged.cli", "generate", text_model, PROMPT, "-tp", "2", "--temperature", "0",
               "--max-tokens", "100000", "--no-chat"]
    launcher = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        launcher.stdout.read(20)  # the answer is flowing
        processes = _descendants(launcher.pid)
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
        stderr = stderr.decode(errors="replace")
        assert launcher.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
        assert not [pid for pid in processes if Path(f"/proc/{pid}").exists()]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for child in children for c in (child, *_descendants(int(child)))]


def _wait_up(base: str, process: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the tensor-parallel server did not come up")


def test_two_node_server_answers_openai_then_ends_when_a_rank_dies(text_model):
    """Two torchrun launches with --nnodes 2 rendezvous on localhost, as two machines would; node 0 serves HTTP.
    When node 1's rank is killed, node 0's torchrun cannot see it: the server itself must notice and exit."""
    master, port = _free_port(), _free_port()
    nodes = []
    for node in (0, 1):
        rendezvous = ("--nnodes=2", f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={master}")
        command = _torchrun("-m", "hf_paged.cli", "serve", text_model, "--port", str(port),
                            "--distributed-timeout", "20", nproc=1, rendezvous=rendezvous)
        nodes.append(subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_up(base, nodes[0], timeout=180)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        answer = client.completions.create(model=text_model, prompt=PROMPT, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == _one_process_text(text_model)
        stream = client.chat.completions.create(model=text_model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream)
        time.sleep(1.5)  # idle: the heartbeat keeps the waiting rank from timing out
        for pid in _descendants(nodes[1].pid):
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = nodes[0].communicate(timeout=60)
        assert nodes[0].returncode != 0
        assert time.monotonic() - killed < 30
        assert "another rank died or stopped answering" in stderr, stderr[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()


def test_sigterm_to_the_launcher_lets_rank_0_finish_then_ends_every_rank(text_model):
    """As a supervisor stops `hf-paged serve -tp 2`: the stream in flight ends as it would in one process, then no
    rank is left running."""
    port = _free_port()
    command = [sys.executable, "-m", "hf_paged.cli", "serve", text_model, "-tp", "2", "--port", str(port),
               "--shutdown-timeout", "25"]
    launcher = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_up(base, launcher, timeout=180)
        processes = _descendants(launcher.pid)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        stream = iter(client.completions.create(model=text_model, prompt=PROMPT, max_tokens=200, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        chunks = [next(stream)]
        launcher.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, stderr[-3000:]
        assert not [pid for pid in processes if Path(f"/proc/{pid}").exists()], stderr[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()


def _refusal(capsys, monkeypatch, argv: list[str]) -> str:
    """The command line's error for ``argv``, run in this process, where no rank may start: exit status 2 and one
    error line."""
    from hf_paged import distributed
    from hf_paged.cli import main

    def launch(*args, **kwargs):
        raise AssertionError(f"{argv} started its ranks")

    monkeypatch.setattr(distributed, "launch", launch)
    monkeypatch.setenv(distributed.CPU_BIND_ENV, "")  # --cpu-bind sets it: put back as it was after the test
    monkeypatch.delenv(distributed.CPU_BIND_ENV)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("error:") == 1, err
    return err


def test_options_every_rank_would_refuse_are_refused_before_the_ranks_start(text_model, tmp_path, capsys,
                                                                            monkeypatch):
    draft = json.dumps({"model": text_model})
    for option in (["--temperature", "-1"], ["--tensor-parallel-size", "0"], ["-tp", "3"],  # 4 heads on 3 ranks
                   ["--cpu-bind", "0-0"], ["--cpu-bind", "0-0|1|1"], ["--cpu-bind", "0|4096"],
                   ["--speculative-config", draft], ["--enable-lora"]):
        _refusal(capsys, monkeypatch, ["generate", text_model, PROMPT, "-tp", "2", *option])
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    shutil.copy(Path(text_model) / "config.json", no_weights / "config.json")
    quantized = tmp_path / "quantized"
    shutil.copytree(text_model, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    no_plan = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(no_plan)
    for model, words in ((no_weights, "holds no weights"), (quantized, "quantized"),
                         (no_plan, "no tensor-parallel plan")):
        assert words in _refusal(capsys, monkeypatch, ["generate", str(model), PROMPT, "-tp", "2"])


def test_cpu_shares_and_head_layouts(monkeypatch):
    from transformers import AutoConfig

    from hf_paged.distributed import cpu_share, kv_heads_need_replication

    assert len(cpu_share(0, 1, "auto")) == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 6, 7, 8})
    assert cpu_share(1, 2, "0-3|4,6") == [4, 6]
    assert cpu_share(0, 2, "0-3|4,6-8") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="names 1 core lists for 2 local ranks"):
        cpu_share(0, 2, "0-3")
    with pytest.raises(ValueError, match=r"names cores this process cannot use \(\[5\]; it may use 0-4,6-8\)"):
        cpu_share(1, 2, "0-3|4-5")
    with pytest.raises(ValueError, match="is not a list of cores"):
        cpu_share(0, 1, "a-b")
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=1, hidden_size=64)
    assert kv_heads_need_replication(config, 2) and not kv_heads_need_replication(config, 1)
    smollm2 = AutoConfig.for_model("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert not kv_heads_need_replication(smollm2, 3)
    with pytest.raises(ValueError, match="the 9 query heads to split evenly"):
        kv_heads_need_replication(smollm2, 2)


def test_the_other_ranks_rebuild_each_request_whole(tokenizer_path):
    """Ranks rebuild each request from the fields rank 0 sends (`Request.wire_fields`). LongRoPE's cache salt was
    not among them: on the other ranks a long prompt matched a short one's cached blocks, on rank 0 not, and the
    schedules parted. Nor was the arrival time, which breaks ties of priority."""
    from dataclasses import fields

    from transformers import AutoModelForCausalLM

    from hf_paged import ContinuousBatchGenerator, SamplingParams
    from hf_paged.generation.sequence import Request

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 16}
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
                         rope_scaling=rope, **COMMON)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
    gen = ContinuousBatchGenerator(model, AutoTokenizer.from_pretrained(tokenizer_path), num_blocks=32, block_size=4)
    gen.add_request(list(range(3, 40)), SamplingParams(temperature=0.5, max_tokens=4, stop=["x"]), request_id="r")
    action, sent = gen._inbox.get_nowait()  # what rank 0 would send
    rebuilt = Request(**sent.wire_fields())
    assert action == "add" and sent.cache_salt is not None
    kept = {"seqs", "metrics"}  # a rank's own, made when the request is built
    assert all(getattr(rebuilt, f.name) == getattr(sent, f.name) for f in fields(Request) if f.name not in kept)
    assert rebuilt.stop_ids == sent.stop_ids and rebuilt.stop_holdback == sent.stop_holdback


def test_llm_starts_its_own_ranks_as_vllms_does(text_model, monkeypatch):
    """``LLM(model, tensor_parallel_size=2)`` from one process: this process is rank 0 and the other rank is a local
    process. It answers as one process does; a rank that dies makes the next call raise at once (not at a timeout),
    and shutting down gives the process its environment back."""
    import multiprocessing

    from hf_paged import LLM, SamplingParams
    from hf_paged.distributed import DistributedError

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, n=2)
    prompts = [PROMPT, "Hello", [1, 504, 3458]]
    answers = lambda llm: [[c.token_ids for c in o.outputs] for p in (greedy, sampled)  # noqa: E731
                           for o in llm.generate(prompts, p, use_tqdm=False)]
    expected = answers(LLM(text_model, num_blocks=64))
    for size, words in ((3, "the 4 query heads to split evenly"), (0, "must be a positive integer")):
        with pytest.raises(ValueError, match=words):
            LLM(text_model, tensor_parallel_size=size)
    with pytest.raises(ValueError, match="enable_lora is not supported under tensor parallelism"):
        LLM(text_model, tensor_parallel_size=2, enable_lora=True)
    with monkeypatch.context() as one_gpu:
        one_gpu.setattr(torch.cuda, "is_available", lambda: True)
        one_gpu.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(ValueError, match="needs a GPU per rank; 1 are visible"):
            LLM(text_model, tensor_parallel_size=2)
    assert not multiprocessing.active_children()  # refused before any rank started

    llm = LLM(text_model, tensor_parallel_size=2, num_blocks=64)
    try:
        assert llm.generator.lockstep is not None and os.environ["WORLD_SIZE"] == "2"
        assert answers(llm) == expected
        for pooled in (lambda: llm.embed("Hello"), lambda: llm.score("Hello", "Hi")):  # rank 0's forward alone
            with pytest.raises(ValueError, match="embeddings are not served under tensor parallelism"):
                pooled()
        with pytest.raises(ValueError, match="already a rank of a tensor-parallel group"):
            LLM(text_model, tensor_parallel_size=2)
        # A value that cannot reach the other ranks is refused by name, not sent to fail the step of every request.
        with pytest.raises(ValueError, match="SamplingParams.extra_args must pickle"):
            llm.generate(prompts, [greedy, greedy.replace(extra_args={"lock": threading.Lock()}), greedy])
        assert answers(llm) == expected
        [rank1] = multiprocessing.active_children()
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        started = time.monotonic()
        with pytest.raises(DistributedError, match="another rank died"):
            llm.generate(prompts, greedy, use_tqdm=False)
        assert time.monotonic() - started < 10
    finally:
        llm.shutdown()
    assert "WORLD_SIZE" not in os.environ and not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()
    cores = os.sched_getaffinity(0)

    monkeypatch.setenv("HF_PAGED_CPU_BIND", "1")  # rank 0, this process, is bound to its cores: given back after
    llm = LLM(text_model, tensor_parallel_size=2, num_blocks=64)
    execute, steps = llm.generator.runner.execute, []

    def interrupted(*args, **kwargs):  # Ctrl+C on rank 0 at its third step, the other rank still in it
        out = execute(*args, **kwargs)
        steps.append(out)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return out

    llm.generator.runner.execute = interrupted
    try:
        # Ctrl+C mid-step (SIGINT reaches rank 0 at its third step): the step ends on every rank, then rank 0 raises,
        # and the group goes on, as one process would.
        def signalled(*args, **kwargs):
            steps.append(execute(*args, **kwargs))
            if len(steps) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return steps[-1]

        llm.generator.runner.execute = signalled
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, greedy, use_tqdm=False)
        assert len(steps) == 3 and answers(llm)[:3] == expected[:3]
        steps.clear()
        llm.generator.runner.execute = interrupted  # an interrupt raised inside the step itself breaks the group
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, greedy, use_tqdm=False)
        started = time.monotonic()
        with pytest.raises(DistributedError, match="a step was interrupted"):  # it waited for ever
            llm.generate(prompts, greedy, use_tqdm=False)
    finally:
        llm.shutdown()  # the other rank ignores SIGTERM and waits in a collective: it is killed, at once
    assert time.monotonic() - started < 10 and not multiprocessing.active_children()
    assert os.sched_getaffinity(0) == cores

    llm = LLM(text_model, tensor_parallel_size=2, num_blocks=64)

    def failing(*args, **kwargs):  # rank 0 runs out of memory, say; the other rank waits in the forward's collective
        raise MemoryError("no room for this step")

    llm.generator.runner.execute = failing
    try:
        with pytest.raises(DistributedError, match="forward failed on this rank: MemoryError"):
            llm.generate(prompts, greedy, use_tqdm=False)
        started = time.monotonic()
        with pytest.raises(DistributedError, match="a forward failed on rank 0"):  # at once, not at a timeout
            llm.generate(prompts, greedy, use_tqdm=False)
    finally:
        llm.shutdown()  # the other rank is killed, not told to stop
    assert time.monotonic() - started < 10 and not multiprocessing.active_children()


def test_a_rank_that_fails_to_load_is_named_with_its_error(text_model, monkeypatch):
    """Rank 0 sees only the closed connection of a rank that failed while loading: the error names that rank and
    what failed it, and nothing is left running."""
    import functools
    import multiprocessing

    from hf_paged.distributed import DistributedError
    from hf_paged.local_ranks import LocalRanks
    from tp_worker import engine_failing_beside_rank_0

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 failed to start: MemoryError: no room for this shard"):
        LocalRanks(2, functools.partial(engine_failing_beside_rank_0, text_model))
    assert time.monotonic() - started < 60 and not multiprocessing.active_children()
    assert "WORLD_SIZE" not in os.environ and not torch.distributed.is_initialized()


def test_a_rank_whose_process_cannot_start_is_named_at_once():
    """A rank that exits before it runs (a script without its __main__ guard) fails the start at once, naming it
    and the guard; rank 0 waited for it until the rendezvous's timeout, then blamed the rendezvous."""
    import multiprocessing

    from hf_paged.distributed import DistributedError
    from hf_paged.local_ranks import LocalRanks
    from tp_worker import LoadThatCannotReachARank

    started = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 exited \(code 1\) before it could start .*__main__"):
        LocalRanks(2, LoadThatCannotReachARank())
    assert time.monotonic() - started < 30 and not multiprocessing.active_children()
    assert "WORLD_SIZE" not in os.environ and not torch.distributed.is_initialized()


def test_async_llm_starts_its_own_ranks(text_model, monkeypatch):
    import asyncio
    import multiprocessing

    from hf_paged import AsyncLLM, SamplingParams
    from hf_paged.engine_loop import EngineError

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = AsyncLLM(text_model, tensor_parallel_size=2, num_blocks=64)

    async def answer(prompt: str) -> list[int]:
        async for output in engine.generate(prompt, greedy):
            pass
        return output.outputs[0].token_ids

    async def both() -> list[list[int]]:
        first = await answer(PROMPT)
        await asyncio.sleep(1.5)  # idle: the engine thread's heartbeats keep the other rank in step
        return [first, *await asyncio.gather(answer(PROMPT), answer("Hello"))]

    try:
        got = asyncio.run(both())
        [rank1] = multiprocessing.active_children()
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        with pytest.raises(EngineError):  # this process goes on (a server's would end, for torchrun to see)
            asyncio.run(answer(PROMPT))
        assert engine.errored
    finally:
        engine.shutdown()
    assert not multiprocessing.active_children() and "WORLD_SIZE" not in os.environ
    from hf_paged import LLM

    one = LLM(text_model, num_blocks=64).generate([PROMPT, "Hello"], greedy, use_tqdm=False)
    assert got == [one[0].outputs[0].token_ids, one[0].outputs[0].token_ids, one[1].outputs[0].token_ids]


def test_an_async_llm_left_running_at_exit_ends_its_ranks_quietly(text_model, tmp_path):
    """A script that fails (or ends) with its AsyncLLM never shut down: the engine thread stops before the ranks,
    where the ranks' own exit handler stopped them under it, and it logged that as its own failure."""
    script = tmp_path / "left_running.py"
    script.write_text(
        "import asyncio, sys\n"
        "from hf_paged import AsyncLLM, SamplingParams\n"
        "async def main(engine):\n"
        "    async for out in engine.generate('Hello', SamplingParams(max_tokens=4, temperature=0)):\n"
        "        pass\n"
        "    raise RuntimeError('the script failed')\n"
        "if __name__ == '__main__':\n"
        f"    engine = AsyncLLM({text_model!r}, tensor_parallel_size=2, num_blocks=64)\n"
        "    asyncio.run(main(engine))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1 and "RuntimeError: the script failed" in run.stderr
    assert "unrecoverable" not in run.stderr and "Traceback" not in run.stderr.split("the script failed", 1)[1]
