"""``elastic.wrap`` accepts a train step in the forms existing loops write it.

Every form (plain, ``@jax.jit``, a jitted step already called in plain JAX,
``functools.partial``, a method, the mark inside a jitted helper, ``nnx.jit``)
must export programs that train exactly like the plain function, in one
process (``run_reference``, 1 device per slice).
"""

import functools

import jax
import optax
import pytest

import elastic
from elastic.models import make_model
from runtime import ProgramExportError, run_reference


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = elastic.load_config("tiny", ["steps=2", "dcn_data_parallelism=1", "ici_fsdp_parallelism=1",
                                       "elastic_microbatches=2",
                                       f"base_output_directory={tmp_path_factory.mktemp('runs')}"])
    init, loss, data = make_model(cfg)
    opt = optax.adam(1e-2)
    return cfg, init, loss, data, opt


def _step(loss, opt):
    def train_step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        grads = elastic.cross_slice_mean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}
    return train_step


def _train(step, setup):
    cfg, init, _, data, opt = setup
    job = elastic.wrap(step, init_state=lambda k: (init(k), opt.init(init(k))), data=data, config=cfg)
    return run_reference(job.programs(), data, steps=2, seed=0)


def _forms(loss, opt, setup):
    plain = _step(loss, opt)
    called = jax.jit(_step(loss, opt))
    cfg, init, _, data, _ = setup
    params = init(jax.random.key(0))
    called((params, opt.init(params)), {k: v for k, v in data.batch(0, 0).items()})   # its jit cache holds a plain trace

    def with_lr(state, batch, *, scale):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch)
        grads = elastic.cross_slice_mean(jax.tree.map(lambda g: g * scale, grads))
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    class Model:
        @functools.partial(jax.jit, static_argnums=0)
        def step(self, state, batch):
            return plain(state, batch)

        def __hash__(self):
            return 0

        def __eq__(self, other):
            return isinstance(other, Model)

    @jax.jit
    def helper(params, batch):   # the mark inside a jitted helper, not at the step's top level
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, elastic.cross_slice_mean(grads)

    def outer(state, batch):
        params, opt_state = state
        value, grads = helper(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return {"jit, called before": called, "partial": jax.jit(functools.partial(with_lr, scale=1.0)),
            "method": Model().step, "jitted helper": outer}


@pytest.fixture(scope="module")
def want(setup):
    """What the plain function trains to (computed once for the tests that compare with it)."""
    _, _, loss, _, opt = setup
    return _train(_step(loss, opt), setup)


def test_every_form_trains_like_the_plain_step(setup, want):
    _, _, loss, _, opt = setup
    for name, step in _forms(loss, opt, setup).items():
        assert _train(step, setup) == want, name


def test_nnx_jit_step_trains_like_the_plain_step(setup, want):
    nnx = pytest.importorskip("flax.nnx")
    _, _, loss, _, opt = setup
    assert _train(nnx.jit(_step(loss, opt)), setup) == want


def test_a_mark_called_twice_is_refused_with_what_to_change(setup):
    _, _, loss, _, opt = setup
    plain = _step(loss, opt)

    @jax.jit
    def twice(state, batch):
        elastic.cross_slice_mean(state[0])
        return plain(state, batch)

    with pytest.raises(ProgramExportError, match="more than once"):
        _train(twice, setup)
