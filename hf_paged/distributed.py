"""Tensor parallelism over torch.distributed: one model split across the ranks of a process group.

The model is sharded by Transformers itself (``DistributedConfig(tp_size=N)``: column/row-parallel linear layers, an
all-reduce after each attention and MLP block, logits gathered on every rank). What hf_paged adds:

- `load_tensor_parallel_kwargs` / `shard_replicated_kv_heads`: models with fewer KV heads than ranks (or a count the
  ranks do not divide) keep their key/value projections whole at load, and each rank then keeps the one KV head its
  query heads use (vLLM's ``max(1, kv_heads // tp)`` per rank); Transformers would split such a head in halves.
- `Lockstep`: every rank runs the same deterministic scheduler on the same requests. Requests and aborts enter on
  rank 0, which broadcasts each step's inbox actions before the step; sampling is counter-based and the gathered
  logits are identical on every rank, so every rank samples the same tokens (checked every ``CHECK_EVERY`` steps).
- `init_process_group` with a timeout, and `DistributedError`: a dead rank or a collective that times out ends the
  whole group with a message instead of a hang.
- `set_cpu_threads`: each rank's share of the CPU cores, optionally bound to them (``HF_PAGED_CPU_BIND``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import signal
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from .kernels.cpu_linear import PrepackedLinear, available

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
HEARTBEAT_S = 1.0  # an idle rank 0 still steps this often, so waiting ranks do not time out and dead ones are found
CHECK_EVERY = 16  # steps between two comparisons of the tokens every rank sampled
CPU_BIND_ENV = "HF_PAGED_CPU_BIND"
KV_PROJECTIONS = ("k_proj", "v_proj")
_timeout_s = DEFAULT_TIMEOUT_S  # of the lockstep's collectives (waits for rank 0's next step); see init_process_group


class DistributedError(RuntimeError):
    """A collective failed: a rank died, timed out, or sampled other tokens. The group cannot go on."""


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether Transformers sharded ``model`` across ranks (``DistributedConfig(tp_size > 1)``)."""
    return (getattr(model, "_tp_size", None) or 1) > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def init_process_group(timeout_s: float = DEFAULT_TIMEOUT_S, step_wait_s: float | None = None) -> None:
    """Join the group that torchrun (or `launch`) described in the environment: NCCL on GPU, gloo on CPU. Its
    collectives give up after ``timeout_s``; those of the lockstep (the ranks waiting for rank 0's next step) after
    ``step_wait_s`` (default: the same)."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        raise DistributedError("tensor parallelism needs the ranks' rendezvous in the environment (MASTER_ADDR, "
                               "RANK, WORLD_SIZE): start under torchrun, or with --tensor-parallel-size")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    global _timeout_s
    _timeout_s = timeout_s if step_wait_s is None else step_wait_s


def destroy_process_group() -> None:
    """Leave the group, on a clean exit: a process that ends in it can abort (SIGABRT, "terminate called without an
    active exception") while the interpreter finalizes, gloo's worker threads still holding work."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def smallest_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` any rank has (a collective: every rank calls it)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def launch(args: list[str], nproc: int, interrupted_code: int | None = None) -> int:
    """Run ``python ARGS`` as ``nproc`` local ranks under torchrun (standalone rendezvous on a free port) and return
    its exit code. torchrun ends every rank as soon as one fails. On CPU each rank gets ``cores // nproc`` threads
    unless ``OMP_NUM_THREADS`` says otherwise.

    Ctrl+C and SIGTERM sent to this process go to the ranks, once (torchrun runs in a session of its own, out of the
    terminal's reach): rank 0 finishes as a single process would and stops the others, which ignore them, so
    torchrun ends cleanly. Where the ranks cannot be found (no ``/proc``) torchrun gets the signal and ends them.
    With ``interrupted_code``, a clean end after Ctrl+C returns that code (a rank's own non-zero code would read to
    torchrun as a failure)."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    process = subprocess.Popen(command, env=env, start_new_session=True)

    interrupted = []

    def forward(signum, _frame) -> None:
        interrupted.append(signum)
        for pid in _children(process.pid) or [process.pid]:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(pid, signum)

    # A closed terminal (SIGHUP) or SIGQUIT must reach them too: torchrun is out of this process group.
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        code = process.wait()
        return interrupted_code if code == 0 and signal.SIGINT in interrupted and interrupted_code else code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's ``/proc``; empty elsewhere)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return [int(c) for task in tasks for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
    except OSError:
        return []


# ------------------------------------------------------------------------------------------------ loading
def kv_heads_need_replication(config, tp_size: int) -> bool:
    """Whether ``tp_size`` ranks cannot split ``config``'s KV heads evenly (each rank then keeps one whole head).

    Raises ``ValueError`` for head counts no layout serves: the query heads must divide, and the KV heads must
    divide or be divided by the ranks.
    """
    config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp_size or (kv_heads % tp_size and tp_size % kv_heads):
        raise ValueError(f"tensor parallelism over {tp_size} ranks needs the {heads} query heads to split evenly and "
                         f"the {kv_heads} KV heads to divide or be divided by {tp_size}")
    return kv_heads % tp_size != 0


def check_checkpoint(path) -> None:
    """Refuse a checkpoint no rank could shard: a quantized (GPTQ/AWQ) one."""
    from .quantization import quantization_method

    if quantization_method(path) is not None:
        raise ValueError("tensor parallelism is not supported for quantized (GPTQ/AWQ) checkpoints")


def check_engine_config(config) -> None:
    """Refuse (``ValueError``) the `EngineConfig` options that tensor parallelism does not serve."""
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ValueError("speculative_config.method 'draft_model' is not supported under tensor parallelism")
    if config.enable_lora:
        raise ValueError("EngineConfig.enable_lora is not supported under tensor parallelism yet")


def load_tensor_parallel_kwargs(config, tp_size: int) -> dict:
    """``from_pretrained`` keyword arguments that shard a model with ``config`` over ``tp_size`` ranks."""
    from transformers.distributed import DistributedConfig

    if not config.base_model_tp_plan:
        raise ValueError(f"{config.model_type} has no tensor-parallel plan in Transformers (base_model_tp_plan), "
                         "so it cannot be split across ranks")
    if kv_heads_need_replication(config, tp_size):
        # Keep the key/value projections whole; `shard_replicated_kv_heads` cuts each rank's head out after loading.
        config.base_model_tp_plan = {name: style for name, style in config.base_model_tp_plan.items()
                                     if name.rsplit(".", 1)[-1] not in KV_PROJECTIONS}
    return dict(config=config, distributed_config=DistributedConfig(tp_size=tp_size))


def shard_replicated_kv_heads(model: torch.nn.Module) -> None:
    """Keep, in each attention layer whose k/v projections were loaded whole, the KV head this rank's queries use."""
    config = model.config.get_text_config(decoder=True)
    tp_size = getattr(model, "_tp_size", None) or 1
    if tp_size <= 1 or not kv_heads_need_replication(config, tp_size):
        return
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head = rank() * kv_heads // tp_size  # the ranks' query heads are consecutive, and so are each KV head's groups
    for module in model.modules():
        if not all(isinstance(getattr(module, name, None), torch.nn.Linear) for name in KV_PROJECTIONS):
            continue
        head_dim = module.head_dim
        for name in KV_PROJECTIONS:
            _keep_rows(getattr(module, name), head * head_dim, (head + 1) * head_dim)
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = config.num_attention_heads // tp_size


def _keep_rows(linear: torch.nn.Linear, start: int, end: int) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.data[start:end].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


class ShardedPrepackedLinear(PrepackedLinear):
    """A `PrepackedLinear` whose tensor-parallel wrapper calls its forward with the local shard as its weight."""


def prepack_sharded_linear_layers(model: torch.nn.Module) -> int:
    """`hf_paged.kernels.cpu_linear.prepack_linear_layers` for the linear layers Transformers sharded (their weights
    are DTensors): each becomes a `PrepackedLinear` under the same tensor-parallel style, re-installed around it, and
    packs its local shard on its first forward. Returns how many changed (they stay packed; unpacking skips them)."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, _get_parameter_plan

    mesh = model._mesh_manager.get_mesh("tp")
    count = 0
    for name, module in model.named_modules():
        style = _get_parameter_plan(name, model.tp_plan, is_weight=False)
        weight = getattr(module, "weight", None)
        if (type(module) is not torch.nn.Linear or style is None or "forward" not in module.__dict__
                or not hasattr(weight, "to_local") or weight.device.type != "cpu" or not available(weight.dtype)):
            continue
        del module.forward  # the style's wrapper around nn.Linear.forward; installed again around the packed one
        module.__class__ = ShardedPrepackedLinear
        ALL_PARALLEL_STYLES[style].install_forward(module, mesh)
        count += 1
    return count


# ------------------------------------------------------------------------------------------------ CPU cores
def _parse_cpus(text: str, allowed: list[int]) -> list[int]:
    cpus = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"{CPU_BIND_ENV}: {text!r} is not a list of cores such as 0-3,8") from None
    missing = sorted(set(cpus) - set(allowed))
    if not cpus or missing:
        raise ValueError(f"{CPU_BIND_ENV}: {text!r} names cores this process cannot use ({missing or 'none'}; it may "
                         f"use {_runs(allowed)})")
    return cpus


def _runs(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    runs, start = [], None
    for i, cpu in enumerate(cpus):
        start = cpu if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            runs.append(f"{start}-{cpu}" if cpu != start else str(cpu))
            start = None
    return ",".join(runs)


def cpu_bind_setting(value: str | None) -> str | None:
    """``HF_PAGED_CPU_BIND`` / ``--cpu-bind`` as `cpu_share` takes it: None (unset, empty or 0: no binding), "auto"
    (or 1), or core lists."""
    return None if value in (None, "", "0") else "auto" if value == "1" else value


def cpu_share(local_rank: int, local_world: int, bind: str | None = None) -> list[int]:
    """The cores of local rank ``local_rank``: its run of ``1/local_world`` of the allowed cores, or with ``bind``
    naming one list per local rank, separated by ``|`` (``"0-3|4-7"``, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND``),
    its list."""
    allowed = sorted(os.sched_getaffinity(0))
    if bind and bind != "auto":
        lists = bind.split("|")
        if len(lists) != local_world:
            raise ValueError(f"{CPU_BIND_ENV}={bind!r} names {len(lists)} core lists for {local_world} local ranks")
        return _parse_cpus(lists[local_rank], allowed)
    per_rank = max(1, len(allowed) // local_world)
    start = (local_rank * per_rank) % len(allowed)
    return allowed[start:start + per_rank]


def set_cpu_threads() -> list[int] | None:
    """On CPU, give this rank its share of the cores (bound to them when ``HF_PAGED_CPU_BIND`` is set); an explicit
    ``OMP_NUM_THREADS`` wins over the share's size. Returns the cores bound, or None."""
    if torch.cuda.is_available():
        return None
    bind = cpu_bind_setting(os.environ.get(CPU_BIND_ENV))
    cpus = cpu_share(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), bind)
    if bind:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(cpus)))
    return cpus if bind else None


# ------------------------------------------------------------------------------------------------ lockstep
def _pickles(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001
        return False
    return True


class Lockstep:
    """Keeps the generators of all ranks stepping on the same inputs.

    `exchange` runs at the start of every step: rank 0 sends the actions its inbox held (requests as plain fields,
    aborts, stop), the other ranks receive them and drop whatever their own inbox held. One small collective a step,
    on a gloo group (objects travel on CPU whatever the model's device). `check_tokens` compares a digest of the
    tokens sampled since the last check.
    """

    def __init__(self):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=_timeout_s))
        self._digest = hashlib.sha256()
        self._steps = 0
        self.broken: str | None = None  # why the ranks can no longer step together, once they cannot

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def _collective(self, what: str, function, *args):
        try:
            return function(*args, group=self.group)
        except Exception as err:  # gloo reports a dead peer or a timeout as a RuntimeError of its own
            raise DistributedError(f"rank {self.rank}: {what} failed, another rank died or stopped answering "
                                   f"({err}); the tensor-parallel group cannot go on") from err

    @staticmethod
    def check_sendable(request) -> None:
        """Refuse (``InvalidParameter``) a request that could not reach the other ranks, whose values do not all
        pickle (a lock in ``SamplingParams.extra_args``, say): in a step's input broadcast it would fail every request
        of the step."""
        from .generation.sampling_params import InvalidParameter

        try:
            pickle.dumps(request.wire_fields())
        except Exception as err:  # noqa: BLE001 - whatever pickling raises, the request cannot travel
            params = request.params
            name = next((f.name for f in dataclasses.fields(params) if not _pickles(getattr(params, f.name))), None)
            raise InvalidParameter(name or "prompt", f"{'SamplingParams.' + name if name else 'the request'} must "
                                   f"pickle to reach the other tensor-parallel ranks ({err!r})") from err

    def exchange(self, actions: list[tuple]) -> list[tuple]:
        """Rank 0's inbox ``actions`` (``("add", Request)``, ``("abort", id)``, ``("stop", None)``) on every rank.

        A request travels as its fields and is rebuilt on each rank, whose own sequence ids it then gets.
        """
        from .generation.sequence import Request

        if self.broken is not None:
            raise DistributedError(f"rank {self.rank}: {self.broken}, so the ranks no longer agree; the "
                                   "tensor-parallel group cannot go on (start the engine again)")
        box = [[(a, x.wire_fields() if a == "add" else x) for a, x in actions] if self.is_driver else None]
        self._collective("the step's input broadcast", dist.broadcast_object_list, box, 0)
        if self.is_driver:
            return actions
        return [(a, Request(**x) if a == "add" else x) for a, x in box[0]]

    @property
    def digest(self) -> str:
        """A digest of every token this rank sampled so far."""
        return self._digest.hexdigest()

    def check_tokens(self, tokens: list[int]) -> None:
        """Every ``CHECK_EVERY`` steps, raise `DistributedError` unless all ranks sampled the same tokens."""
        self._digest.update(repr(tokens).encode())
        self._steps += 1
        if self._steps % CHECK_EVERY:
            return
        digests = [None] * self.world_size
        self._collective("the sampled-token check", dist.all_gather_object, digests, self.digest)
        if len(set(digests)) > 1:
            raise DistributedError(f"the ranks sampled different tokens (digests {digests}): their logits differ, "
                                   "so their caches can no longer agree")
