"""Tiny random-weight causal LMs of several architectures, built from configs (nothing downloaded)."""

import torch
from transformers import AutoModelForCausalLM

COMMON = dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, initializer_range=0.2)


def _configs():
    from transformers import (
        FalconConfig, Gemma2Config, Gemma3nTextConfig, GemmaConfig, GPT2Config, GptOssConfig, GPTNeoXConfig,
        LlamaConfig, MistralConfig, Phi3Config, PhimoeConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
    )

    llama_like = dict(hidden_size=64, intermediate_size=128, **COMMON)
    return {
        # name: (config, reference attention implementation)
        "llama": (LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **llama_like), "sdpa"),
        "qwen2": (Qwen2Config(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=128,
                              **COMMON), "sdpa"),
        "qwen3": (Qwen3Config(num_attention_heads=4, num_key_value_heads=1, head_dim=32, **llama_like), "sdpa"),
        "mistral": (MistralConfig(num_attention_heads=8, num_key_value_heads=2, sliding_window=8, **llama_like), "sdpa"),
        "phi3": (Phi3Config(num_attention_heads=4, num_key_value_heads=4, **llama_like), "sdpa"),
        "gpt2": (GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=256, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0, initializer_range=0.2), "sdpa"),
        "gemma": (GemmaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=16, **llama_like), "sdpa"),
        "gemma2": (Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                attn_logit_softcapping=5.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                                **llama_like), "eager"),
        # Sliding windows that only the mask carries (the attention is not passed sliding_window=); in Qwen2-MoE
        # the first layer slides and the second does not.
        "qwen2_moe": (Qwen2MoeConfig(num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1,
                                     use_sliding_window=True, sliding_window=6, max_window_layers=1, **llama_like),
                      "sdpa"),
        "phimoe": (PhimoeConfig(num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                num_experts_per_tok=1, sliding_window=6, **llama_like), "sdpa"),
        # Its last two layers attend with the keys and values of the two before them (KV sharing).
        "gemma3n": (Gemma3nTextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                      num_kv_shared_layers=2, vocab_size_per_layer_input=256,
                                      hidden_size_per_layer_input=8, laurel_rank=8,
                                      activation_sparsity_pattern=[0.0] * 4,
                                      layer_types=["sliding_attention", "full_attention"] * 2,
                                      **{**llama_like, "num_hidden_layers": 4}), "sdpa"),
        # Attention sinks (a logit per head in every softmax's denominator), sliding and full layers, experts.
        "gpt_oss": (GptOssConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"], **llama_like), "eager"),
        # These two give `cache.update` no attention kwargs (the cache reaches attention on the keys).
        "gpt_neox": (GPTNeoXConfig(num_attention_heads=4, **llama_like), "sdpa"),
        "falcon": (FalconConfig(num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                hidden_size=64, **COMMON), "sdpa"),
    }


ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2", "gemma", "gemma2", "qwen2_moe", "phimoe",
                 "gemma3n", "gpt_oss", "gpt_neox", "falcon"]


def tiny_model(name: str, attn_implementation: str = "paged"):
    """Returns ``(model, reference_attn_implementation)``, weights seeded so every call builds the same model."""
    config, reference = _configs()[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval(), reference
