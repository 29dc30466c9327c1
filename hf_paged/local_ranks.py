"""Tensor parallelism from one Python process, as vLLM's ``LLM(model, tensor_parallel_size=N)`` gives it: this
process is rank 0 and takes the requests; ranks 1..N-1 are local processes started here (vLLM's "mp" executor),
each loading its shard and stepping in lockstep (`ContinuousBatchGenerator.run_worker`) until `LocalRanks.stop`."""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import signal
import socket
import time

import torch

from . import distributed

# The ranks wait for rank 0's next step, and an offline LLM may sit idle between two calls for as long as its user
# likes: the lockstep's collectives wait that long. A rank that dies closes its connections, which ends the others'
# waits; starting, loading and a step's own collectives keep the usual timeout.
IDLE_WAIT_S = 365 * 24 * 3600.0
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(rank: int, size: int, port: int) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size)}


def start_engine(model, dtype: str, device: str, trust_remote_code: bool, tokenizer, engine_options: dict,
                 tensor_parallel_size: int = 1, quantization: str | None = None, revision: str | None = None,
                 download_dir: str | os.PathLike | None = None, load_format: str = "auto"):
    """``(generator, ranks)``: the engine `LLM` and `AsyncLLM` serve (see `default_model.resolve_model` for the model
    and its ``revision`` and ``download_dir``, `loading.load_model` for the other arguments of the model,
    `EngineConfig` for ``engine_options``, `quantization.check_quantization` for ``quantization``), and with
    ``tensor_parallel_size > 1`` the `LocalRanks` it runs on (None on one process)."""
    from .default_model import resolve_model
    from .loading import LOAD_FORMATS

    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = resolve_model(model, revision, download_dir)
    if quantization is not None:
        from .quantization import check_quantization

        check_quantization(path, quantization)
    load = functools.partial(_load_engine, path, dtype, device, trust_remote_code, tokenizer, engine_options,
                             load_format)
    if tensor_parallel_size == 1:
        return load(1), None
    if load_format == "dummy":
        raise ValueError("random weights (load_format dummy) are built on one process, not tensor parallel")
    _check(path, tensor_parallel_size, trust_remote_code, engine_options)
    ranks = LocalRanks(tensor_parallel_size, load)
    return ranks.generator, ranks


def _load_engine(model, dtype: str, device: str, trust_remote_code: bool, tokenizer, engine_options: dict,
                 load_format: str, tensor_parallel_size: int):
    """One rank's engine (every rank runs this)."""
    from .generation import ContinuousBatchGenerator
    from .loading import load_model, resolve_device

    hf_model, hf_tokenizer = load_model(model, dtype, resolve_device(device), trust_remote_code=trust_remote_code,
                                        tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
                                        load_format=load_format)
    return ContinuousBatchGenerator(hf_model, hf_tokenizer, **engine_options)


def _check(model, size: int, trust_remote_code: bool, engine_options: dict) -> None:
    """Refuse (``ValueError``), before any rank starts, what every rank would refuse alike: the engine options
    tensor parallelism does not serve, a quantized checkpoint, heads that ``size`` ranks cannot split, fewer GPUs
    than ranks (each rank takes its own)."""
    from transformers import AutoConfig

    from .default_model import resolve_model
    from .generation.config import EngineConfig

    path = resolve_model(model)
    if torch.cuda.is_available() and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size {size} needs a GPU per rank; {torch.cuda.device_count()} are visible")
    distributed.check_engine_config(EngineConfig().replace(**engine_options))
    distributed.check_checkpoint(path)
    distributed.load_tensor_parallel_kwargs(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code),
                                            size)


