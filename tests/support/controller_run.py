"""The controller's runs over the fake worker group (``tests/support/fake_group.py``): their microbatch count and
the losses such a run reports when nothing goes wrong. Shared by the controller's tests and the re-attach tests."""

import numpy as np

from tests.support.fake_group import loss_sum

M = 4   # microbatches per step


def expected_losses(steps):
    """Steps 0..steps-1's losses: the fake group's loss sum of each step over ``M`` microbatches, in float32."""
    return [float(np.float32(loss_sum(s)) / np.float32(M)) for s in range(steps)]
