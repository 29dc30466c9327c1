"""``hf-paged``: serve a model over an OpenAI-compatible HTTP API, or generate from the command line.

    hf-paged serve [MODEL] [--port 8000] [--api-key-file FILE] [--max-num-waiting N] ...
    hf-paged serve-ray [MODEL] [--num-replicas 2] [--address ray://...] ...   (needs the ``ray`` extra)
    hf-paged generate [MODEL] "prompt" [--max-tokens 128] ...

MODEL is a local model directory or a .gguf file; omitted, it is the embedded SmolLM2-135M-Instruct. Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING

from .generation.config import EngineConfig, parse_memory  # noqa: F401  (parse_memory: part of the CLI's API)
from .generation.sampling_params import InvalidParameter
from .loading import DTYPES, LOAD_FORMATS
from .quantization import QUANTIZATIONS, check_quantization

if TYPE_CHECKING:
    from .generation import ContinuousBatchGenerator

_DTYPES = list(DTYPES)


def _engine_options() -> argparse.ArgumentParser:
    """Options shared by every command: which model, and the engine's options (one per `EngineConfig` field)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("model", nargs="?", default=None,
                        help="local model directory, .gguf file (converted once into the cache) or hub id in the local "
                             "Hugging Face cache (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--config", metavar="FILE",
                        help="a YAML file of options, as vLLM's: long option names to values (max-model-len: 4k, "
                             "port: 8000, model: PATH); the command line's own options win")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the model runs: auto is the GPU when there is one (CUDA), else the CPU "
                             "(default: auto; each rank's own GPU under tensor parallelism)")
    engine.add_argument("--dtype", choices=_DTYPES, default="auto",
                        help="weights dtype (default: auto, the checkpoint's own)")
    engine.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="a tokenizer directory or cached hub id other than the model's (as vLLM's)")
    engine.add_argument("--revision", default=None,
                        help="for a hub id: the branch, tag or commit of its snapshot in the local cache (default: "
                             "main; as vLLM's, never downloaded)")
    engine.add_argument("--download-dir", default=None, metavar="DIR",
                        help="for a hub id: the Hugging Face cache directory it is in (default: the usual one; as "
                             "vLLM's, nothing is downloaded into it)")
    engine.add_argument("--trust-remote-code", action="store_true",
                        help="run the Python code a model directory ships for its classes (its config's auto_map), "
                             "as Transformers' trust_remote_code: only for models whose code you trust")
    engine.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                        help="CPU threads for the model's computation, as llama.cpp's -t (default: $OMP_NUM_THREADS, "
                             "else every core)")
    engine.add_argument("--chat-template", metavar="TEMPLATE",
                        help="a Jinja chat template, or a file holding one, instead of the tokenizer's (as vLLM's)")
    EngineConfig.add_cli_arguments(engine)
    return parser


def _chat_template(parser: argparse.ArgumentParser, given: str) -> str:
    """``--chat-template``: a file's text when it names a file, else the template itself (a Jinja string)."""
    path = os.path.expanduser(given)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as file:
                return file.read()
        except (OSError, UnicodeDecodeError) as err:
            parser.error(f"cannot read --chat-template {given}: {err}")
    if "{" not in given:
        parser.error(f"--chat-template {given!r} is neither a file nor a Jinja template")
    # Typed on one line, "\n" stands for a newline (vLLM decodes the escapes); text that is not ASCII stays as given.
    return codecs.decode(given, "unicode_escape") if given.isascii() else given


def _parallel_options() -> argparse.ArgumentParser:
    """Tensor parallelism, for the commands that run one engine (serve, generate)."""
    parser = argparse.ArgumentParser(add_help=False)
    parallel = parser.add_argument_group("tensor parallelism")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                          help="split the model across N ranks (Transformers' tensor-parallel plan; gloo on CPU, "
                               "NCCL on GPU): started here as N local processes, or the ranks of the torchrun this "
                               "runs under (default: 1, or torchrun's WORLD_SIZE)")
    parallel.add_argument("--cpu-bind", default=None, metavar="0|1|LISTS",
                          help="on CPU, bind each local rank to its cores: 1 splits the allowed cores in equal runs, "
                               "'0-3|4-7' names one list per local rank (default: 0, unbound; or $HF_PAGED_CPU_BIND)")
    parallel.add_argument("--distributed-timeout", type=float, default=60.0,
                          help="seconds a rank waits for the others in a collective before the whole group stops "
                               "with an error (default: 60)")
    return parser


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def _http_options() -> argparse.ArgumentParser:
    """Options of the commands that serve over HTTP."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, action="append", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: $HF_PAGED_API_KEY, else "
                          "vLLM's $VLLM_API_KEY, else no key); several keys: repeat the option (a comma is part of a "
                          "key); a key given here is visible to other users in `ps`, prefer the file or variable")
    key.add_argument("--api-key-file", default=None,
                     help="read the API key from this file (several: one per line, as llama.cpp reads it)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) served under their own model names, as vLLM's: "
                             "name=path, or '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (needs "
                             "--enable-lora; --max-lora-rank above 16 for adapters of a higher rank)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name clients send and /v1/models lists, or several (as vLLM's: any of them "
                             "may be sent; the first names the metrics) (default: MODEL as given, or the default "
                             "model's name)")
    parser.add_argument("--allowed-origins", default="*", metavar="ORIGINS",
                        help="origins browsers may call the server from (CORS), comma-separated or a JSON list as "
                             "vLLM's (default: *, any origin, as vLLM; '' sends no CORS headers)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="server log level (default: info)")
    _answer_options(parser.add_argument_group("answers and request logs (vLLM's flags)"))
    _add_vllm_flags(parser.add_argument_group("vLLM's flags, for its command lines: what they ask is always so here"))
    return parser


def _answer_options(answers: argparse._ArgumentGroup) -> None:
    """`ServingOptions`' flags."""
    answers.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                         help="auto: sampling settings a request leaves out are those the model's generation config "
                              "recommends (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); "
                              "vllm: OpenAI's defaults; a folder: those of its generation_config.json (default: auto, "
                              "as vLLM)")
    answers.add_argument("--override-generation-config", default=None, metavar="JSON",
                         help="a JSON object of those settings over the defaults, e.g. '{\"temperature\": 0.6}' (with "
                              "--generation-config vllm: over OpenAI's)")
    answers.add_argument("--response-role", default="assistant",
                         help="the role of chat replies (default: assistant; a reply that continues the last message, "
                              "add_generation_prompt false, has that message's role)")
    answers.add_argument("--return-tokens-as-token-ids", action="store_true",
                         help="logprobs name each token 'token_id:<id>' instead of its text (a request's "
                              "return_tokens_as_token_ids decides for itself)")
    answers.add_argument("--chat-template-content-format", default="auto", choices=("auto", "string", "openai"),
                         help="a message's content as the chat template gets it: one string, or OpenAI's list of "
                              "text parts (default: auto, the list for a template that loops over the content)")
    answers.add_argument("--metrics-prefix", default="hf_paged", choices=("hf_paged", "vllm"),
                         help="/metrics names vLLM's metrics '<prefix>:<name>'; vllm: as vLLM does, for its "
                              "dashboards and for gateways that read them (default: hf_paged)")
    answers.add_argument("--pooler-config", default=None, metavar="JSON",
                         help="how /v1/embeddings pools, as vLLM's: '{\"pooling_type\": \"MEAN\", \"normalize\": "
                              "false}' (LAST, MEAN or CLS; default: the model directory's sentence-transformers files, "
                              "else LAST, normalized)")
    answers.add_argument("--enable-log-requests", action="store_true",
                         help="log each request's prompt, prompt token ids and sampling parameters when it is queued")
    answers.add_argument("--max-log-len", type=int, default=None, metavar="N",
                         help="with --enable-log-requests: at most N characters of a prompt and N of its token ids "
                              "(default: all)")


