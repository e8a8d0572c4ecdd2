"""The bundled small decoder-only transformer, in plain JAX.

Pure functions over a nested dict of float32 arrays: pre-RMSNorm blocks,
causal multi-head attention, GELU MLP, learned positions, untied output.
With ``pipeline_stages = S`` the layers are split into S nearly equal
groups by ``elastic.pipeline_stage`` marks (embedding in the first stage,
the output layer in the last).
Every weight matrix has its largest dimension on ``emb_dim``, ``mlp_dim`` or
``vocab_size``, so choosing those as multiples of the device count lets the
runtime shard them.

``SyntheticTokens`` is a host-side, learnable ``DataSource`` for tests, demos
and chaos runs: each sequence is an arithmetic progression modulo the vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from elastic.stages import pipeline_stage

__all__ = [
    "SyntheticTokens",
    "TransformerConfig",
    "forward",
    "init_params",
    "loss_fn",
    "make_model",
    "training_tflops",
]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Model shape. Hashable, so it can be a static argument of ``jax.jit``."""

    vocab_size: int
    max_target_length: int
    emb_dim: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    pipeline_stages: int = 1   # S: the forward pass carries S - 1 elastic.pipeline_stage marks between layers

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if int(getattr(self, f.name)) < 1:
                raise ValueError(f"TransformerConfig.{f.name} must be >= 1, got {getattr(self, f.name)}")
        if self.emb_dim % self.num_heads:
            raise ValueError(f"emb_dim ({self.emb_dim}) must be divisible by num_heads ({self.num_heads})")
        if self.pipeline_stages > self.num_layers:
            raise ValueError(f"dcn_pipeline_parallelism={self.pipeline_stages}: the bundled transformer needs at "
                             f"least one decoder layer per pipeline stage, and base_num_decoder_layers is "
                             f"{self.num_layers}")

    @classmethod
    def from_config(cls, cfg: Any) -> TransformerConfig:
        """Read MaxText-style keys from any object that has them as attributes."""
        return cls(
            vocab_size=int(cfg.vocab_size),
            max_target_length=int(cfg.max_target_length),
            emb_dim=int(cfg.base_emb_dim),
            num_layers=int(cfg.base_num_decoder_layers),
            num_heads=int(cfg.base_num_query_heads),
            mlp_dim=int(cfg.base_mlp_dim),
            pipeline_stages=int(getattr(cfg, "dcn_pipeline_parallelism", 1) or 1),
        )


def init_params(rng: jax.Array, tcfg: TransformerConfig) -> Params:
    """Fresh parameters; a pure function of ``rng`` and ``tcfg``."""
    e, f, v = tcfg.emb_dim, tcfg.mlp_dim, tcfg.vocab_size
    keys = iter(jax.random.split(rng, 3 + 4 * tcfg.num_layers))

    def normal(shape, std):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    params: Params = {
        "embed": normal((v, e), 0.02),
        "pos": normal((tcfg.max_target_length, e), 0.02),
        "final_norm": jnp.ones((e,), jnp.float32),
        # Small output init: the loss starts near log(vocab_size).
        "unembed": normal((e, v), 0.02),
    }
    for i in range(tcfg.num_layers):
        params[f"layer_{i}"] = {
            "attn_norm": jnp.ones((e,), jnp.float32),
            "qkv": normal((e, 3 * e), 1 / math.sqrt(e)),
            "out": normal((e, e), 1 / math.sqrt(e)),
            "mlp_norm": jnp.ones((e,), jnp.float32),
            "mlp_in": normal((e, f), 1 / math.sqrt(e)),
            "mlp_out": normal((f, e), 1 / math.sqrt(f)),
        }
    return params


def training_tflops(tcfg: TransformerConfig, sequences: int) -> float:
    """TFLOPs of one training step over ``sequences`` sequences of ``max_target_length`` tokens (forward and
    backward, every device together), as MaxText estimates its own: 6 per weight of each matrix product per token
    (the embedding is a lookup: none), and the attention's two products over the whole ``T x T`` score matrix
    (this model computes it all, then masks), 3 x 4 x T x emb_dim per token and layer."""
    e, f, v, t, n = tcfg.emb_dim, tcfg.mlp_dim, tcfg.vocab_size, tcfg.max_target_length, tcfg.num_layers
    tokens = sequences * t
    weights = n * (3 * e * e + e * e + 2 * e * f) + e * v
    return (6 * weights + 12 * n * t * e) * tokens / 1e12


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _attention(p: Params, x: jax.Array, num_heads: int) -> jax.Array:
    b, t, e = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, num_heads, e // num_heads) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(e // num_heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, t, e) @ p["out"]


