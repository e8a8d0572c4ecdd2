"""``elastic run``'s progress bar (``elastic.cli_support.progress``): a training run's shows each step's loss, an RL
run's each step's mean reward (from its ``rl_step`` events, given to ``on_step.observe``), since an RL run's loss
is about 0 whatever the policy learns."""

import re

from elastic.cli_support import progress


def _bar(capsys, feed) -> str:
    with progress(3, quiet=False) as on_step:
        feed(on_step)
    return re.sub(r"\s+", " ", capsys.readouterr().out)


def test_a_training_run_s_bar_shows_the_loss(capsys):
    def feed(on_step):
        on_step.observe({"kind": "step_committed", "step": 0, "loss": 2.5})
        on_step(0, 2.5)
        on_step(1, 2.25)
    shown = _bar(capsys, feed)
    assert "loss 2.2500" in shown and "reward" not in shown, shown


def test_an_rl_run_s_bar_shows_the_reward_not_the_loss(capsys):
    def feed(on_step):
        for step, reward in enumerate([0.125, 0.5]):
            on_step.observe({"kind": "rl_step", "step": step, "version": step, "mean_reward": reward})
            on_step(step, -1e-9)
        on_step.observe({"kind": "rl_step", "step": 2, "version": 2})   # committed by a restarted client: unknown
        on_step(2, 1e-9)
    shown = _bar(capsys, feed)
    assert "reward -" in shown and "loss" not in shown, shown
    with progress(3, quiet=True) as on_step:
        assert on_step is None