def serving_options(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The `ServingOptions` the flags ask for; a bad value exits with code 2."""
    from .pooling import PoolingConfig
    from .server.options import ServingOptions

    override = _json_object(parser, "--override-generation-config", args.override_generation_config)
    pooler = _json_object(parser, "--pooler-config", args.pooler_config)
    try:
        pooling = None if args.pooler_config is None else PoolingConfig.from_vllm(pooler)
    except ValueError as err:
        parser.error(f"--pooler-config: {err}")
    try:
        return ServingOptions(args.generation_config, override, args.response_role, args.return_tokens_as_token_ids,
                              args.enable_log_requests and not args.disable_log_requests, args.max_log_len,
                              args.chat_template_content_format,
                              args.metrics_prefix, pooling)
    except (ValueError, TypeError) as err:
        message = str(err).removeprefix("SamplingParams.")
        field = message.split(" ", 1)[0]
        flag = field if field in ("response_role", "max_log_len", "generation_config") else \
            "override_generation_config"
        parser.error(f"--{flag.replace('_', '-')}: {message}")


def _json_object(parser: argparse.ArgumentParser, flag: str, given: str | None) -> dict:
    """A flag's JSON object (empty when not given); anything else exits with code 2."""
    if given is None:
        return {}
    try:
        value = json.loads(given)
    except ValueError as err:
        parser.error(f"{flag}: not JSON: {err}")
    if not isinstance(value, dict):
        parser.error(f"{flag}: not a JSON object: {given[:60]}")
    return value


def _add_vllm_flags(vllm: argparse._ArgumentGroup) -> None:
    vllm.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="tool_choice auto is always served (calls read from hermes blocks, JSON calls as Llama 3 "
                           "and Mistral write them, or the tokenizer's response template)")
    vllm.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                      help="all are read: hermes <tool_call> blocks (JSON, or Qwen3-Coder's XML), answers of JSON "
                           "calls as Llama 3 and Mistral write them, or of a Python list of calls (Llama 3.2's and "
                           "4's); or the tokenizer's own response template")
    vllm.add_argument("--enable-prefix-caching", action="store_true", dest="vllm_prefix_caching",
                      help="prefix caching is on unless --no-prefix-caching")
    vllm.add_argument("--enable-request-id-headers", action="store_true",
                      help="every answer carries X-Request-Id (the client's, else a new one)")
    vllm.add_argument("--disable-log-requests", action="store_true",
                      help="requests' contents are not logged, even with --enable-log-requests (the access log names "
                           "their routes)")
    vllm.add_argument("--enable-chunked-prefill", action="store_true",
                      help="long prompts are always prefilled in chunks of --max-num-batched-tokens")
    vllm.add_argument("--disable-log-stats", action="store_true",
                      help="no statistics are logged periodically (/metrics has them)")
    vllm.add_argument("--disable-frontend-multiprocessing", action="store_true",
                      help="the server and its engine always run in one process")
    vllm.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                      help="preempted sequences are recomputed (their prefixes mostly from the prefix cache), never "
                           "swapped to CPU memory, as in vLLM's V1 engine")
    vllm.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="1",
                      help="1: pipeline parallelism is not served (tensor parallelism is, --tensor-parallel-size)")
    vllm.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="1",
                      help="1 per server: replicas are served by `hf-paged serve-ray --num-replicas N`")
    vllm.add_argument("--tokenizer-mode", choices=("auto", "hf"), default="auto",
                      help="the model's Transformers tokenizer is always the one used (vLLM's mistral mode is not)")
    vllm.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                      help="the checkpoint's own quantization is always used (GPTQ and AWQ through gptqmodel): this "
                           "only checks that the model is quantized so")
    vllm.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                      help="weights load as Transformers loads them: safetensors, else PyTorch files (or a GGUF "
                           "file given as the model); dummy: random weights built from the model's config, none read "
                           "(to measure speed and memory; the answers are nonsense)")
    vllm.add_argument("--runner", choices=("auto", "generate", "pooling"), default="auto",
                      help="generation and embeddings (/v1/embeddings) are both always served")
    vllm.add_argument("--task", choices=("auto", "generate", "embed"), default="auto",
                      help="generation and embeddings are both always served (vLLM's older name of --runner)")
    vllm.add_argument("--convert", choices=("auto", "none", "embed"), default="auto",
                      help="a causal LM always serves embeddings too (pooled as --pooler-config says)")
    vllm.add_argument("--max-seq-len-to-capture", type=int, default=None, metavar="N",
                      help="CUDA graphs (on a GPU) capture decode steps of every length up to --max-model-len")
    vllm.add_argument("--distributed-executor-backend", choices=("mp", "uni", "external_launcher", "ray"),
                      default=None,
                      help="mp: tensor-parallel ranks run as local processes (uni: one process, "
                           "--tensor-parallel-size 1; external_launcher: the ranks of the torchrun this runs under); "
                           "ray: not here (replicas on Ray: serve-ray)")


