import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist's workers share the cores: oversubscribed OpenMP threads
    # made two workers slower than one process (and the ranks and servers that tests start inherit the setting)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run interpreted on CPU; must precede any triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hf_paged  # noqa: F401  (registers "paged")

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


@pytest.fixture(autouse=True, scope="module")
def _collect_after_each_module():
    """Engines, PEFT models and servers that a test file leaves in reference cycles are freed before the next file
    starts: their weights and KV caches are gigabytes, and each test process runs many files in 24 GiB."""
    yield
    import ctypes
    import gc

    gc.collect()
    try:  # and glibc hands the freed heap back, for the tensor-parallel ranks and Ray workers that tests start
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _collect_after_a_big_test():
    """Within a file too: a test that grew the process by more than 512 MiB (a few engines, each with its own packed
    weights) has what it left in reference cycles (FastAPI apps are cyclic) freed at once, not at some later
    collection, for the next tests to reuse (the suite peaked at 10.8 GB resident without it)."""
    if not os.path.exists("/proc/self/statm"):
        yield
        return
    before = _resident_bytes()
    yield
    if _resident_bytes() - before > 512 << 20:
        import gc

        gc.collect()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from hf_paged.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The real SmolLM2-135M-Instruct in fp32 with paged attention, and its tokenizer (left padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, attn_implementation="paged", dtype=torch.float32)
    return model.eval(), tokenizer


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three fruits.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code, and explain why it helps beginners more than anything else.",
    "Who wrote Romeo and Juliet?",
    "Name the largest planet in the solar system.",
    "Describe a cat in five words.",
    "Why is the sky blue?",
    "Suggest a name for a pet goldfish.",
    "What does a compiler do?",
    "How many days are in a leap year?",
    "Write one sentence about autumn leaves falling in a quiet park at dusk.",
    "What is the boiling point of water in Celsius?",
]


@pytest.fixture(scope="session")
def chat_prompts(smollm2) -> list[str]:
    _, tokenizer = smollm2
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in CHAT_PROMPTS
    ]