def forward(params: Params, inputs: jax.Array, tcfg: TransformerConfig) -> jax.Array:
    """Logits float32 [B, T, vocab] for int32 ``inputs`` [B, T], T <= max_target_length."""
    x = params["embed"][inputs] + params["pos"][: inputs.shape[1]]
    s, n = tcfg.pipeline_stages, tcfg.num_layers
    cuts = {-(-k * n // s) for k in range(1, s)}   # stage k starts at layer ceil(k * n / s)
    for i in range(tcfg.num_layers):
        if i in cuts:
            x = pipeline_stage(x)
        p = params[f"layer_{i}"]
        x = x + _attention(p, _rms_norm(x, p["attn_norm"]), tcfg.num_heads)
        x = x + jax.nn.gelu(_rms_norm(x, p["mlp_norm"]) @ p["mlp_in"]) @ p["mlp_out"]
    return _rms_norm(x, params["final_norm"]) @ params["unembed"]


def loss_fn(params: Params, batch: dict[str, jax.Array], tcfg: TransformerConfig) -> jax.Array:
    """Mean next-token cross-entropy over the microbatch (scalar float32)."""
    logp = jax.nn.log_softmax(forward(params, batch["inputs"], tcfg), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)
    return jnp.mean(nll)


class SyntheticTokens:
    """Deterministic, learnable token data (a ``elastic.data.DataSource``).

    Each row is ``(start + stride * t) mod vocab_size`` with a random start and
    a stride drawn from ``STRIDES`` (so the model must attend to the previous
    token to learn the stride); ``targets`` are ``inputs`` shifted by one.
    Generated host-side with numpy Philox seeded by ``(seed, step, microbatch)``,
    so every process gets the same bytes. ``stream`` > 0 draws another stream of
    the same data, ``(seed, step, microbatch, stream)`` (:meth:`held_out`: eval data).
    """

    STRIDES = (1, 2)

    def __init__(self, seed: int, vocab_size: int, seq_len: int, microbatch_size: int, stream: int = 0):
        if min(vocab_size, seq_len, microbatch_size) < 1 or seed < 0:
            raise ValueError(
                f"need seed >= 0 and positive sizes, got seed={seed} vocab_size={vocab_size} "
                f"seq_len={seq_len} microbatch_size={microbatch_size}"
            )
        self.seed, self.vocab_size = int(seed), int(vocab_size)
        self.seq_len, self.microbatch_size = int(seq_len), int(microbatch_size)
        self.stream = int(stream)

    def held_out(self) -> SyntheticTokens:
        """The same data's held-out stream (eval data): sequences the training stream never draws."""
        return SyntheticTokens(self.seed, self.vocab_size, self.seq_len, self.microbatch_size, stream=1)

    def element_spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        shape = (self.microbatch_size, self.seq_len)
        return {"inputs": (shape, np.dtype(np.int32)), "targets": (shape, np.dtype(np.int32))}

    def batch(self, step: int, microbatch: int) -> dict[str, np.ndarray]:
        if step < 0 or microbatch < 0:
            raise ValueError(f"step and microbatch must be >= 0, got step={step} microbatch={microbatch}")
        key = [self.seed, step, microbatch] + ([self.stream] if self.stream else [])   # stream 0: the training data
        rng = np.random.Generator(np.random.Philox(np.random.SeedSequence(key)))
        start = rng.integers(0, self.vocab_size, size=(self.microbatch_size, 1), dtype=np.int64)
        stride = rng.choice(np.asarray(self.STRIDES, np.int64), size=(self.microbatch_size, 1))
        seq = ((start + stride * np.arange(self.seq_len + 1)) % self.vocab_size).astype(np.int32)
        return {"inputs": seq[:, :-1].copy(), "targets": seq[:, 1:].copy()}

    def __repr__(self) -> str:
        return (
            f"SyntheticTokens(seed={self.seed}, vocab_size={self.vocab_size}, "
            f"seq_len={self.seq_len}, microbatch_size={self.microbatch_size}"
            + (f", stream={self.stream})" if self.stream else ")")
        )


def make_model(cfg: Any) -> tuple[Callable[[jax.Array], Params], Callable[..., jax.Array], SyntheticTokens]:
    """``(init_fn(rng), loss_fn(params, batch), data_source)`` for a Config-like object.

    Reads the ``TransformerConfig.from_config`` keys plus ``seed``,
    ``per_device_batch_size`` and ``ici_fsdp_parallelism``; one microbatch holds
    ``per_device_batch_size * ici_fsdp_parallelism`` sequences. The returned
    functions are ``functools.partial`` objects, so they pickle.
    """
    try:
        tcfg = TransformerConfig.from_config(cfg)
    except ValueError as e:   # keys that fit no model of this shape: one line naming them, as for any config
        from elastic.config import ConfigError

        raise ConfigError(str(e)) from None
    size = cfg.per_device_batch_size * cfg.ici_fsdp_parallelism
    if size < 1 or size != int(size):
        raise ValueError(
            f"per_device_batch_size * ici_fsdp_parallelism must be a positive integer, got "
            f"{cfg.per_device_batch_size} * {cfg.ici_fsdp_parallelism}"
        )
    data = SyntheticTokens(int(cfg.seed), tcfg.vocab_size, tcfg.max_target_length, int(size))
    return functools.partial(init_params, tcfg=tcfg), functools.partial(loss_fn, tcfg=tcfg), data