class LocalRanks:
    """Start ranks 1..``size``-1 of a tensor-parallel engine and join them as rank 0 (this process's environment
    then says so, until `stop`). Each rank calls ``load(size)``, which returns its `ContinuousBatchGenerator`
    (``load`` must pickle: a module-level function or a `functools.partial` of one)."""

    def __init__(self, size: int, load):
        if torch.distributed.is_initialized() or "WORLD_SIZE" in os.environ:
            raise ValueError("this process is already a rank of a tensor-parallel group (torchrun, or another LLM "
                             "with tensor_parallel_size): under torchrun, use load_model and the generator on every "
                             "rank (see the README); else shut the other LLM down first")
        port = _free_port()
        self.saved_env = {name: os.environ.get(name) for name in _RENDEZVOUS}
        self.saved_threads = torch.get_num_threads()
        self.saved_cores = os.sched_getaffinity(0)  # a bound rank 0 (HF_PAGED_CPU_BIND) is this process
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or locks
        self.failures = context.SimpleQueue()  # (rank, error) of a rank that failed to start: written at once
        self.started = context.Semaphore(0)  # released by each rank once its process runs `_serve_rank`
        self.processes = [context.Process(target=_serve_rank, args=(_rank_env(rank, size, port), load, size,
                                                                    self.failures, self.started),
                                          name=f"hf-paged-rank{rank}", daemon=True) for rank in range(1, size)]
        try:
            for process in self.processes:
                process.start()
            # Before multiprocessing's own exit handler (registered earlier, so run later), which would SIGTERM the
            # ranks and wait for them: they ignore SIGTERM, as rank 0 stops them.
            atexit.register(self.stop)
            self._wait_started()
            os.environ.update(_rank_env(0, size, port))
            distributed.init_process_group(step_wait_s=IDLE_WAIT_S)
            self.generator = load(size)
        except BaseException as err:
            self.processes = [process for process in self.processes if process.pid is not None]  # those started
            self._end(terminate=True)
            if not self.failures.empty():  # rank 0 saw only the closed connection of the rank that failed
                rank, error = self.failures.get()
                raise distributed.DistributedError(f"rank {rank} failed to start: {error}") from err
            raise

    def _wait_started(self) -> None:
        """Wait until every rank's process runs: one that exits before (a script without the ``if __name__ ==
        "__main__":`` guard, which each rank's process imports again, say) is named now, not by the rendezvous's
        timeout."""
        deadline = time.monotonic() + distributed.DEFAULT_TIMEOUT_S
        for _ in self.processes:
            while not self.started.acquire(timeout=0.1):
                for rank, process in enumerate(self.processes, start=1):
                    if process.exitcode is not None:
                        raise distributed.DistributedError(
                            f"rank {rank} exited (code {process.exitcode}) before it could start (its error is "
                            "above; each rank's process imports the main script again, so a script must start "
                            "ranks under `if __name__ == '__main__':`)")
                if time.monotonic() > deadline:
                    raise distributed.DistributedError(f"the ranks did not start within "
                                                       f"{distributed.DEFAULT_TIMEOUT_S:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        """End the other ranks (after the step in flight) and leave the group; idempotent."""
        if not self.processes:
            return
        stopped = False
        try:
            self.generator.stop_workers()
            stopped = True
        except distributed.DistributedError:  # a rank died: the others cannot be told, they are ended instead
            pass
        finally:
            self._end(terminate=not stopped, timeout=timeout)

    def _end(self, terminate: bool, timeout: float = 30.0) -> None:
        """Join the ranks (``terminate``: kill them first; they ignore SIGTERM, as rank 0 stops them)."""
        for process in self.processes if terminate else ():
            process.kill()
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []
        atexit.unregister(self.stop)
        distributed.destroy_process_group()
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_num_threads(self.saved_threads)
        os.sched_setaffinity(0, self.saved_cores)


def _serve_rank(env: dict[str, str], load, size: int, failures, started) -> None:
    """A started rank: Ctrl+C reaches the whole terminal, and rank 0 alone acts on it. What fails it before it
    serves is told to rank 0 through ``failures``."""
    started.release()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    try:
        distributed.init_process_group(step_wait_s=IDLE_WAIT_S)
        generator = load(size)
    except BaseException as err:
        failures.put((int(env["RANK"]), f"{type(err).__name__}: {err}"))
        raise
    try:
        generator.run_worker()
    finally:
        distributed.destroy_process_group()
