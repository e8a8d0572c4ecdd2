"""``elastic._programs.program_fingerprints``: which math each program is, whatever the trace's call stack."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from elastic._programs import build_programs, program_fingerprints


def programs(learning_rate, depth=0):
    """A linear model's programs, traced ``depth`` Python frames deeper (the ``#loc`` numbering then differs)."""
    if depth:
        return programs(learning_rate, depth - 1)
    opt = optax.adam(learning_rate)

    def init_state(key):
        params = {"w": jnp.zeros((4, 2), jnp.float32)}
        return params, opt.init(params)

    def grad_fn(state, batch):
        def loss(p):
            return jnp.mean((batch["x"] @ p["w"]) ** 2)
        return jax.value_and_grad(loss)(state[0])

    def apply_fn(state, grads):
        updates, opt_state = opt.update(grads, state[1], state[0])
        return optax.apply_updates(state[0], updates), opt_state

    return build_programs(init_state=init_state, grad_fn=grad_fn, apply_fn=apply_fn,
                          batch_spec={"x": ((2, 4), np.float32)}, devices_per_slice=1, num_microbatches=1)


def test_the_same_math_traced_under_another_call_stack_has_the_same_fingerprints():
    assert program_fingerprints(programs(1e-3)) == program_fingerprints(programs(1e-3, depth=5))


def test_another_learning_rate_changes_only_the_apply_program():
    a, b = program_fingerprints(programs(1e-3)), program_fingerprints(programs(3e-3))
    assert a["init"] == b["init"] and a["grad"] == b["grad"] and a["apply"] != b["apply"]
