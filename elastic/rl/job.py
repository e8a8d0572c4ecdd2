"""An RL run as a job: the policy's trainer programs, its samplers' rollout program, the prompts they read.

:class:`RLTrainer` is an :class:`elastic.Trainer` whose loss is the clipped
policy-gradient loss (:func:`elastic.rl.grpo.grpo_loss`) and whose batches are
not read from a data source: each step's come from the run's samplers
(``rl_samplers`` worker processes, :mod:`runtime.control.sampling`), made with
the policy's weights of ``rl_off_policy_steps`` steps before, and carried to
the trainers with the step. Everything else about the trainers is a training
run's: the grid, the fixed reduction order, every recovery tier.

The samplers run one exported program, ``rollout(weights, prompts, seed,
step, microbatch)`` (:func:`elastic.rl.grpo.rollout`, for a mesh of
``rl_sampler_devices``), on weights that travel in ``rl_weights_dtype``; the
weights are the first leaves of the trainer's state (its ``(params, optimizer
state)``: the parameters).
"""

from __future__ import annotations

import dataclasses
import functools

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from elastic import _programs
from elastic.config import Config, ConfigError
from elastic.models.transformer import init_params
from elastic.rl.policy import sample, token_logprobs
from elastic.rl.reference import RLSettings
from elastic.trainer import Trainer
from runtime import (MESH_AXIS, SamplerPrograms, local_platform, program_platforms, run_rl_reference,
                     run_rl_reference_process)

__all__ = ["Prompts", "RLTrainer", "RolloutBatches"]


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The samplers' data source: ``prompts(step, microbatch)``, the task's prompts of that rollout microbatch."""

    task: object
    per_microbatch: int

    def prompts(self, step: int, microbatch: int) -> np.ndarray:
        return self.task.prompts(step, microbatch, self.per_microbatch)

    def reward(self, prompts: np.ndarray, completions: np.ndarray) -> np.ndarray:
        """A task whose reward runs on the samplers' hosts (``reward_on_host``): its reward of each row."""
        return self.task.reward(prompts, completions)


@dataclasses.dataclass(frozen=True)
class RolloutBatches:
    """The trainers' data source: a rollout microbatch's spec. Its batches come with each step's request, made
    by the samplers; a trainer never reads one here."""

    spec: tuple   # ((key, shape, dtype), ...)

    def element_spec(self) -> dict:
        return {k: (tuple(shape), np.dtype(dtype)) for k, shape, dtype in self.spec}

    def batch(self, step: int, microbatch: int):
        raise RuntimeError(f"the batch of ({step}, {microbatch}) is made by the RL run's samplers and comes with "
                           "the step's request; this trainer got none")


def _sampled(params, prompts, *, seed, step, microbatch, samples, max_new, temperature, tcfg=None, apply=None):
    """The rollout program's part when the reward runs on the samplers' hosts: each row's prompt, completion and
    sampling log-probabilities."""
    out = sample(params, prompts, tcfg=tcfg, apply=apply, seed=seed, step=step, microbatch=microbatch,
                 samples=samples, max_new=max_new, temperature=temperature)
    return {"prompts": jnp.repeat(jnp.asarray(prompts, jnp.int32), samples, axis=0), **out}


