"""GRPO: group-normalised advantages, the sampler's rollout and the clipped policy-gradient loss.

All pure, jittable functions of their inputs. A rollout microbatch holds
``p`` prompts times ``G`` samples, rows ``r = i * G + g`` (see
:mod:`elastic.rl.policy`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from elastic.models.transformer import TransformerConfig
from elastic.rl.policy import key_for, sample, token_logprobs
from elastic.rl.task import RLTask

__all__ = ["ADVANTAGE_EPS", "advantages", "grpo_loss", "key_for", "rollout"]

ADVANTAGE_EPS = 1e-6


def advantages(rewards: jax.Array, samples: int) -> jax.Array:
    """float32[p*G]: ``(r - mean) / (std + ADVANTAGE_EPS)`` within each prompt's group of ``samples`` rows.

    ``std`` is the population standard deviation (ddof 0) of the group; a
    group whose rewards are all equal gets advantages 0.
    """
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, samples)
    mean = jnp.mean(r, axis=1, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(r - mean), axis=1, keepdims=True))
    return ((r - mean) / (std + ADVANTAGE_EPS)).reshape(-1)


def rollout(params, prompts, *, task: RLTask, tcfg: TransformerConfig | None = None, seed, step, microbatch,
            samples: int, max_new: int, temperature: float, apply=None) -> dict[str, jax.Array]:
    """The sampler's whole job for one microbatch: sample, reward, advantages (one jittable function).

    ``prompts`` int32[p, Lp] (``task.prompts(step, microbatch, p)``). Returns
    the trainer's batch for the microbatch, B = p * samples rows:
    ``{"prompts": int32[B, Lp] (each prompt repeated per sample), "completions": int32[B, max_new],
    "logprobs": float32[B, max_new] (the sampling policy's, "old"), "advantages": float32[B],
    "rewards": float32[B]}``.
    """
    prompts = jnp.asarray(prompts, jnp.int32)
    out = sample(params, prompts, tcfg=tcfg, apply=apply, seed=seed, step=step, microbatch=microbatch, samples=samples,
                 max_new=max_new, temperature=temperature)
    rows = jnp.repeat(prompts, samples, axis=0)
    rewards = task.reward(rows, out["completions"]).astype(jnp.float32)
    return {"prompts": rows, "completions": out["completions"], "logprobs": out["logprobs"],
            "advantages": advantages(rewards, samples), "rewards": rewards}


def grpo_loss(params, batch, *, tcfg: TransformerConfig | None = None, temperature: float, clip_eps: float = 0.2,
              kl_coef: float = 0.0, ref_params=None, apply=None) -> jax.Array:
    """Scalar float32: the clipped surrogate loss of one rollout microbatch (``batch`` as :func:`rollout`'s).

    Per token, ``ratio = exp(new - old)`` of the current policy's and the
    sampling policy's log-probabilities (``batch["logprobs"]``), and
    ``surrogate = min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A)``
    with the row's advantage ``A``; the loss is ``-mean(surrogate)`` over all
    ``B * max_new`` tokens. With ``kl_coef > 0`` it adds ``kl_coef * mean(k3)``,
    ``k3 = exp(ref - new) - (ref - new) - 1`` against the reference policy's
    log-probabilities: ``batch["ref_logprobs"]`` when the batch has them, else
    computed from ``ref_params`` (no gradient flows to them).
    """
    new = token_logprobs(params, batch["prompts"], batch["completions"], tcfg=tcfg, apply=apply,
                         temperature=temperature)
    old = jnp.asarray(batch["logprobs"], jnp.float32)
    adv = jnp.asarray(batch["advantages"], jnp.float32)[:, None]
    ratio = jnp.exp(new - old)
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    loss = -jnp.mean(surrogate)
    if kl_coef > 0:
        if "ref_logprobs" in batch:
            ref = jnp.asarray(batch["ref_logprobs"], jnp.float32)
        elif ref_params is not None:
            ref = jax.lax.stop_gradient(token_logprobs(ref_params, batch["prompts"], batch["completions"],
                                                       tcfg=tcfg, apply=apply, temperature=temperature))
        else:
            raise ValueError("grpo_loss: kl_coef > 0 needs batch['ref_logprobs'] or ref_params")
        log_ratio = ref - new
        loss = loss + kl_coef * jnp.mean(jnp.exp(log_ratio) - log_ratio - 1.0)
    return loss.astype(jnp.float32)
