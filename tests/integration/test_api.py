"""The Python API on real workers: wrap() of a fused step, errors from workers."""

import jax
import numpy as np
import optax
import pytest

import elastic
from elastic.models import make_model
from runtime import ProgramExportError, WorkerError


def config(tmp_path, **kw):
    base = dict(steps=3, dcn_data_parallelism=2, ici_fsdp_parallelism=1, elastic_microbatches=2,
                base_output_directory=str(tmp_path))
    base.update(kw)
    return elastic.load_config("tiny", [f"{k}={v}" for k, v in base.items()])


def fused_step_factory(loss_fn, opt, *, batch_after_mark=False):
    def train_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = elastic.cross_slice_mean(grads)
        if batch_after_mark:
            grads = jax.tree.map(lambda g: g * batch["inputs"].mean(), grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}
    return train_step


def test_wrap_of_a_fused_step_matches_the_trainer_bit_for_bit(tmp_path):
    cfg = config(tmp_path, run_name="trainer")
    init, loss, data = make_model(cfg)
    opt = optax.adam(cfg.learning_rate)
    a = elastic.Trainer(init=init, loss=loss, optimizer=opt, data=data, config=cfg).fit()
    step = fused_step_factory(loss, opt)
    b = elastic.wrap(step, init_state=lambda k: (init(k), opt.init(init(k))), data=data,
                     config=cfg.replace(run_name="wrapped")).fit()
    assert b["steps_completed"] == 3
    assert b["losses"] == a["losses"]
    assert b["final_state_digest"] == a["final_state_digest"]


def test_wrap_refuses_a_step_whose_update_reads_the_batch(tmp_path):
    cfg = config(tmp_path)
    init, loss, data = make_model(cfg)
    opt = optax.sgd(0.1)
    step = fused_step_factory(loss, opt, batch_after_mark=True)
    with pytest.raises(ProgramExportError, match="reads the batch"):
        elastic.wrap(step, init_state=lambda k: (init(k), opt.init(init(k))), data=data, config=cfg).programs()


def test_wrap_refuses_a_step_without_the_mark(tmp_path):
    cfg = config(tmp_path)
    init, loss, data = make_model(cfg)

    def step(state, batch):
        return state, {"loss": loss(state, batch)}

    with pytest.raises(ProgramExportError, match="cross_slice_mean"):
        elastic.wrap(step, init_state=init, data=data, config=cfg).programs()


class ExplodingData:
    """A data source whose microbatch 1 of step 1 raises on the worker."""

    def __init__(self, inner):
        self.inner = inner

    def element_spec(self):
        return self.inner.element_spec()

    def batch(self, step, m):
        if (step, m) == (1, 1):
            raise RuntimeError("disk on fire")
        return self.inner.batch(step, m)


def test_a_data_source_error_reaches_the_client_with_the_remote_traceback(tmp_path):
    cfg = config(tmp_path)
    init, loss, data = make_model(cfg)
    trainer = elastic.Trainer(init=init, loss=loss, optimizer=optax.sgd(0.1), data=ExplodingData(data), config=cfg)
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    assert info.value.worker_id == "w1"
    assert "disk on fire" in info.value.message and "in batch" in info.value.remote_traceback


def test_cross_slice_mean_is_the_identity_outside_the_runtime():
    g = {"w": np.ones(3)}
    assert elastic.cross_slice_mean(g) is g
