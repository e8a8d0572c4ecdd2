"""RL post-training (GRPO) in plain JAX: the pure pieces the runtime's samplers and trainers call.

- :mod:`elastic.rl.task`: :class:`RLTask`, the bundled verifiable task (copy the prompt).
- :mod:`elastic.rl.policy`: :func:`sample` (temperature decoding) and :func:`token_logprobs`.
- :mod:`elastic.rl.grpo`: :func:`advantages`, :func:`rollout` (one sampler microbatch), :func:`grpo_loss`.
- :mod:`elastic.rl.reference`: :class:`RLSettings` and :func:`run_reference`, the one-process ground truth.
- :mod:`elastic.rl.job`: :class:`RLTrainer`, the job of an RL run on sampler and trainer workers (``fit()``;
  ``elastic run rl_tiny``), for the bundled task or your own (``task=``).

Importing this package imports JAX.
"""

from elastic.rl.grpo import ADVANTAGE_EPS, advantages, grpo_loss, rollout
from elastic.rl.policy import key_for, sample, token_logprobs
from elastic.rl.reference import RLSettings, run_reference, tree_sum_f32
from elastic.rl.task import RLTask
from elastic.rl.job import RLTrainer  # noqa: E402 - the job imports the pieces above

__all__ = [
    "ADVANTAGE_EPS",
    "RLSettings",
    "RLTrainer",
    "RLTask",
    "advantages",
    "grpo_loss",
    "key_for",
    "rollout",
    "run_reference",
    "sample",
    "token_logprobs",
    "tree_sum_f32",
]
