"""Running Transformers' own attention as the reference on a paged model."""


def generate_with(model, attn_implementation: str, **kwargs):
    """``model.generate(**kwargs)`` with ``attn_implementation``, switching the model back to ``"paged"`` after."""
    model.set_attn_implementation(attn_implementation)
    try:
        return model.generate(**kwargs)
    finally:
        model.set_attn_implementation("paged")
