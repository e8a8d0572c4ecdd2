"""Models bundled with jax-elastic (plain JAX, params as dict pytrees)."""

from elastic.models.transformer import (
    SyntheticTokens,
    TransformerConfig,
    forward,
    init_params,
    loss_fn,
    make_model,
    training_tflops,
)

__all__ = [
    "SyntheticTokens",
    "TransformerConfig",
    "forward",
    "init_params",
    "loss_fn",
    "make_model",
    "training_tflops",
]
