"""`DecodeGraphs`: decode steps replayed from CUDA graphs, one graph per batch-size bucket, as vLLM does.

A step of ``n`` sequences with one new token each runs the graph of the smallest bucket that holds ``n``. Its inputs
are copied into buffers the graph reads from; the rows past ``n`` are padding, which writes no key or value
(slot ``-1``) and attends to nothing (length 0). A graph is captured the first time its bucket is needed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from ..cache import PagedKVStorage, PagedMetadata
from ..distributed import is_tensor_parallel
from .config import EngineConfig
from .model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256
Replay = Callable[[], torch.Tensor]  # runs the captured step again; returns its (reused) logits tensor


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's buckets: 1, 2, 4, the multiples of 8 below ``max_num_seqs``, and ``max_num_seqs`` itself (at most 256)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return tuple(sorted({s for s in (1, 2, 4, *range(8, top, 8)) if s < top} | {top}))


def decode_graphs(runner: ModelRunner, config: EngineConfig, max_model_len: int) -> DecodeGraphs | None:
    """The CUDA graphs of ``runner``'s decode steps; None on CPU, with ``enforce_eager`` and under tensor
    parallelism (graphs do not hold its collectives here)."""
    if config.enforce_eager or runner.device.type != "cuda" or is_tensor_parallel(runner.model):
        return None
    return DecodeGraphs(runner.forward, runner.kv, capture_sizes(config.max_num_seqs),
                        math.ceil(max_model_len / runner.kv.block_size))


class CudaGraphCapture:
    """Captures a step function as a CUDA graph, after one warm-up run on a side stream (kernels are compiled and
    autotuned, workspaces allocated). All graphs of one engine share a memory pool: they never run at once."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Callable[[], torch.Tensor]) -> Replay:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay


class DecodeGraphs:
    """Runs decode steps of up to ``sizes[-1]`` sequences through captured graphs of ``forward``.

    ``capture`` turns a step function into a replay (`CudaGraphCapture`; the tests pass one that runs on CPU and
    refuses host reads of tensor values). A capture that fails turns the graphs off, with a warning, and the step
    runs eagerly: a model whose forward reads tensors on the host, say, still runs.
    """

    def __init__(self, forward: Callable[[StepInputs], torch.Tensor], kv: PagedKVStorage, sizes: tuple[int, ...],
                 max_blocks_per_seq: int, capture: Callable[[Callable[[], torch.Tensor]], Replay] | None = None):
        self.forward = forward
        self.kv = kv
        self.sizes = sizes
        self.capture = capture or CudaGraphCapture()
        self.replays: dict[int, Replay] = {}
        self.disabled: str | None = None
        rows, device = sizes[-1], kv.device
        self.input_ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.sample_rows = torch.arange(rows, dtype=torch.long, device=device)

    def bucket(self, step: StepInputs) -> int | None:
        """The graph size that runs ``step``, or None if no graph can: not every sequence decodes one token, or
        the step is larger than the largest graph."""
        metadata = step.metadata
        if self.disabled or metadata.max_query_len != 1 or metadata.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        return next((size for size in self.sizes if size >= step.num_tokens), None)

    def run(self, step: StepInputs) -> torch.Tensor | None:
        """The logits of ``step``'s sample rows, from a graph; None when the step must run eagerly."""
        size = self.bucket(step)
        if size is None:
            return None
        self._load(step, size)
        replay = self.replays.get(size) or self._capture(size)
        if replay is None:
            return None
        return replay()[: step.num_tokens][step.sample_rows]

    def _load(self, step: StepInputs, size: int) -> None:
        n, metadata = step.num_tokens, step.metadata
        self.input_ids[:, :n].copy_(step.input_ids)
        self.position_ids[:, :n].copy_(step.position_ids)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:size].zero_()
        # Columns past a sequence's own blocks keep older entries: the kernels read a table only below seq_lens.
        self.block_tables[:n, : metadata.block_tables.shape[1]].copy_(metadata.block_tables)

    def _capture(self, size: int) -> Replay | None:
        try:
            self.replays[size] = self.capture(lambda: self.forward(self._static_step(size)))
        except Exception as err:  # noqa: BLE001 - any failure to capture leaves the eager forward, which still works
            self.disabled = f"{type(err).__name__}: {err}"
            logger.warning("hf_paged: CUDA graphs are off, decode steps run eagerly: capturing a %d-sequence step "
                           "failed with %s", size, self.disabled)
            return None
        return self.replays[size]

    def _static_step(self, size: int) -> StepInputs:
        metadata = PagedMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[: size + 1], max_query_len=1,
            num_decodes=size, kv=self.kv,
        )
        return StepInputs(self.input_ids[:, :size], self.position_ids[:, :size], metadata, self.sample_rows[:size])
