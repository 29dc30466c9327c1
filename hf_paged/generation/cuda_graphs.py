"""`DecodeGraphs`: decode steps replayed from CUDA graphs, one graph per batch-size bucket, as vLLM does.

A step of ``n`` sequences with ``q`` new tokens each runs the graph of ``q`` and the smallest bucket that holds
``n``: ``q`` is 1 in a decode step, and ``k + 1`` in a step that verifies ``k`` speculative guesses per sequence.
Its inputs are copied into buffers the graph reads from; the sequences past ``n`` are padding, which writes no key or
value (slot ``-1``) and attends to nothing (length 0). A graph is captured the first time it is needed.
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
Shape = tuple[int, int]  # a graph's sequences, and new tokens per sequence


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's buckets: 1, 2, 4, the multiples of 8 below ``max_num_seqs``, and ``max_num_seqs`` itself (at most 256)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return tuple(sorted({s for s in (1, 2, 4, *range(8, top, 8)) if s < top} | {top}))


def decode_graphs(runner: ModelRunner, config: EngineConfig, max_model_len: int,
                  max_query_len: int = 1) -> DecodeGraphs | None:
    """The CUDA graphs of ``runner``'s steps of at most ``max_query_len`` new tokens per sequence (``1 +
    num_speculative_tokens`` where the runner verifies guesses); None on CPU, with ``enforce_eager`` and under tensor
    parallelism (graphs do not hold its collectives here) and for LongRoPE models (their tables change per step)."""
    if config.enforce_eager or runner.device.type != "cuda" or is_tensor_parallel(runner.model):
        return None
    if runner.long_rope is not None:  # the hook that picks each token's tables is not captured
        return None
    return DecodeGraphs(runner.forward, runner.kv, capture_sizes(config.max_num_seqs),
                        math.ceil(max_model_len / runner.kv.block_size), max_query_len)


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
    """Runs steps of up to ``sizes[-1]`` tokens through captured graphs of ``forward``: steps in which every sequence
    has the same number of new tokens, at most ``max_query_len``.

    ``capture`` turns a step function into a replay (`CudaGraphCapture`; the tests pass one that runs on CPU and
    refuses host reads of tensor values). A capture that fails turns the graphs off, with a warning, and the step
    runs eagerly: a model whose forward reads tensors on the host, say, still runs.
    """

    def __init__(self, forward: Callable[[StepInputs], torch.Tensor], kv: PagedKVStorage, sizes: tuple[int, ...],
                 max_blocks_per_seq: int, max_query_len: int = 1,
                 capture: Callable[[Callable[[], torch.Tensor]], Replay] | None = None):
        self.forward = forward
        self.kv = kv
        self.sizes = sizes
        self.max_query_len = max_query_len
        self.capture = capture or CudaGraphCapture()
        self.replays: dict[Shape, Replay] = {}
        self.disabled: str | None = None
        rows, device = sizes[-1], kv.device
        self.input_ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.query_starts: dict[int, torch.Tensor] = {}  # q -> 0, q, 2q, ...: the packing of q tokens per sequence
        self.sample_rows = torch.arange(rows, dtype=torch.long, device=device)

    def bucket(self, step: StepInputs) -> Shape | None:
        """The graph that runs ``step``, or None if none can: its sequences' new tokens differ in number or are too
        many, or the step is larger than the largest graph."""
        metadata = step.metadata
        num_seqs, q = metadata.seq_lens.shape[0], metadata.max_query_len
        if (self.disabled or q > self.max_query_len or step.num_tokens != num_seqs * q
                or metadata.block_tables.shape[1] > self.block_tables.shape[1]):
            return None
        size = next((size for size in self.sizes if size >= num_seqs), None)
        return None if size is None or size * q > self.sizes[-1] else (size, q)

    def run(self, step: StepInputs) -> torch.Tensor | None:
        """The logits of ``step``'s sample rows, from a graph; None when the step must run eagerly."""
        shape = self.bucket(step)
        if shape is None:
            return None
        self._load(step, shape)
        replay = self.replays.get(shape) or self._capture(shape)
        if replay is None:
            return None
        return replay()[: step.num_tokens][step.sample_rows]

    def _load(self, step: StepInputs, shape: Shape) -> None:
        (size, q), metadata = shape, step.metadata
        n, num_seqs = step.num_tokens, metadata.seq_lens.shape[0]
        self.input_ids[:, :n].copy_(step.input_ids)
        self.position_ids[:, :n].copy_(step.position_ids)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n : size * q].fill_(-1)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens)
        self.seq_lens[num_seqs:size].zero_()
        # Columns past a sequence's own blocks keep older entries: the kernels read a table only below seq_lens.
        self.block_tables[:num_seqs, : metadata.block_tables.shape[1]].copy_(metadata.block_tables)

    def _capture(self, shape: Shape) -> Replay | None:
        try:
            self.replays[shape] = self.capture(lambda: self.forward(self._static_step(shape)))
        except Exception as err:  # noqa: BLE001 - any failure to capture leaves the eager forward, which still works
            self.disabled = f"{type(err).__name__}: {err}"
            logger.warning("hf_paged: CUDA graphs are off, steps run eagerly: capturing a step of %d sequences with "
                           "%d new tokens each failed with %s", *shape, self.disabled)
            return None
        return self.replays[shape]

    def _static_step(self, shape: Shape) -> StepInputs:
        size, q = shape
        if q not in self.query_starts:
            self.query_starts[q] = torch.arange(0, self.sizes[-1] + 1, q, dtype=torch.int32, device=self.kv.device)
        metadata = PagedMetadata(
            slot_mapping=self.slot_mapping[: size * q], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_starts[q][: size + 1], max_query_len=q,
            num_decodes=size if q == 1 else 0, kv=self.kv,
        )
        rows = size * q
        return StepInputs(self.input_ids[:, :rows], self.position_ids[:, :rows], metadata, self.sample_rows[:rows])
