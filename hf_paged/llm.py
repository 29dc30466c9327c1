"""`LLM`: vLLM's offline entry point (``LLM(model).generate(...)``, ``.chat(...)``) over the engine."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

from .chat_template import CONTENT_FORMATS, TEMPLATE_PARAMETERS, content_format, render_prompt, template_messages
from .generation import RequestOutput, SamplingParams
from .generation.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .generation.inputs import prompt_list
from .local_ranks import start_engine
from .lora import LoRARequest
from .pooling import (EmbeddingOutput, EmbeddingRequestOutput, PoolingConfig, ScoringOutput, ScoringRequestOutput,
                      check_dimensions, cosine_scores, embed, score_pairs)


def _beam_sequence(output: RequestOutput, beam, params: BeamSearchParams, decode) -> BeamSearchSequence:
    """One beam of a finished search as vLLM's `LLM.beam_search` reports it (no stop strings: only stop tokens end
    a beam early)."""
    token_ids, stop_reason = beam.token_ids, beam.stop_reason
    if beam.finish_reason == "stop" and token_ids:
        stop_reason = token_ids[-1]  # vLLM's beam_search names the token, EOS too (its generate: None for EOS)
        token_ids = token_ids if params.include_stop_str_in_output else token_ids[:-1]
    tokens = output.prompt_token_ids + token_ids
    return BeamSearchSequence(tokens=tokens, cum_logprob=beam.cumulative_logprob,
                              text=decode(tokens, skip_special_tokens=True), finish_reason=beam.finish_reason,
                              stop_reason=stop_reason, lora_request=output.lora_request)


class LLM:
    """Loads ``model`` (a local directory, a .gguf file, a hub id whose copy is in the local Hugging Face cache; None:
    the embedded default) with paged attention and serves it with a `ContinuousBatchGenerator` (``self.generator``).
    ``dtype`` is "auto" (the checkpoint's) or a dtype name, ``device`` "auto" (the GPU when there is one), "cpu" or
    "cuda"; ``trust_remote_code`` and ``tokenizer`` are `loading.load_model`'s; ``quantization`` (vLLM's: "gptq", "awq",
    ...) must name the checkpoint's own quantization, which loads whether it is given or not; ``revision`` and
    ``download_dir`` pick a hub id's copy in the local cache, and ``load_format="dummy"`` builds random weights from the
    config, as vLLM's; vLLM's ``runner``, ``task`` and ``convert`` are taken (an LLM both generates and embeds), and its
    ``pooler_config`` (``{"pooling_type": "MEAN", "normalize": False}``) decides `embed`'s pooling over the model
    directory's; other keyword arguments are `EngineConfig` fields (``max_num_seqs``, ``kv_cache_memory``,
    ``speculative_config``, ...). Nothing is downloaded.

    ``tensor_parallel_size=N`` shards the model over N ranks: this process is rank 0, and the others are local
    processes started here (`local_ranks.LocalRanks`; as with vLLM, a script doing this needs an
    ``if __name__ == "__main__":`` guard), ended by `shutdown` or when the LLM is collected."""

    def __init__(self, model: str | os.PathLike | None = None, dtype: str = "auto", device: str = "auto",
                 trust_remote_code: bool = False, tokenizer: str | os.PathLike | None = None,
                 tensor_parallel_size: int = 1, quantization: str | None = None, revision: str | None = None,
                 download_dir: str | os.PathLike | None = None, load_format: str = "auto", runner: str = "auto",
                 task: str = "auto", convert: str = "auto", pooler_config: dict | None = None, **engine_options):
        for name, value, allowed in (("runner", runner, ("auto", "generate", "pooling")),
                                     ("task", task, ("auto", "generate", "embed")),
                                     ("convert", convert, ("auto", "none", "embed"))):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        self._pooling = None if pooler_config is None else PoolingConfig.from_vllm(pooler_config)
        self.generator, ranks = start_engine(model, dtype, device, trust_remote_code, tokenizer, engine_options,
                                             tensor_parallel_size, quantization, revision, download_dir, load_format)
        self._ranks = None if ranks is None else weakref.finalize(self, ranks.stop)

    def shutdown(self) -> None:
        """End the other ranks of a tensor-parallel LLM (no call may follow); nothing to do on one process."""
        if self._ranks is not None:
            self._ranks()

    def get_tokenizer(self):
        return self.generator.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no parameters: the model's generation config's settings."""
        return self.generator.inputs.sampling_params(None)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """`ContinuousBatchGenerator.run`: strings, token ids, ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``;
        None takes the sampling settings of the model's generation config. ``lora_request`` (with
        ``LLM(..., enable_lora=True)``): the LoRA adapter of every prompt, or one (or None) per prompt; ``priority``
        (with ``LLM(..., scheduling_policy="priority")``): one per prompt, lower first. As in vLLM, a prompt or
        parameters the engine refuses raise ``ValueError`` before anything runs; a request that fails while running
        comes back with ``error`` set."""
        return self.generator.run(prompts, sampling_params, use_tqdm, lora_request, priority, strict=True)

    def beam_search(self, prompts, params: BeamSearchParams,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt's ``params.beam_width`` best beams, best first (the search runs in
        the engine, see `SamplingParams.use_beam_search`). As in vLLM, a beam's ``tokens`` and ``text`` hold its
        prompt too (the text with special tokens skipped), and a beam that ended at a stop token has it as its
        ``stop_reason`` and in ``tokens`` only with ``params.include_stop_str_in_output``."""
        outputs = self.generator.run(prompts, params.sampling_params(), use_tqdm, lora_request, strict=True)
        decode = self.get_tokenizer().decode
        results = []
        for output in outputs:
            if output.error is not None:
                raise ValueError(f"beam search of request {output.request_id} failed: {output.error}")
            results.append(BeamSearchOutput([_beam_sequence(output, beam, params, decode) for beam in output.outputs]))
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool | Callable = True,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to each of a list of them, rendered by the
        tokenizer's chat template with vLLM's options, in vLLM's order: ``lora_request`` as `generate`'s,
        ``chat_template`` (a Jinja template) replaces the tokenizer's, a message's content (a string or OpenAI's text
        parts) goes to the template as a string or as parts (``chat_template_content_format``: ``"auto"`` picks
        parts for a template that loops over them), ``continue_final_message`` (with ``add_generation_prompt=False``)
        continues the last message, ``tools`` (OpenAI's) go into the prompt, and ``chat_template_kwargs`` are the
        template's own variables. Tool calls are not parsed (the server does)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format is one of {', '.join(CONTENT_FORMATS)}, got "
                             f"{chat_template_content_format!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message instead of opening a new one: set "
                             "add_generation_prompt=False with it")
        reserved = sorted(set(chat_template_kwargs or ()) & TEMPLATE_PARAMETERS)
        if reserved:
            raise ValueError(f"chat_template_kwargs are the template's variables; {', '.join(reserved)} cannot be set "
                             "through them")
        options = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message}
        if chat_template is not None:
            options["chat_template"] = chat_template
        tokenizer = self.get_tokenizer()
        fmt = content_format(chat_template_content_format, chat_template or tokenizer.chat_template)
        texts = [render_prompt(tokenizer, template_messages(conversation, fmt), tools, options, fmt == "openai")
                 for conversation in conversations]
        prompts = [{"prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids, "prompt": text}
                   for text in texts]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def embed(self, prompts, /, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params=None, lora_request=None, dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: each prompt's (a string, token ids, or a ``{"prompt": ...}`` dict; or a list of
        them) pooled last hidden state (`hf_paged.pooling`: as the model's sentence-transformers files say, else its
        last token's, normalized), cut to its first ``dimensions`` if given (vLLM's ``PoolingParams.dimensions``).
        ``use_tqdm`` is taken and shows nothing; ``pooling_params`` and ``lora_request`` must be None."""
        _check_pooling_options(pooling_params, lora_request)
        if self.generator.is_tensor_parallel:  # the forward would run on this rank alone and break the group
            raise ValueError("embeddings are not served under tensor parallelism (tensor_parallel_size > 1)")
        prompts = prompt_list(prompts)
        inputs, model = self.generator.inputs, self.generator.model
        check_dimensions(model, dimensions)
        token_ids = [inputs.tokenize(prompt, truncate_prompt_tokens, pooling=True)[1] for prompt in prompts]
        for ids in token_ids:
            if not ids:
                raise ValueError("a prompt to embed is empty")
            inputs.check_prompt_length(len(ids), pooling=True)
        pooling = self._pooling or PoolingConfig.of_model(getattr(model, "name_or_path", None))
        vectors = embed(model, token_ids, pooling, dimensions)
        return [EmbeddingRequestOutput(str(i), ids, EmbeddingOutput(vector))
                for i, (ids, vector) in enumerate(zip(token_ids, vectors))]

    def score(self, data_1, data_2, /, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params=None, lora_request=None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` with an embedding model: the cosine similarity of the embeddings (`embed`) of each
        pair, ``data_1`` (one prompt, or a list) against each of ``data_2``, or the two lists pair by pair."""
        _check_pooling_options(pooling_params, lora_request)
        data_1, data_2 = prompt_list(data_1), prompt_list(data_2)
        pairs = score_pairs(len(data_1), len(data_2), ("data_1", "data_2"))
        first = self.embed(data_1, truncate_prompt_tokens=truncate_prompt_tokens)
        second = self.embed(data_2, truncate_prompt_tokens=truncate_prompt_tokens)
        scores = cosine_scores([o.outputs.embedding for o in first], [o.outputs.embedding for o in second], pairs)
        return [ScoringRequestOutput(str(k), first[i].prompt_token_ids + second[j].prompt_token_ids,
                                     ScoringOutput(score)) for k, ((i, j), score) in enumerate(zip(pairs, scores))]

    def reset_prefix_cache(self) -> bool:
        return self.generator.reset_prefix_cache()


def _check_pooling_options(pooling_params, lora_request) -> None:
    if pooling_params is not None:
        raise ValueError("pooling_params are not taken here: the pooling is the model's (embed's dimensions= cuts "
                         "an embedding)")
    if lora_request is not None:
        raise ValueError("embeddings are of the served model: LoRA adapters do not apply to them")



