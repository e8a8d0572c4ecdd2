"""Decoding and per-token log-probabilities of an RL policy: the bundled transformer (``tcfg=``), or any
``apply(params, tokens int32[B, T]) -> logits [B, T, vocab]`` of one's own (``apply=``), causal as a decoder is.

The policy at temperature ``T`` is ``softmax(logits / T)`` of
:func:`elastic.models.transformer.forward`'s last-position logits. Both
:func:`sample` and :func:`token_logprobs` report ``log_softmax(logits / T)``
at the sampled token, so the ratio of new to old log-probabilities in the
loss compares the same distribution.

Rows and keys. A microbatch holds ``p`` prompts times ``G`` samples; row
``r = i * G + g`` is sample ``g`` of prompt ``i`` (prompts repeated per sample,
contiguous). Prompt ``i`` of microbatch ``m`` is prompt ``m * p + i`` of the
step. Row ``r``'s token ``t`` is drawn with
``fold_in(key_for(seed, step, m * p + i, g), t)``, so a row's bits depend on
its own (seed, step, prompt index, sample index) only, whichever worker and
whichever call computes it. Every function here is pure and jittable;
``seed``, ``step`` and ``microbatch`` may be traced int32 scalars.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from elastic.models.transformer import TransformerConfig, forward

__all__ = ["key_for", "sample", "token_logprobs"]


def key_for(seed, step, prompt, sample) -> jax.Array:
    """The key of one row: ``fold_in(fold_in(fold_in(key(seed), step), prompt), sample)``.

    ``prompt`` is the prompt's index within the step (``microbatch * p + i``),
    ``sample`` its sample index in ``[0, G)``; any may be traced int32 scalars.
    Token ``t`` of the row is drawn with ``fold_in(key_for(...), t)``.
    """
    key = jax.random.key(jnp.asarray(seed, jnp.uint32))
    for x in (step, prompt, sample):
        key = jax.random.fold_in(key, jnp.asarray(x, jnp.uint32))
    return key


def _check_length(tcfg: TransformerConfig, prompt_len: int, max_new: int) -> None:
    if prompt_len + max_new > tcfg.max_target_length:
        raise ValueError(f"prompt length {prompt_len} + completion length {max_new} exceeds max_target_length "
                         f"{tcfg.max_target_length}")


def _row_keys(seed, step, microbatch, p: int, samples: int) -> jax.Array:
    prompt_ids = jnp.asarray(microbatch, jnp.int32) * p + jnp.arange(p, dtype=jnp.int32)
    sample_ids = jnp.arange(samples, dtype=jnp.int32)
    keys = jax.vmap(lambda i: jax.vmap(lambda g: key_for(seed, step, i, g))(sample_ids))(prompt_ids)
    return keys.reshape(p * samples)   # row r = i * G + g


def _apply(tcfg: TransformerConfig | None, apply):
    """The policy's ``apply(params, tokens int32[B, T]) -> logits [B, T, vocab]``: ``apply`` when given (a policy of
    one's own), else the bundled transformer of ``tcfg``."""
    if apply is not None:
        return apply
    if tcfg is None:
        raise ValueError("give the policy as apply=(params, tokens) -> logits, or the bundled one's tcfg=")
    return lambda params, tokens: forward(params, tokens, tcfg)


def sample(params, prompts, *, tcfg: TransformerConfig | None = None, seed, step, microbatch, samples: int,
           max_new: int, temperature: float, apply=None) -> dict[str, jax.Array]:
    """Samples ``max_new`` tokens for each of the ``p * samples`` rows of ``prompts`` int32[p, Lp].

    Returns ``{"completions": int32[B, max_new], "logprobs": float32[B, max_new]}``
    (B = p * samples, rows as in the module docstring): each token drawn from
    ``softmax(logits / temperature)`` and its log-probability under that
    distribution. One full forward pass of the fixed-shape buffer
    ``[B, Lp + max_new]`` per new token (causal attention: the not yet written
    positions do not affect the logits read), in one ``lax.fori_loop``.
    """
    prompts = jnp.asarray(prompts, jnp.int32)
    p, lp = prompts.shape
    if tcfg is not None:
        _check_length(tcfg, lp, max_new)
    policy = _apply(tcfg, apply)
    b = p * samples
    keys = _row_keys(seed, step, microbatch, p, samples)
    buf = jnp.concatenate([jnp.repeat(prompts, samples, axis=0), jnp.zeros((b, max_new), jnp.int32)], axis=1)
    logprobs = jnp.zeros((b, max_new), jnp.float32)

    def body(t, carry):
        buf, logprobs = carry
        logits = policy(params, buf)
        last = jax.lax.dynamic_index_in_dim(logits, lp - 1 + t, axis=1, keepdims=False) / temperature
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(keys)
        tok = jax.vmap(jax.random.categorical)(step_keys, last).astype(jnp.int32)
        lp_tok = jnp.take_along_axis(jax.nn.log_softmax(last, axis=-1), tok[:, None], axis=-1)[:, 0]
        buf = jax.lax.dynamic_update_index_in_dim(buf, tok, lp + t, axis=1)
        logprobs = jax.lax.dynamic_update_index_in_dim(logprobs, lp_tok, t, axis=1)
        return buf, logprobs

    buf, logprobs = jax.lax.fori_loop(0, max_new, body, (buf, logprobs))
    return {"completions": buf[:, lp:], "logprobs": logprobs}


def token_logprobs(params, prompts, completions, *, tcfg: TransformerConfig | None = None, temperature: float,
                   apply=None) -> jax.Array:
    """float32[B, max_new]: teacher-forced ``log_softmax(logits / temperature)`` of each completion token.

    ``prompts`` int32[B, Lp] (one per row, already repeated per sample),
    ``completions`` int32[B, max_new]. Equals :func:`sample`'s ``logprobs``
    for the same params and temperature (up to float rounding).
    """
    prompts = jnp.asarray(prompts, jnp.int32)
    completions = jnp.asarray(completions, jnp.int32)
    lp, n = prompts.shape[1], completions.shape[1]
    if tcfg is not None:
        _check_length(tcfg, lp, n)
    logits = _apply(tcfg, apply)(params, jnp.concatenate([prompts, completions], axis=1))
    logp = jax.nn.log_softmax(logits[:, lp - 1:lp - 1 + n] / temperature, axis=-1)
    return jnp.take_along_axis(logp, completions[..., None], axis=-1)[..., 0]
