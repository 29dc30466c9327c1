"""One rank of a tensor-parallel check, run under torchrun by test_tensor_parallel.py (and in-process for reference).

    torchrun --nproc-per-node N tests/tp_worker.py OUT_DIR MODEL_DIR...

For each model: greedy `generate` on a left-padded batch, then the engine on a few prompts (greedy, and seeded
sampling); each rank writes what it got to ``OUT_DIR/rank{R}.json``.
"""

import json
import os
import sys

import torch

import hf_paged  # noqa: F401
from hf_paged import ContinuousBatchGenerator, SamplingParams
from hf_paged.loading import load_model

PROMPT_LENGTHS = (5, 23, 40)


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def run_model(path: str, tensor_parallel_size: int) -> dict:
    """What this rank computes for ``path`` (the engine's outputs on rank 0 only: the others only step)."""
    model, tokenizer = load_model(path, tensor_parallel_size=tensor_parallel_size)
    prompts = _prompts()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    result = {"generate": out[:, width:].tolist()}
    # A small step budget, so the 40-token prompt is prefilled in chunks beside the others' decodes. Odd ranks ask
    # for fewer blocks (as GPUs with less free memory would): every rank gets the fewest.
    blocks = 48 if int(os.environ.get("RANK", 0)) % 2 else 64
    generator = ContinuousBatchGenerator(model, tokenizer, num_blocks=blocks, max_num_batched_tokens=24)
    result["kv_heads"], result["num_blocks"] = generator.kv_storage.spec.num_kv_heads, generator.kv_storage.num_blocks
    if not generator.is_driver:
        generator.run_worker()
        result["digest"] = generator.lockstep.digest
        return result
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, n=2)
    result["engine"] = [o.outputs[0].token_ids for o in generator.run(prompts, greedy, use_tqdm=False)]
    result["sampled"] = [[c.token_ids for c in o.outputs] for o in generator.run(prompts, sampled, use_tqdm=False)]
    beams = SamplingParams(n=3, use_beam_search=True, max_tokens=8, ignore_eos=True)
    result["beams"] = [[c.token_ids for c in o.outputs] for o in generator.run(prompts, beams, use_tqdm=False)]
    generator.stop_workers()
    if generator.lockstep is not None:
        result["digest"] = generator.lockstep.digest
    return result


def engine_failing_beside_rank_0(path: str, tensor_parallel_size: int):
    """A `LocalRanks` load whose ranks other than 0 fail (as a rank whose GPU is out of memory would)."""
    from hf_paged.local_ranks import _load_engine

    if os.environ["RANK"] != "0":
        raise MemoryError("no room for this shard")
    return _load_engine(path, "auto", "cpu", False, None, {"num_blocks": 64}, "auto", tensor_parallel_size)


def _fail_in_a_new_process():
    raise RuntimeError("this process cannot start (as one that imports a script without its __main__ guard)")


class LoadThatCannotReachARank:
    """A `LocalRanks` load that rank 0 pickles but a rank's new process fails to unpickle, so that it exits before
    it runs anything of ours."""

    def __reduce__(self):
        return _fail_in_a_new_process, ()


def main() -> None:
    out_dir, paths = sys.argv[1], sys.argv[2:]
    world = int(os.environ["WORLD_SIZE"])
    results = {os.path.basename(path): run_model(path, world) for path in paths}
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
