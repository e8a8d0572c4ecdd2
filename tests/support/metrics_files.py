"""What a run's metrics files hold, read as their users read them: TensorBoard's own reader, JSON lines."""

import json
import pathlib

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from elastic.metrics import LOSS, tensorboard_dir


def tensorboard_scalars(run_dir: pathlib.Path, tag: str = LOSS) -> list[tuple[int, float]]:
    """``(step, value)`` of every ``tag`` scalar in the run's event files, in the order TensorBoard reads them.
    Nothing is purged (TensorBoard would hide a step written twice behind the later copy)."""
    acc = EventAccumulator(str(tensorboard_dir(run_dir)), purge_orphaned_data=False)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def metrics_file_lines(path: pathlib.Path) -> list[dict]:
    """Every line of a ``metrics_file``, decoded (a line that is not JSON fails the test)."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]
