"""The one-process ground truth of GRPO post-training, and its settings.

:func:`run_reference` defines the math a distributed RL run reproduces bit
for bit. Its semantics, for steps ``s = 0 .. steps - 1`` with ``M`` rollout
microbatches per step (``elastic_microbatches``, a power of two):

* **Versions.** Version ``v`` is the parameters after ``v`` optimizer steps;
  version 0 is ``init_params(jax.random.key(seed), tcfg)``. Step ``s`` trains
  version ``s`` into version ``s + 1``.
* **Who samples.** Step ``s``'s rollouts are sampled with version
  ``max(s - rl_off_policy_steps, 0)``: with ``rl_off_policy_steps = 0``,
  version ``s`` (strictly on-policy); with 1, version ``s - 1`` (version 0 for
  step 0), so a sampler can generate step ``s + 1``'s rollouts while the
  trainer applies step ``s``. The step's record says which: ``"version"``.
* **Rollouts.** Microbatch ``m`` (``0 .. M - 1``) of step ``s``:
  ``prompts = task.prompts(s, m, p)`` (host numpy), then
  ``batch = rollout(sampling_params, prompts, task=..., seed=seed, step=s, microbatch=m, ...)``
  with int32 ``seed``, ``s``, ``m``. With ``rl_kl_coef > 0``, the batch gains
  ``"ref_logprobs" = token_logprobs(version 0, batch["prompts"], batch["completions"])``
  (the reference policy is the initial one).
* **Gradient.** Per microbatch ``(loss_m, grad_m) = value_and_grad(grpo_loss)(version s, batch_m)``
  with ``clip_eps = rl_clip_epsilon``, ``kl_coef = rl_kl_coef``,
  ``temperature = rl_temperature``. The ``M`` gradients (and losses) are
  summed in float32 in the canonical pairwise tree over microbatch ids
  (``((g0 + g1) + (g2 + g3))`` for M = 4; the runtime's order), then divided
  by ``float32(M)``.
* **Update.** One ``optax.adam`` update with ``learning_rate`` (a linear
  warm-up from 0 over ``warmup_steps`` when > 0), as the bundled
  ``elastic.Trainer`` does.
* **Record.** ``{"step": s, "mean_reward": mean of the step's M * B rewards,
  "loss": the tree-summed loss / M, "version": the sampling version}``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from elastic.config import Config
from elastic.models.transformer import TransformerConfig, init_params
from elastic.rl.grpo import grpo_loss, rollout
from elastic.rl.policy import token_logprobs
from elastic.rl.task import RLTask

__all__ = ["RLSettings", "run_reference", "tree_sum_f32"]


#: Each key's default: the config schema's.
_DEFAULT = {f.name: f.default for f in dataclasses.fields(Config)}


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class RLSettings:
    """The config keys an RL run reads, typed, with defaults and checks (fields are the keys' names).

    :meth:`from_config` reads them from a Config, any object with them as
    attributes, or a mapping; a key it lacks takes its default, the config
    schema's (:class:`elastic.config.Config`: one owner). Every bad value
    raises a one-line ``ValueError`` naming its key.
    """

    rl_prompts_per_microbatch: int = _DEFAULT["rl_prompts_per_microbatch"]  # p: prompts per rollout microbatch
    rl_samples_per_prompt: int = _DEFAULT["rl_samples_per_prompt"]  # G: completions per prompt (>= 2: a group)
    rl_max_new_tokens: int = _DEFAULT["rl_max_new_tokens"]  # completion length
    rl_prompt_length: int = _DEFAULT["rl_prompt_length"]  # prompt length
    rl_temperature: float = _DEFAULT["rl_temperature"]  # the policy is softmax(logits / T)
    rl_clip_epsilon: float = _DEFAULT["rl_clip_epsilon"]  # PPO clip range of the ratio
    rl_kl_coef: float = _DEFAULT["rl_kl_coef"]  # k3 KL penalty against the initial policy; 0: none
    rl_off_policy_steps: int = _DEFAULT["rl_off_policy_steps"]  # step s sampled by version max(s - this, 0)
    seed: int = _DEFAULT["seed"]
    steps: int = _DEFAULT["steps"]
    learning_rate: float = _DEFAULT["learning_rate"]
    warmup_steps: int = _DEFAULT["warmup_steps"]
    elastic_microbatches: int = _DEFAULT["elastic_microbatches"]  # M; 0: next power of two >= the slices
    dcn_data_parallelism: int = _DEFAULT["dcn_data_parallelism"]
    vocab_size: int = _DEFAULT["vocab_size"]
    max_target_length: int = _DEFAULT["max_target_length"]
    base_emb_dim: int = _DEFAULT["base_emb_dim"]
    base_num_decoder_layers: int = _DEFAULT["base_num_decoder_layers"]
    base_num_query_heads: int = _DEFAULT["base_num_query_heads"]
    base_mlp_dim: int = _DEFAULT["base_mlp_dim"]

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = int if f.type in ("int", int) else float
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    want is int and not float(value).is_integer()) or not math.isfinite(value):
                raise ValueError(f"{f.name} must be {'an integer' if want is int else 'a number'}, got {value!r}")
            object.__setattr__(self, f.name, want(value))
        positive = ("rl_prompts_per_microbatch", "rl_max_new_tokens", "rl_prompt_length", "steps",
                    "dcn_data_parallelism", "vocab_size", "max_target_length", "base_emb_dim",
                    "base_num_decoder_layers", "base_num_query_heads", "base_mlp_dim")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("seed", "warmup_steps", "rl_kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("rl_temperature", "learning_rate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.rl_samples_per_prompt < 2:
            raise ValueError(f"rl_samples_per_prompt must be >= 2 (a group advantage needs two samples), "
                             f"got {self.rl_samples_per_prompt}")
        if not 0 < self.rl_clip_epsilon <= 1:
            raise ValueError(f"rl_clip_epsilon must be in (0, 1], got {self.rl_clip_epsilon}")
        if self.rl_off_policy_steps not in (0, 1):
            raise ValueError(f"rl_off_policy_steps must be 0 or 1, got {self.rl_off_policy_steps}")
        if self.elastic_microbatches and not _is_power_of_two(self.elastic_microbatches):
            raise ValueError(f"elastic_microbatches must be a power of two (or 0: auto), "
                             f"got {self.elastic_microbatches}")
        if self.elastic_microbatches < 0:
            raise ValueError(f"elastic_microbatches must be >= 0, got {self.elastic_microbatches}")
        if self.rl_prompt_length + self.rl_max_new_tokens > self.max_target_length:
            raise ValueError(f"rl_prompt_length ({self.rl_prompt_length}) + rl_max_new_tokens "
                             f"({self.rl_max_new_tokens}) must be <= max_target_length ({self.max_target_length})")
        if self.base_emb_dim % self.base_num_query_heads:
            raise ValueError(f"base_emb_dim ({self.base_emb_dim}) must be divisible by base_num_query_heads "
                             f"({self.base_num_query_heads})")

    @classmethod
    def from_config(cls, cfg: Any) -> RLSettings:
        """The settings of ``cfg``: an ``elastic.Config``, an object with the keys as attributes, or a mapping."""
        if isinstance(cfg, RLSettings):
            return cfg
        get = cfg.get if isinstance(cfg, Mapping) else functools.partial(getattr, cfg)
        values = {}
        for f in dataclasses.fields(cls):
            value = get(f.name, None)
            if value is not None:
                values[f.name] = value
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | pathlib.Path) -> RLSettings:
        """Reads a config file and its ``base_config`` chain (a path relative to the file naming it, else a
        bundled config's name) without the schema check of ``elastic.load_config``: for configs with rl_*
        keys before the schema knows them. Other keys are ignored."""
        from elastic.config_loading import builtin_config_path, read_config_file

        def chain(p: pathlib.Path, seen: tuple = ()) -> dict[str, Any]:
            if p.resolve() in seen:
                raise ValueError(f"base_config cycle at {p}")
            layer = dict(read_config_file(p))
            base = layer.pop("base_config", None)
            if base is None:
                return layer
            nxt = p.parent / base
            return {**chain(nxt if nxt.is_file() else builtin_config_path(str(base)), (*seen, p.resolve())), **layer}

        p = pathlib.Path(path)
        return cls.from_config(chain(p if p.is_file() else builtin_config_path(str(path))))

    def replace(self, **changes) -> RLSettings:
        return dataclasses.replace(self, **changes)

    @property
    def microbatches(self) -> int:
        """M: ``elastic_microbatches``, 0 resolved to the next power of two >= ``dcn_data_parallelism``."""
        if self.elastic_microbatches:
            return self.elastic_microbatches
        return 1 << (self.dcn_data_parallelism - 1).bit_length()

    @property
    def rows_per_microbatch(self) -> int:
        """B = p * G."""
        return self.rl_prompts_per_microbatch * self.rl_samples_per_prompt

    @property
    def tcfg(self) -> TransformerConfig:
        return TransformerConfig(vocab_size=self.vocab_size, max_target_length=self.max_target_length,
                                 emb_dim=self.base_emb_dim, num_layers=self.base_num_decoder_layers,
                                 num_heads=self.base_num_query_heads, mlp_dim=self.base_mlp_dim)

    @property
    def task(self) -> RLTask:
        return RLTask(vocab_size=self.vocab_size, prompt_len=self.rl_prompt_length,
                      completion_len=self.rl_max_new_tokens, seed=self.seed)

    def rollout_fn(self, apply=None):
        """``rollout(params, prompts, seed, step, microbatch)`` with these settings bound (not jitted); ``apply``:
        a policy of one's own (None: the bundled transformer of these settings)."""
        policy = {"apply": apply} if apply is not None else {"tcfg": self.tcfg}
        return functools.partial(rollout, task=self.task, **policy, samples=self.rl_samples_per_prompt,
                                 max_new=self.rl_max_new_tokens, temperature=self.rl_temperature)

    def loss_fn(self, apply=None):
        """``loss(params, batch) -> scalar``: :func:`grpo_loss` with these settings bound (a partial, picklable)."""
        policy = {"apply": apply} if apply is not None else {"tcfg": self.tcfg}
        return functools.partial(grpo_loss, **policy, temperature=self.rl_temperature,
                                 clip_eps=self.rl_clip_epsilon, kl_coef=self.rl_kl_coef)

    def optimizer(self):
        import optax

        rate = (optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps) if self.warmup_steps
                else self.learning_rate)
        return optax.adam(rate)


def tree_sum_f32(values: list) -> Any:
    """Float32 pairwise tree sum of a power-of-two-long list of pytrees: ``((v0 + v1) + (v2 + v3))``."""
    n = len(values)
    if not _is_power_of_two(n):
        raise ValueError(f"need a power-of-two number of values, got {n}")
    while len(values) > 1:
        values = [jax.tree.map(lambda a, b: np.add(a, b, dtype=np.float32), values[i], values[i + 1])
                  for i in range(0, len(values), 2)]
    return values[0]


def run_reference(cfg_like: Any, steps: int | None = None, *, off_policy_steps: int | None = None) -> list[dict]:
    """Trains ``steps`` GRPO steps in this process (module docstring); returns one record per step:
    ``{"step", "mean_reward", "loss", "version"}``.

    ``cfg_like``: anything :meth:`RLSettings.from_config` takes. ``steps``
    defaults to its ``steps``, ``off_policy_steps`` to its ``rl_off_policy_steps``.
    """
    import optax

    s = RLSettings.from_config(cfg_like)
    if off_policy_steps is not None:
        s = s.replace(rl_off_policy_steps=off_policy_steps)
    steps = s.steps if steps is None else int(steps)
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    m_count, p, tcfg = s.microbatches, s.rl_prompts_per_microbatch, s.tcfg
    opt = s.optimizer()

    roll = jax.jit(s.rollout_fn())
    grad = jax.jit(jax.value_and_grad(s.loss_fn()))
    ref_logprobs = jax.jit(functools.partial(token_logprobs, tcfg=tcfg, temperature=s.rl_temperature))

    @jax.jit
    def apply(params, opt_state, grad_sum):
        mean = jax.tree.map(lambda g: g / np.float32(m_count), grad_sum)
        updates, opt_state = opt.update(mean, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = init_params(jax.random.key(s.seed), tcfg)
    initial = params
    opt_state = opt.init(params)
    previous = params   # version max(step - 1, 0)
    records = []
    for step in range(steps):
        version = max(step - s.rl_off_policy_steps, 0)
        sampler = previous if s.rl_off_policy_steps else params
        losses, grads, rewards = [], [], []
        for m in range(m_count):
            prompts = s.task.prompts(step, m, p)
            batch = roll(sampler, prompts, seed=np.int32(s.seed), step=np.int32(step), microbatch=np.int32(m))
            if s.rl_kl_coef > 0:
                batch = {**batch, "ref_logprobs": ref_logprobs(initial, batch["prompts"], batch["completions"])}
            loss, g = grad(params, batch)
            losses.append(np.asarray(loss, np.float32))
            grads.append(jax.tree.map(np.asarray, g))
            rewards.append(np.asarray(batch["rewards"]))
        grad_sum = tree_sum_f32(grads)
        loss = tree_sum_f32(losses) / np.float32(m_count)
        previous = params
        params, opt_state = apply(params, opt_state, grad_sum)
        records.append({"step": step, "mean_reward": float(np.mean(np.concatenate(rewards), dtype=np.float64)),
                        "loss": float(loss), "version": version})
    return records