class RLTrainer(Trainer):
    """GRPO post-training of the bundled transformer (shaped by the config's model keys) on a task: the bundled
    copy-the-prompt task (``elastic run rl_tiny``), or ``task``, any object with

    - ``prompts(step, microbatch, p) -> int32[p, rl_prompt_length]``: a pure function of its arguments (numpy,
      on the samplers' hosts, as a data source is), and
    - ``reward(prompts, completions) -> float32[rows]``: a jax.numpy function of each row's prompt and
      completion (traced into the samplers' rollout program; it runs on the samplers, never on the client);
      or, with a ``reward_on_host = True`` attribute, any Python function of numpy arrays, which each sampler
      calls on its host after the program (a string match, a checker, a subprocess; it must be a pure function of
      its arguments for the run to be reproducible).

    ``policy``: the bundled transformer (None, shaped by the config's model keys), or any object with
    ``init(key) -> params`` and ``apply(params, tokens int32[rows, T]) -> logits [rows, T, vocab]``, a causal
    decoder's (T = rl_prompt_length + rl_max_new_tokens; both are traced into the exported programs, so they
    need not pickle and never run on the workers as Python).

    ``fit()`` as for any job. The task must pickle (it is shipped to the samplers)."""

    reports_model_keys = True

    def __init__(self, config: Config, *, task=None, policy=None):
        try:
            self.rl = rl = RLSettings.from_config(config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        rows = rl.rows_per_microbatch
        if config.microbatch_size != rows:
            raise ConfigError(f"a rollout microbatch has rl_prompts_per_microbatch x rl_samples_per_prompt = {rows} "
                              f"rows, but per_device_batch_size x ici_fsdp_parallelism is {config.microbatch_size}: "
                              f"set per_device_batch_size={rows // config.ici_fsdp_parallelism if rows % config.ici_fsdp_parallelism == 0 else rows}")
        if config.dcn_pipeline_parallelism > 1 or config.elastic_hosts_per_slice > 1 or config.eval_interval > 0:
            raise ConfigError("an RL run (rl_samplers > 0) trains on one slice per replica without eval for now: set "
                              "dcn_pipeline_parallelism=1, elastic_hosts_per_slice=1, eval_interval=0")
        if config.elastic_launcher != "local":
            raise ConfigError(f"an RL run's samplers are started by the local launcher for now; elastic_launcher="
                              f"{config.elastic_launcher!r} is not supported with rl_samplers > 0")
        self.task, self.config = task if task is not None else rl.task, config
        if not callable(getattr(self.task, "prompts", None)) or not callable(getattr(self.task, "reward", None)):
            raise ConfigError(f"the RL task {type(self.task).__name__} needs prompts(step, microbatch, p) and "
                              "reward(prompts, completions)")
        if policy is not None and not (callable(getattr(policy, "init", None)) and
                                       callable(getattr(policy, "apply", None))):
            raise ConfigError(f"the RL policy {type(policy).__name__} needs init(key) -> params and "
                              "apply(params, tokens) -> logits")
        self.init = policy.init if policy is not None else functools.partial(init_params, tcfg=rl.tcfg)
        self.apply = policy.apply if policy is not None else None   # None: the bundled transformer's forward
        # The policy's parameters as abstract leaves (the state's first leaves), traced once.
        params = _programs.trace_init(self.init)
        self._leaves, self._tree = jax.tree.leaves(params), jax.tree.structure(params)
        spec = self._rollout_spec()
        super().__init__(init=self.init, loss=rl.loss_fn(self.apply),
                         optimizer=rl.optimizer(), data=RolloutBatches(tuple(
                             (k, shape, dtype) for k, (shape, dtype) in spec.items() if k != "rewards")),
                         config=config)

    # -- programs --------------------------------------------------------------------

    def _weights_dtype(self):
        return np.dtype(jnp.bfloat16) if self.config.rl_weights_dtype == "bfloat16" else None

    @property
    def _kl(self) -> bool:
        """A KL term against the frozen initial policy: the samplers compute its log-probabilities too."""
        return self.rl.rl_kl_coef > 0

    @property
    def _host_reward(self) -> bool:
        """The task's reward is plain Python, called by each sampler on its host after the program."""
        return bool(getattr(self.task, "reward_on_host", False))

    @property
    def _outputs(self) -> tuple[str, ...]:
        """What the rollout program returns, in order (with a reward on the host, the sampler adds ``advantages``
        and ``rewards`` after it); the trainer's batch is all but ``rewards``."""
        sampled = ("prompts", "completions", "logprobs", *(("ref_logprobs",) if self._kl else ()))
        return sampled if self._host_reward else (*sampled[:3], "advantages", *sampled[3:], "rewards")

    def _rollout_args(self) -> tuple:
        """The rollout program's arguments as abstract values: the weights as samplers hold them (twice with a KL
        term: the frozen reference's too), the prompts, then seed, step and microbatch."""
        rl, dtype = self.rl, self._weights_dtype()
        weights = [jax.ShapeDtypeStruct(x.shape, dtype or x.dtype) for x in self._leaves]
        prompts = jax.ShapeDtypeStruct((rl.rl_prompts_per_microbatch, rl.rl_prompt_length), jnp.int32)
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        return (weights, *((weights,) if self._kl else ()), prompts, i32, i32, i32)

    def _rollout_fn(self):
        """``rollout(weights leaves, [reference weights,] prompts, seed, step, microbatch) -> outputs`` (the
        sampler's program; with a KL term, the frozen initial policy's log-probabilities of each completion too)."""
        leaves, tree = self._leaves, self._tree
        rl, outputs = self.rl, self._outputs
        policy = {"apply": self.apply} if self.apply is not None else {"tcfg": rl.tcfg}
        fn = functools.partial(rl.rollout_fn(self.apply), task=self.task)
        if self._host_reward:   # the program samples; the sampler scores on its host
            fn = functools.partial(_sampled, samples=rl.rl_samples_per_prompt, max_new=rl.rl_max_new_tokens,
                                   temperature=rl.rl_temperature, **policy)

        def params_of(weights):
            return jax.tree.unflatten(tree, [w.astype(x.dtype) for w, x in zip(weights, leaves)])

        def rollout(weights, *rest):
            *ref, prompts, seed, step, microbatch = rest
            out = fn(params_of(weights), prompts, seed=seed, step=step, microbatch=microbatch)
            if ref:
                out["ref_logprobs"] = token_logprobs(params_of(ref[0]), out["prompts"], out["completions"],
                                                     temperature=rl.rl_temperature, **policy)
            return tuple(out[k] for k in outputs)
        return rollout

    def _reference_fn(self):
        """``reference(seed) -> weights``: the initial policy's parameters, as the samplers hold weights."""
        dtype = self._weights_dtype()

        def reference(seed):
            return [x.astype(dtype or x.dtype) for x in jax.tree.leaves(self.init(jax.random.key(seed)))]
        return reference

    def _rollout_spec(self) -> dict:
        """``{output: (shape, dtype)}`` of one rollout microbatch."""
        rl = self.rl
        out = jax.eval_shape(self._rollout_fn(), *self._rollout_args())
        spec = {k: (tuple(o.shape), np.dtype(o.dtype).str) for k, o in zip(self._outputs, out)}
        if self._host_reward:
            rows = (rl.rows_per_microbatch,)
            spec.update(advantages=(rows, "<f4"), rewards=(rows, "<f4"))
        return spec

    def sampler_programs(self) -> SamplerPrograms:
        """The samplers' program, layout and prompts (exported once, for ``rl_sampler_devices`` devices)."""
        if getattr(self, "_samplers", None) is not None:
            return self._samplers
        rl, d = self.rl, self.config.rl_sampler_devices
        dtype = self._weights_dtype()
        args = self._rollout_args()
        weights, prompts, i32 = args[0], args[-4], args[-1]
        dims = [_programs.shard_dim(x.shape, d) for x in weights]
        mesh = AbstractMesh((d,), (MESH_AXIS,))
        blob = _programs.export_program("rollout", self._rollout_fn(), args,
                                        dims * (len(args) - 4) + [None, None, None, None], None, mesh,
                                        self._platform())
        reference = (_programs.export_program("reference", self._reference_fn(), (i32,), [None], dims, mesh,
                                              self._platform()) if self._kl else b"")
        spec = self._rollout_spec()
        layout = {"role": "sampler", "devices_per_slice": d,
                  # by name: a dtype's .str does not name extension types (bfloat16 is "<V2")
                  "weights": [[list(w.shape), np.dtype(w.dtype).name, dim] for w, dim in zip(weights, dims)],
                  "prompt": [list(prompts.shape), "<i4"],
                  "outputs": [[k, list(spec[k][0]), spec[k][1]] for k in self._outputs],
                  "num_microbatches": self.settings.microbatches,
                  **({"host_reward": {"samples": rl.rl_samples_per_prompt}} if self._host_reward else {}),
                  **({"reference_seed": self.settings.seed} if self._kl else {})}
        self._samplers = SamplerPrograms(rollout=blob, layout=layout,
                                         prompts=cloudpickle.dumps(Prompts(self.task, rl.rl_prompts_per_microbatch)),
                                         weight_leaves=tuple(range(len(self._leaves))),
                                         weights_dtype=np.dtype(dtype).name if dtype is not None else "",
                                         reference=reference)
        return self._samplers

    # -- the one-process reference ------------------------------------------------------

    def _reference_run(self, programs, step_done) -> tuple[list[float], list[str]]:
        """The RL run in this process on the very programs the workers run: the samplers' rollouts, then the
        trainers' step on them, in the run's schedule (:func:`runtime.run_rl_reference`); in a child process with
        the devices of both roles when this one has fewer. ``step_done(step, loss, rl_step)``."""
        settings, samplers = self.settings, self.sampler_programs()
        off = self.config.rl_off_policy_steps
        if (jax.local_device_count() >= max(programs.devices_per_slice, samplers.devices_per_slice)
                and local_platform() in program_platforms(programs.init)):
            losses, digest = run_rl_reference(programs, samplers, cloudpickle.loads(samplers.prompts), self.data,
                                              steps=settings.steps, seed=settings.seed, off_policy_steps=off,
                                              on_step=step_done)
        else:
            losses, digest = run_rl_reference_process(programs, samplers, samplers.prompts,
                                                      cloudpickle.dumps(self.data), steps=settings.steps,
                                                      seed=settings.seed, off_policy_steps=off, on_step=step_done,
                                                      compilation_cache_dir=settings.compilation_cache_dir)
        return losses, [digest]