def _add_serve_ray(commands, parents: list[argparse.ArgumentParser]) -> None:
    serve_ray = commands.add_parser(
        "serve-ray", parents=parents, allow_abbrev=False, help="serve the model from N replicas on Ray Serve",
        description="Serve MODEL as `serve` does, from replicas on a Ray cluster (a local one by default): each "
                    "request goes to the replica whose prefix cache most likely holds its prompt. MODEL must be at "
                    "the same path on every node. /metrics shows every replica's metrics. The limits are each "
                    "replica's own (--max-concurrent-requests counts one replica's calls); the ingress checks the "
                    "API key and the body's size and read time too, before a replica sees the call.")
    ray = serve_ray.add_argument_group("replicas")
    ray.add_argument("--num-replicas", type=int, default=None,
                     help="replicas to run, or to start with when autoscaling (default: 1, or --min-replicas)")
    ray.add_argument("--min-replicas", type=int, default=None,
                     help="autoscale: fewest replicas (with --max-replicas)")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="autoscale: most replicas, scaling on requests in flight (with --min-replicas)")
    ray.add_argument("--target-ongoing-requests", type=int, default=32,
                     help="autoscale: requests in flight per replica to aim at (default: 32)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica reserves (default: 1)")
    ray.add_argument("--replica-gpus", type=float, default=None,
                     help="GPUs each replica reserves (default: 1 if this machine has a CUDA GPU, else 0)")
    ray.add_argument("--no-prefix-routing", action="store_true",
                     help="route every request to the less loaded of two random replicas, ignoring prefix caches")
    ray.add_argument("--address", default=None,
                     help="Ray cluster to deploy on, e.g. auto or ray://head:10001 (default: start a local Ray)")
    _limit_options(serve_ray)
    serve_ray.set_defaults(run=run_serve_ray, command_parser=serve_ray)


# ServerLimits fields as `hf-paged serve` options: field -> (option, type, help).
_LIMITS = {
    "max_body_bytes": ("--max-body-size", parse_memory,
                       "largest request body, e.g. 4MiB; a larger one gets a 413 before it is read (default: 4MiB)"),
    "max_client_batch_size": ("--max-client-batch-size", int, "most prompts in one /v1/completions call (default: 32)"),
    "max_embedding_inputs": ("--max-embedding-inputs", int,
                             "most inputs in one /v1/embeddings call (default: 2048, as OpenAI)"),
    "max_concurrent_requests": ("--max-concurrent-requests", int,
                                "most generation calls in progress; more get a 503 with Retry-After (default: 512)"),
    "max_num_waiting": ("--max-num-waiting", int,
                        "most sequences queued beyond the --max-num-seqs that one step runs; a call that would "
                        "queue more gets a 503 with Retry-After (default: 1024)"),
    "max_n": ("--max-n", int, "most samples (n) per prompt (default: half of --max-num-seqs, at most 128)"),
    "max_stop_sequences": ("--max-stop-sequences", int, "most stop strings per call (default: 32; OpenAI allows 4)"),
    "max_stop_length": ("--max-stop-length", int, "most characters in one stop string or bad word (default: 256)"),
    "max_stop_token_ids": ("--max-stop-token-ids", int, "most stop_token_ids per call (default: 64)"),
    "max_logit_bias": ("--max-logit-bias", int, "most logit_bias entries per call (default: 300, as OpenAI)"),
    "max_bad_words": ("--max-bad-words", int, "most bad_words per call, each of at most --max-stop-length "
                                              "characters (default: 64)"),
    "max_allowed_token_ids": ("--max-allowed-token-ids", int, "most allowed_token_ids per call (default: 65536)"),
    "max_logprobs": ("--max-logprobs", int, "most logprobs / top_logprobs per token; -1: the whole vocabulary's, "
                                            "which requests ask for with -1, as vLLM's (default: 20)"),
    "max_logprob_entries": ("--max-logprob-entries", int,
                            "most log-probabilities one call may return, n x (logprobs + 1) x new tokens over its "
                            "prompts; a call that sets no max_tokens stops there rather than being refused "
                            "(default: 1048576)"),
    "max_chars_per_token": ("--max-chars-per-token", int,
                            "a prompt longer than max_model_len x this many characters is refused before it is "
                            "tokenized (default: 32)"),
    "max_constraint_size": ("--max-constraint-size", int,
                            "most characters in a structured-output constraint (a JSON schema as compact JSON, a "
                            "regex, a grammar; tools with tool_choice required) (default: 131072)"),
    "stream_write_timeout": ("--stream-write-timeout", int,
                             "seconds a client may read nothing while its outputs wait; then its requests are "
                             "aborted, their KV blocks freed and its connection closed (default: 60)"),
    "body_read_timeout": ("--body-read-timeout", int,
                          "seconds a request body may take to arrive; a slower one gets a 408 (default: 30)"),
    "tokenizer_workers": ("--tokenizer-workers", int,
                          "threads that tokenize prompts, each with its own tokenizer copy (default: 2)"),
}


def _limit_options(serve: argparse.ArgumentParser) -> None:
    limits = serve.add_argument_group("limits per call and per server")
    for field, (option, kind, help_text) in _LIMITS.items():
        metavar = "SIZE" if kind is parse_memory else "N"
        limits.add_argument(option, dest=field, type=kind, default=None, metavar=metavar, help=help_text)


