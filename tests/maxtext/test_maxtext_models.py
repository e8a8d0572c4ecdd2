"""MaxText models beyond the dense decoder: a tiny mixture of experts with dropout, under jax-elastic.

``integrations/maxtext/configs/tiny_moe.yml`` is MaxText's Mixtral decoder layer (``decoder_block: mixtral``)
at width 32: 2 layers, 4 experts, top-2, MaxText's dense dispatch with ``capacity_factor: 1.0`` (tokens over an
expert's capacity drop) and a load-balancing loss (``load_balance_loss_weight: 0.01``). The tests add
``dropout_rate=0.1``:

* one slice, one microbatch: jax-elastic's ``--reference`` run equals MaxText's own trainer loss by loss, to
  the bit (routing, capacity, load-balancing loss and dropout masks all as MaxText's);
* the 4 microbatches of a step draw 4 different dropout masks (the same rows give 4 different losses), each
  the same every time: a microbatch's masks are a function of its global index (carried in its batch), the
  same whichever slice runs it, so a recovery that moves microbatches between slices keeps the trajectory
  (the chaos tests of the dense model and of the MaxText data files check that under real kills; a MoE run
  of its own under a kill was the same property at 40 s of the suite).

That the config really drops tokens (the claim of its capacity factor) is checked in MaxText's log of the
first test: jax-elastic's losses equal its bits, so the same tokens drop.
"""

import pathlib

import numpy as np
import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from integrations.maxtext.__main__ import main  # noqa: E402
from tests.maxtext.trainers import elastic_losses, finished, maxtext_trainer, stop  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_MOE = ROOT / "integrations" / "maxtext" / "configs" / "tiny_moe.yml"
DROPOUT = "dropout_rate=0.1"
STEPS = 3


def test_moe_with_dropout_on_one_slice_reproduces_maxtext_trainer_bit_for_bit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")   # main sets a slice's device count (1 here); restored after the test
    overrides = [f"steps={STEPS}", DROPOUT]
    proc = maxtext_trainer(TINY_MOE, tmp_path, *overrides)   # runs beside the jax-elastic run below
    try:
        assert main([str(TINY_MOE), *overrides, f"base_output_directory={tmp_path}", "run_name=elastic",
                     "--reference"]) == 0
        assert f"{STEPS}/{STEPS} steps" in capsys.readouterr().out
        ours = elastic_losses(tmp_path / "elastic")
        metrics = finished(proc, tmp_path)
    finally:
        stop(proc)
    theirs = [m["learning/loss"] for m in metrics]
    with capsys.disabled():
        print(f"\nMaxText trainer: {theirs}\njax-elastic:     {ours}\nMaxText's load-balancing loss: "
              f"{[m['learning/moe_lb_loss'] for m in metrics]}")
    # MaxText's step is the MoE one: its loss is the language-model loss plus the load-balancing loss ...
    for m in metrics:
        assert m["learning/moe_lb_loss"] > 0
        assert m["learning/loss"] == pytest.approx(m["learning/lm_loss"] + m["learning/moe_lb_loss"], abs=1e-6)
    log = (tmp_path / "maxtext.log").read_text()
    assert "Applying potential token dropping with a batch expert_capacity of 8" in log   # capacity_factor's path
    # ... and jax-elastic's one slice is that step, dropout masks included, to the bit.
    assert len(ours) == len(theirs) == STEPS
    assert ours == theirs   # float32 values, compared exactly


@pytest.fixture
def moe_dropout(monkeypatch):
    """(elastic config, MaxText config) of TINY_MOE with dropout and 4 microbatches, one device per slice."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")   # if JAX has not started yet
    from integrations.maxtext import load_maxtext_config

    return load_maxtext_config(str(TINY_MOE), ["steps=2", DROPOUT, "elastic_microbatches=4"])


def test_each_microbatch_draws_its_own_dropout_masks(moe_dropout):
    import jax

    from integrations.maxtext import make_job
    from integrations.maxtext.model import MICROBATCH_KEY

    ec, mt = moe_dropout
    job = make_job(ec, mt)
    assert job.data.batch(1, 2)[MICROBATCH_KEY].tolist() == [2] * ec.microbatch_size   # the global index, per row
    programs = job.programs()
    state = jax.export.deserialize(programs.init).call(np.int32(ec.seed))
    grad = jax.export.deserialize(programs.programs()["grad"])
    rows = job.data.batch(0, 0)

    def loss_and_grads(m):   # the grad program on microbatch 0's rows, as microbatch m
        out = np.asarray(grad.call(state, {**rows, MICROBATCH_KEY: np.full_like(rows[MICROBATCH_KEY], m)}))
        return float(out[-1]), out

    losses = [loss_and_grads(m)[0] for m in range(ec.microbatches)]
    print(f"\nthe same rows as microbatches 0..3: losses {losses}")
    assert len(set(losses)) == ec.microbatches, losses   # before: every microbatch drew microbatch 0's masks
    again = loss_and_grads(1)[1]
    assert np.array_equal(loss_and_grads(1)[1], again)   # and the same masks every time