def server_limits(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The `ServerLimits` the options ask for (defaults for the ones not given); a bad value exits with code 2."""
    from .server import ServerLimits

    given = {field: getattr(args, field) for field in _LIMITS if getattr(args, field) is not None}
    try:
        return ServerLimits(**given)
    except InvalidParameter as err:
        parser.error(f"{_LIMITS[err.param][0]}: {err}")


def api_key(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | tuple[str, ...] | None:
    """The key, or the keys, the server accepts: those of --api-key (repeated), else the lines of --api-key-file,
    else $HF_PAGED_API_KEY, else $VLLM_API_KEY (a vLLM deployment's, which would otherwise run without a key), else
    None (no key)."""
    if args.api_key is not None:
        keys = [key.strip() for key in args.api_key if key.strip()]
        if len(keys) != len(args.api_key):
            parser.error("--api-key: an empty key")
    elif args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as file:
                keys = [line.strip() for line in file if line.strip()]
        except OSError as err:
            parser.error(f"--api-key-file: cannot read {args.api_key_file}: {err.strerror}")
        except UnicodeDecodeError:
            parser.error(f"--api-key-file: {args.api_key_file} is not UTF-8 text")
        if not keys:
            parser.error(f"--api-key-file: {args.api_key_file} is empty")
    else:
        return os.environ.get("HF_PAGED_API_KEY") or os.environ.get("VLLM_API_KEY") or None
    return keys[0] if len(keys) == 1 else tuple(keys)


def allowed_origins(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """--allowed-origins: comma-separated, or vLLM's JSON list (``'["https://a.example"]'``)."""
    given = args.allowed_origins.strip()
    if not given.startswith("["):
        return [origin.strip() for origin in given.split(",") if origin.strip()]
    try:
        origins = json.loads(given)
    except ValueError as err:
        parser.error(f"--allowed-origins: not a JSON list of origins: {err}")
    if not all(isinstance(origin, str) for origin in origins):
        parser.error("--allowed-origins: a JSON list of origins holds strings")
    return origins


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-paged`` argument parser with its ``serve``, ``serve-ray``, ``generate``, ``chat`` and ``run-batch``
    commands."""
    parser = argparse.ArgumentParser(
        prog="hf-paged", allow_abbrev=False,
        description="Serve a model over an OpenAI-compatible HTTP API, or generate from the command line.",
    )
    from . import __version__

    parser.add_argument("--version", "-v", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,serve-ray,generate,chat,run-batch}")
    # No abbreviated options: llama.cpp's -t (its threads) would be taken for -tp (tensor parallelism).
    engine, http, parallel = _engine_options(), _http_options(), _parallel_options()

    serve = commands.add_parser("serve", parents=[engine, http, parallel], allow_abbrev=False,
                                help="serve the model over an OpenAI-compatible API",
                                description="Serve MODEL at /v1/completions, /v1/chat/completions, /v1/models, "
                                            "/health and /metrics.")
    serve.add_argument("--shutdown-timeout", type=float, default=5.0,
                       help="seconds that Ctrl+C / SIGTERM waits for requests in flight; those still running then "
                            "end with a 503 error (default: 5)")
    _uvicorn_options(serve)
    _limit_options(serve)
    _add_serve_ray(commands, [engine, http])

    generate = commands.add_parser("generate", parents=[engine, parallel], allow_abbrev=False,
                                   help="generate from one prompt, streamed to stdout",
                                   description="Generate a continuation of PROMPT and stream it to stdout.")
    generate.add_argument("prompt", help="the prompt (a user message when the chat template is applied)")
    generate.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    generate.add_argument("--temperature", type=float, default=1.0,
                          help="sampling temperature, 0 = greedy (default: 1, as OpenAI's)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1, off)")
    generate.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                          help="apply the chat template (default: when the tokenizer has one)")
    serve.set_defaults(run=run_serve, check=_serve_settings, command_parser=serve)
    generate.set_defaults(run=run_generate, check=_generate_params, command_parser=generate)
    _add_chat(commands, [engine])
    _add_run_batch(commands, [engine, http, parallel])
    return parser


def _add_chat(commands, parents: list[argparse.ArgumentParser]) -> None:
    chat = commands.add_parser("chat", parents=parents, allow_abbrev=False, help="chat with the model on the terminal",
                               description="Chat with MODEL: each line read is a turn, each reply streamed as it is "
                                           "generated. /clear forgets the conversation, /exit (or Ctrl+D) ends it, "
                                           "Ctrl+C stops a reply.")
    chat.add_argument("--system", help="the conversation's system message")
    chat.add_argument("--max-tokens", type=int, help="most tokens of a reply (default: the rest of the context)")
    chat.add_argument("--temperature", type=float,
                      help="sampling temperature, 0 = greedy (default: the model's generation config's, else 1)")
    chat.add_argument("--top-p", type=float, help="nucleus sampling threshold (default: the model's, else 1)")
    chat.set_defaults(run=run_chat, command_parser=chat)  # one process (no ranks left waiting for the user)


def run_chat(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``hf-paged chat``: a conversation on the terminal (`terminal.converse`)."""
    from .terminal import chat_params, converse

    given = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    _sampling_params(parser, **{name: value for name, value in given.items() if value is not None})  # before loading
    generator = load_generator(parser, args)
    if generator.tokenizer.chat_template is None:
        parser.error(f"{args.model or 'the model'} has no chat template (--chat-template gives one; hf-paged "
                     "generate continues plain text)")
    return converse(generator, chat_params(generator, **given), args.system)


def _add_run_batch(commands, parents: list[argparse.ArgumentParser]) -> None:
    batch = commands.add_parser(
        "run-batch", parents=parents, allow_abbrev=False, help="answer a file of requests in OpenAI's batch format",
        description="Answer each request of a batch file (JSON lines of OpenAI's batch format: custom_id, method, "
                    "url, body), as the server would, every one in flight at once up to --max-concurrent-requests "
                    "(vLLM's run-batch). The answers keep the input's order. The HTTP options are the server's; "
                    "--host, --port and the API key play no part.")
    batch.add_argument("-i", "--input-file", required=True, metavar="FILE",
                       help="the requests, one JSON object a line (-: standard input; an http(s) URL: read with GET)")
    batch.add_argument("-o", "--output-file", required=True, metavar="FILE",
                       help="where the answers go, one JSON object a line (-: standard output; an http(s) URL: sent "
                            "with PUT)")
    _limit_options(batch)
    batch.set_defaults(run=run_batch_file, check=_batch_settings, command_parser=batch)


def _batch_settings(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """``run-batch``'s options that need no model: the limits and answer options (a bad value exits with code 2)."""
    _check_vllm_flags(parser, args)
    if args.input_file != "-" and not _is_url(args.input_file) and not os.path.isfile(args.input_file):
        parser.error(f"--input-file: no such file: {args.input_file}")
    folder = os.path.dirname(os.path.abspath(args.output_file))
    if args.output_file != "-" and not _is_url(args.output_file) and (
            os.path.isdir(args.output_file) or not os.access(folder, os.W_OK) or (
            os.path.exists(args.output_file) and not os.access(args.output_file, os.W_OK))):
        parser.error(f"--output-file: cannot write {args.output_file}")
    return server_limits(parser, args), serving_options(parser, args)


def run_batch_file(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``hf-paged run-batch``: the answers to a batch file's requests, in the input's order."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from .batch import output_line, run_batch
        from .server import create_app
    except ImportError as err:
        parser.error(f"run-batch needs the server extra: pip install 'hf-paged[server]' ({err})")
    from . import distributed
    from .default_model import DEFAULT_MODEL_NAME

    limits, options = _batch_settings(parser, args)
    loras = _lora_modules(parser, args)
    # Read by rank 0 alone: tensor-parallel ranks share its stdin, and whichever read a pipe first took its lines.
    lines = _batch_lines(parser, args.input_file) if distributed.rank() == 0 else []
    generator = load_generator(parser, args)
    if not generator.is_driver:  # a tensor-parallel rank other than 0: rank 0 runs the batch
        generator.run_worker()
        return 0
    try:
        try:
            app = create_app(generator, args.served_model_name or [args.model or DEFAULT_MODEL_NAME], limits=limits,
                             options=options, lora_modules=loras)
        except ValueError as err:  # an adapter that does not fit the model
            parser.error(f"--lora-modules: {err}")
        try:
            records = asyncio.run(run_batch(app, lines, limits.max_concurrent_requests))
        except KeyboardInterrupt:  # as vLLM's, the answers are written once all are in
            print("hf-paged run-batch: interrupted: no answers written", file=sys.stderr)
            raise
    finally:
        generator.stop_workers()
    if not _write_answers(args.output_file, "".join(map(output_line, records))):
        return 1
    answered = sum(record["response"] is not None and record["response"]["status_code"] == 200 for record in records)
    print(f"hf-paged run-batch: {len(records)} requests, {answered} answered, {len(records) - answered} refused or "
          f"failed", file=sys.stderr)
    if not app.state.engine.healthy:
        print("hf-paged run-batch: error: the engine stopped after an unrecoverable error", file=sys.stderr)
        return 1
    return 0


def _batch_lines(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The batch file's lines, split at ``\n`` only (JSON strings may hold U+2028 and the like), a BOM dropped."""
    try:
        if path == "-":
            text = sys.stdin.buffer.read().decode("utf-8-sig")
        elif _is_url(path):
            with urllib.request.urlopen(path, timeout=BATCH_URL_TIMEOUT_S) as answer:
                text = answer.read().decode("utf-8-sig")
        else:
            with open(path, encoding="utf-8-sig") as given:
                text = given.read()
    except (UnicodeDecodeError, OSError, ValueError) as err:  # urllib's errors are OSErrors
        parser.error(f"--input-file: cannot read {path}: {err}")
    return [line.removesuffix("\r") for line in text.split("\n")]


BATCH_URL_TIMEOUT_S = 60.0


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def _write_answers(path: str, text: str) -> bool:
    """Write the answers to standard output, a file, or (PUT, as vLLM's run-batch) an http(s) URL; False when the URL
    did not take them: the reason is printed, and the answers kept in a file it names."""
    if path == "-":
        sys.stdout.write(text)
    elif not _is_url(path):
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        upload = urllib.request.Request(path, data=text.encode(), method="PUT",
                                        headers={"Content-Type": "application/jsonl"})
        try:
            urllib.request.urlopen(upload, timeout=BATCH_URL_TIMEOUT_S).close()
        except (OSError, ValueError) as err:
            kept, kept_path = tempfile.mkstemp(prefix="hf-paged-run-batch-", suffix=".jsonl")
            with os.fdopen(kept, "w", encoding="utf-8") as out:
                out.write(text)
            print(f"hf-paged run-batch: error: --output-file: cannot send the answers to {path} ({err}); they are "
                  f"in {kept_path}", file=sys.stderr)
            return False
    return True


def load_generator(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   before_loading: Callable[[], None] | None = None) -> ContinuousBatchGenerator:
    """A `ContinuousBatchGenerator` over the model the options name; a bad model exits with code 2 (no traceback).
    ``before_loading`` runs once the options are checked, before the model loads."""
    import torch

    from . import ContinuousBatchGenerator
    from .default_model import resolve_model
    from .loading import load_model, resolve_device

    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as err:
        parser.error(str(err))
    _check_draft(parser, config)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    template = None if args.chat_template is None else _chat_template(parser, args.chat_template)
    if before_loading is not None:  # before the model is resolved too: a GGUF file's first conversion takes a while
        before_loading()
    try:
        path = resolve_model(args.model, args.revision, args.download_dir)
    except Exception as err:  # e.g. the default model's conversion failing
        parser.error(str(err))
    _check_quantization(parser, path, getattr(args, "quantization", None))
    try:
        model, tokenizer = load_model(path, dtype=args.dtype, device=resolve_device(args.device),
                                      tensor_parallel_size=getattr(args, "tensor_parallel_size", None) or 1,
                                      trust_remote_code=args.trust_remote_code, tokenizer=args.tokenizer,
                                      load_format=getattr(args, "load_format", "auto"))
    except Exception as err:  # any reason a model cannot be loaded is the user's to read, not a traceback
        hint = "" if args.trust_remote_code or "trust_remote_code" not in str(err) else " (--trust-remote-code runs it)"
        parser.error(f"cannot load {path}: {err}{hint}")
    if template is not None:
        tokenizer.chat_template = template
    if args.threads is not None:  # after loading, which sets a tensor-parallel rank's share of the cores
        torch.set_num_threads(args.threads)  # the native kernels read it at every call too
    try:
        return ContinuousBatchGenerator(model, tokenizer, config)
    except Exception as err:
        parser.error(f"cannot serve {path}: {str(err) or type(err).__name__}")


def _check_draft(parser: argparse.ArgumentParser, config: EngineConfig) -> None:
    """A draft model directory that cannot be read is refused by name before the target model loads."""
    from transformers import AutoConfig

    from .default_model import resolve_model

    spec = config.speculative_config
    if spec is None or not isinstance(spec.model, str):
        return
    try:
        AutoConfig.from_pretrained(resolve_model(spec.model))
    except Exception as err:  # noqa: BLE001 - why the draft cannot be read is the user's to read
        parser.error(f"speculative_config.model: cannot load {spec.model}: {err}")


def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``hf-paged serve``: run the HTTP server until interrupted."""
    try:
        import uvicorn

        from .server import create_app
        from .server.app import GracefulServer
    except ImportError as err:
        parser.error(f"serve needs the server extra: pip install 'hf-paged[server]' ({err})")
    from .default_model import DEFAULT_MODEL_NAME

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    key, limits, options = _serve_settings(parser, args)
    sockets = []

    def hold_port() -> None:  # rank 0 (the only one under torchrun that serves HTTP), before the model loads
        if os.environ.get("RANK", "0") == "0":
            sockets.append(_listening_socket(parser, args.host, args.port))

    loras = _lora_modules(parser, args)
    generator = load_generator(parser, args, hold_port)
    if not generator.is_driver:  # a tensor-parallel rank other than 0: rank 0 serves HTTP
        generator.run_worker()
        return 0
    name = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    try:
        app = create_app(generator, name, api_key=key, limits=limits, allowed_origins=allowed_origins(parser, args),
                         options=options, lora_modules=loras)
    except ValueError as err:  # an adapter that does not fit the model
        parser.error(f"--lora-modules: {err}")
    scheme = "https" if args.ssl_certfile else "http"
    port = sockets[0].getsockname()[1] if sockets else args.port  # the one the system chose for --port 0
    logging.getLogger("hf_paged").info("serving %s on %s://%s:%d%s/v1 (max_model_len %d, %d KV blocks)",
                                       ", ".join(map(repr, name)), scheme, args.host, port, args.root_path,
                                       generator.max_model_len, generator.stats().num_blocks)
    return serve_until_stopped(GracefulServer(uvicorn.Config(app, **_uvicorn_settings(args))), app, sockets)


def _lora_modules(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` as ``(name, path, base model name)``; a bad entry exits with code 2."""
    from .lora import read_adapter_config
    from .server.models import parse_lora_module

    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    try:
        modules = [parse_lora_module(text) for text in args.lora_modules]
        for name, path, _ in modules:  # the files' fit to the model is checked once it loads
            read_adapter_config(path, f"LoRA adapter {name!r} ({path})")
    except ValueError as err:
        parser.error(f"--lora-modules: {err}")
    return modules


def _uvicorn_options(serve: argparse.ArgumentParser) -> None:
    """vLLM's options of its HTTP server (uvicorn's)."""
    http = serve.add_argument_group("HTTP server (as vLLM's)")
    http.add_argument("--root-path", default="", help="the path prefix a proxy serves the app under (default: none)")
    http.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    http.add_argument("--ssl-certfile", default=None, help="and this certificate (PEM)")
    http.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")
    http.add_argument("--uvicorn-log-level", default=None, choices=("critical", "error", "warning", "info", "debug"),
                      help="uvicorn's own log level (default: --log-level)")


def _check_uvicorn_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("--ssl-keyfile and --ssl-certfile go together")
    for option, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            parser.error(f"{option}: {path} is not a file")


def _uvicorn_settings(args: argparse.Namespace) -> dict:
    """``uvicorn.Config``'s arguments from serve's options."""
    return dict(host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout, root_path=args.root_path,
                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                access_log=not args.disable_uvicorn_access_log)


def _listening_socket(parser: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, which the server takes over once the model has loaded: a port in use is
    named at once, not after minutes of loading. It listens from the start (connections wait in its backlog), since a
    bound socket that does not listen yet lets another process bind the port too (SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError as err:
        sock.close()
        parser.error(f"cannot listen on {host}:{port}: {err.strerror or err}")
    return sock


# vLLM's names of the tool-call formats read here (all of them are, always: `hf_paged.server.tool_calls`).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "llama4_pythonic", "qwen3_coder", "qwen3_xml")


def _check_quantization(parser: argparse.ArgumentParser, path: str, asked: str | None) -> None:
    """vLLM's ``--quantization``: the checkpoint must be quantized with that method (its weights load as they are)."""
    try:
        check_quantization(path, asked)
    except ValueError as err:
        parser.error(f"--{err}")


def _check_vllm_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.vllm_prefix_caching and not args.enable_prefix_caching:
        parser.error("--enable-prefix-caching and --no-prefix-caching contradict each other")
    if args.pipeline_parallel_size != 1:
        parser.error(f"--pipeline-parallel-size {args.pipeline_parallel_size}: pipeline parallelism is not served; "
                     "split a model over processes with --tensor-parallel-size")
    if args.data_parallel_size != 1:
        parser.error(f"--data-parallel-size {args.data_parallel_size}: one server runs one engine; serve replicas "
                     "with `hf-paged serve-ray --num-replicas N`")
    _check_executor(parser, args.distributed_executor_backend, getattr(args, "tensor_parallel_size", None) or 1)


def _check_executor(parser: argparse.ArgumentParser, backend: str | None, size: int) -> None:
    """vLLM's --distributed-executor-backend, against how the ranks actually run here."""
    torchrun = "WORLD_SIZE" in os.environ
    if backend == "ray":
        parser.error("--distributed-executor-backend ray: tensor-parallel ranks run as local processes (mp) or "
                     "under torchrun (external_launcher); replicas on Ray are served by `hf-paged serve-ray`")
    if backend == "uni" and size > 1:
        parser.error(f"--distributed-executor-backend uni runs one process: --tensor-parallel-size {size} needs mp")
    if backend == "external_launcher" and not torchrun:
        parser.error("--distributed-executor-backend external_launcher: run this under torchrun (its ranks are the "
                     "tensor-parallel ranks)")


def _serve_settings(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """``serve``'s options that need no model: the API key and the limits (a bad value exits with code 2)."""
    if not args.shutdown_timeout >= 0:
        parser.error(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    _check_vllm_flags(parser, args)
    _check_uvicorn_options(parser, args)
    allowed_origins(parser, args)  # its refusal, before the model loads
    return api_key(parser, args), server_limits(parser, args), serving_options(parser, args)


def serve_until_stopped(server, app, sockets: list[socket.socket] | None = None) -> int:
    """Run a uvicorn ``server`` of ``app`` (on ``sockets`` if given, else on its config's host and port); 1 if it
    stopped because the engine died (so a supervisor restarts it)."""
    engine = app.state.engine

    def stop() -> None:
        logging.getLogger("hf_paged").critical("the engine stopped after an unrecoverable error; shutting down")
        server.should_exit = True

    engine.on_fatal.append(stop)
    try:
        with _stop_signals_raise():
            server.run(sockets=sockets or None)
    except (KeyboardInterrupt, _Terminated):  # uvicorn re-raises the signal it shut down for
        pass
    finally:
        engine.generator.stop_workers()  # the other tensor-parallel ranks, if any
    if engine.fatal is not None:
        return 1
    return 0 if server.started else 3  # 3: uvicorn's code for a server that could not start


class _Terminated(Exception):
    """SIGINT or SIGTERM, once uvicorn has shut down for it."""


@contextlib.contextmanager
def _stop_signals_raise():
    """SIGINT and SIGTERM raise `_Terminated` while the block runs (in the main thread), rather than ending the
    process where uvicorn re-raises them (the other tensor-parallel ranks are still to be stopped), or interrupting
    asyncio's runner, which then cancelled the app's lifespan mid-shutdown (a logged traceback)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise _Terminated

    previous = {sig: signal.signal(sig, terminated) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _starts_a_ray_cluster(address: str | None) -> bool:
    """Whether serve-ray starts a Ray cluster of its own: no ``--address``, ``$RAY_ADDRESS`` or local cluster (one
    ``ray start`` began) to join, whose Serve may be listening on the port already."""
    if address is not None or os.environ.get("RAY_ADDRESS"):
        return False
    try:
        from ray._private.utils import read_ray_address

        return read_ray_address() is None
    except Exception:  # noqa: BLE001 - another Ray: the port is not checked here (Serve names it, later)
        return False


def run_serve_ray(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``hf-paged serve-ray``: deploy on Ray Serve and serve until interrupted."""
    try:
        from .serve_ray import ReplicaSpec, ServeRayConfig, serve_forever
    except ImportError as err:
        parser.error(f"serve-ray needs Ray Serve: pip install 'hf-paged[ray]' ({err})")
    import torch
    from transformers import AutoConfig

    from .default_model import DEFAULT_MODEL_NAME, resolve_model

    for option, value in (("--chat-template", args.chat_template), ("--tokenizer", args.tokenizer)):
        if value is not None:
            parser.error(f"{option} is not supported by serve-ray yet (serve takes it)")
    if args.threads is not None:
        parser.error("--threads is not taken by serve-ray: each replica uses its --replica-cpus")
    if args.load_format == "dummy":
        parser.error("--load-format dummy is not taken by serve-ray (serve takes it)")
    _check_vllm_flags(parser, args)
    if _starts_a_ray_cluster(args.address):  # whose HTTP proxy will listen there
        _listening_socket(parser, args.host, args.port).close()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gpus = args.replica_gpus if args.replica_gpus is not None else float(torch.cuda.is_available())
    try:
        path = resolve_model(args.model, args.revision, args.download_dir)
        # A directory that holds no model is refused here, not on every replica.
        AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        _check_quantization(parser, path, args.quantization)
        spec = ReplicaSpec(path, tuple(args.served_model_name or [args.model or DEFAULT_MODEL_NAME]),
                           args.dtype, api_key(parser, args), EngineConfig.from_cli_args(args),
                           serving_options(parser, args), args.device, server_limits(parser, args),
                           tuple(allowed_origins(parser, args)), args.trust_remote_code,
                           tuple(_lora_modules(parser, args)), args.log_level)
        config = ServeRayConfig(spec, args.num_replicas, args.min_replicas, args.max_replicas,
                                args.target_ongoing_requests, replica_cpus=args.replica_cpus, replica_gpus=gpus,
                                prefix_affinity=not args.no_prefix_routing)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    serve_forever(config, args.address, args.host, args.port)
    return 0


def run_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``hf-paged generate``: stream one completion to stdout."""
    from .terminal import interrupts_deferred

    params = _generate_params(parser, args)
    generator = load_generator(parser, args)
    if not generator.is_driver:
        generator.run_worker()
        return 0
    try:
        if not generator.is_tensor_parallel:
            return _stream_one(generator, args, params)
        with interrupts_deferred() as interrupted:  # never inside a step: the other ranks are in its collectives
            return _stream_one(generator, args, params, interrupted)
    except BrokenPipeError:  # the reader went away (`hf-paged generate ... | head`): nothing is left to write
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 0
    except KeyboardInterrupt:  # Ctrl+C: what was written stays, without a traceback
        sys.stdout.write("\n")
        return 130 if not generator.is_tensor_parallel else 0  # a rank's 130 reads as a failure: the launcher says 130
    finally:
        generator.stop_workers()


def _generate_params(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """``generate``'s prompt and sampling options (a bad value exits with code 2)."""
    from . import RequestOutputKind

    if args.model is None and os.path.isdir(args.prompt):  # `generate MODEL` alone: argparse read it as the prompt
        parser.error(f"a prompt is required: {args.prompt} is a model directory (hf-paged generate MODEL PROMPT)")

    return _sampling_params(parser, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, output_kind=RequestOutputKind.DELTA)


def _sampling_params(parser: argparse.ArgumentParser, **given):
    """`SamplingParams` of the sampling flags' values; a bad one exits with code 2, naming its flag."""
    from . import SamplingParams
    from .generation import InvalidParameter

    try:
        return SamplingParams(**given)
    except InvalidParameter as err:
        parser.error(f"--{err.param.replace('_', '-')}: {str(err).removeprefix('SamplingParams.')}")


def _stream_one(generator: ContinuousBatchGenerator, args: argparse.Namespace, params,
                interrupted: threading.Event | None = None) -> int:
    chat = args.chat if args.chat is not None else generator.tokenizer.chat_template is not None
    prompt = [{"role": "user", "content": args.prompt}] if chat else args.prompt
    with contextlib.closing(generator.stream(prompt, params)) as outputs:  # closed early: the request is aborted
        for output in outputs:
            if output.error is not None:
                print(f"hf-paged: error: {output.error}", file=sys.stderr)
                return 1
            sys.stdout.write("".join(o.text for o in output.outputs))
            sys.stdout.flush()
            if interrupted is not None and interrupted.is_set():
                raise KeyboardInterrupt
    sys.stdout.write("\n")
    return 0


def _setup_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int | None:
    """Resolve ``--tensor-parallel-size``; outside torchrun with N > 1, run this same command as N local ranks under
    torchrun and return its exit code (None: go on in this process)."""
    import os

    from . import distributed

    if not hasattr(args, "tensor_parallel_size"):  # serve-ray: one process per replica
        return None
    ranks = int(os.environ.get("WORLD_SIZE", 1))
    size = args.tensor_parallel_size if args.tensor_parallel_size is not None else ranks
    if size < 1:
        parser.error(f"--tensor-parallel-size must be >= 1, got {size}")
    if not args.distributed_timeout > 0:
        parser.error(f"--distributed-timeout must be > 0 seconds, got {args.distributed_timeout}")
    if args.cpu_bind is not None:
        os.environ[distributed.CPU_BIND_ENV] = args.cpu_bind
        if size == 1:  # one process: bound here (ranks bind themselves as they load)
            try:
                distributed.set_cpu_threads()
            except ValueError as err:
                parser.error(f"--cpu-bind: {err}")
    args.tensor_parallel_size = size
    if size > 1 and "WORLD_SIZE" not in os.environ:
        _check_before_launch(parser, args, size)
        interrupted_code = 130 if args.command == "generate" else None  # `serve` stopped by Ctrl+C ends with 0
        return distributed.launch(["-m", "hf_paged.cli", *argv], size, interrupted_code)
    if size != ranks:
        parser.error(f"--tensor-parallel-size {size} under a torchrun of {ranks} ranks: one rank per shard")
    if size > 1:
        distributed.init_process_group(args.distributed_timeout)
    return None


def _check_before_launch(parser: argparse.ArgumentParser, args: argparse.Namespace, size: int) -> None:
    """Refuse here, once, what every rank would refuse alike: the command's options, the engine's, and a model whose
    heads ``size`` ranks cannot split (a bad value exits with code 2)."""
    from transformers import AutoConfig

    from . import distributed
    from .default_model import resolve_model

    args.check(parser, args)
    try:
        path = resolve_model(args.model, args.revision, args.download_dir)
        config = EngineConfig.from_cli_args(args)
        distributed.check_engine_config(config)
        distributed.check_checkpoint(path)
        _check_draft(parser, config)
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        distributed.load_tensor_parallel_kwargs(config, size)  # its plan, its heads
        for local_rank in range(size):
            distributed.cpu_share(local_rank, size, distributed.cpu_bind_setting(args.cpu_bind))
    except Exception as err:  # noqa: BLE001 - whatever the ranks would fail on is the user's to read
        parser.error(str(err))
    if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path)):
        parser.error(f"cannot load {path}: it holds no weights (*.safetensors or *.bin)")


def with_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with its ``--config FILE`` replaced by the file's options, those the command line gives left out."""
    found = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    command = parser._subparsers._group_actions[0].choices.get(argv[0]) if argv else None
    if not found or command is None:
        return argv
    if len(found) > 1:
        parser.error("argument --config: given more than once (one file holds the options)")
    at = found[0]
    path = argv[at].partition("=")[2] if "=" in argv[at] else (argv[at + 1] if at + 1 < len(argv) else None)
    if path is None:
        parser.error("argument --config: expected a file")
    argv = argv[:at] + argv[at + (1 if "=" in argv[at] else 2):]
    try:
        import yaml

        with open(path, encoding="utf-8") as file:
            options = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as err:
        parser.error(f"--config {path}: {err}")
    if not isinstance(options, dict):
        parser.error(f"--config {path}: the file must hold a mapping of option names to values")
    actions = command._option_string_actions
    given = {action.dest for arg in argv if (action := _option_of(actions, arg)) is not None}
    added, model = [], options.pop("model", None)
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or action.dest in ("help", "config"):
            parser.error(f"--config {path}: {key!r} is no option of hf-paged {argv[0]}")
        if action.dest not in given and value is not None and value != []:
            added += _config_arguments(parser, f"--config {path}: {key}", flag, action, value)
    argv = argv + added  # last: an option of several values given first would take the model for one
    if model is not None and command.parse_args(argv[1:]).model is None:
        argv.insert(1, str(model))
    return argv


def _option_of(actions: dict, arg: str):
    """The option an argument of the command line sets (``--name``, ``--name=value``, ``-t4``), or None."""
    if not arg.startswith("-"):
        return None
    if arg.startswith("--"):
        return actions.get(arg.partition("=")[0])
    return next((actions[arg[:size]] for size in range(len(arg), 1, -1) if arg[:size] in actions), None)


def _config_arguments(parser: argparse.ArgumentParser, where: str, flag: str, action, value) -> list[str]:
    """A config file's option as command-line arguments: a flag's true or false, each value of an option given
    several times (``--api-key``), an object as JSON."""
    if action.nargs == 0:
        if not isinstance(value, bool):
            parser.error(f"{where} is true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    values = [json.dumps(v) if isinstance(v, dict) else str(v) for v in (value if isinstance(value, list) else [value])]
    if isinstance(action, argparse._AppendAction):
        return [item for text in values for item in (flag, text)]
    return [flag, *values]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hf-paged`` console script."""
    parser = build_parser()
    argv = with_config_file(parser, sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    from .distributed import DistributedError, destroy_process_group

    try:
        code = _setup_parallel(args.command_parser, args, argv)
        if code is not None:
            return code
        code = args.run(args.command_parser, args)
        if code == 0:  # every rank is done with the others (not after a failure: a rank may be stuck in a collective)
            destroy_process_group()
        return code
    except DistributedError as err:
        print(f"hf-paged: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl+C while the model loads, say: no traceback
        return 130


if __name__ == "__main__":
    sys.exit(main())
