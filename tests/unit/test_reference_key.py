"""The chaos reference is keyed by what determines the math: programs, data source and config."""

import dataclasses
import pathlib

from chaos.harness import reference_report
from elastic.config import load_config


@dataclasses.dataclass
class Data:
    seed: int = 0


class Programs:
    def __init__(self, grad: bytes):
        self.grad = grad

    def programs(self):
        return {"init": b"init", "grad": self.grad, "apply": b"apply"}


class Job:
    """Stands in for a Trainer: its programs, data, run directory, and a reference fit that records itself."""

    fits: list = []

    def __init__(self, cfg, grad: bytes, data):
        self.cfg, self._grad, self.data = cfg, grad, data

    def programs(self):
        return Programs(self._grad)

    def run_dir(self):
        return pathlib.Path(self.cfg.base_output_directory) / self.cfg.run_name

    def fit(self, reference=False):
        assert reference
        Job.fits.append(self.cfg.run_name)
        return {"finished": True, "steps_completed": self.cfg.steps}


def key(tmp_path, grad=b"grad", data=Data(), **overrides):
    cfg = load_config("tiny", [f"base_output_directory={tmp_path}", *[f"{k}={v}" for k, v in overrides.items()]])
    reference_report(lambda c: Job(c, grad, data), cfg, cfg.steps)
    return Job.fits[-1]


def test_another_model_optimizer_or_data_source_gets_another_reference(tmp_path):
    same = key(tmp_path)
    assert key(tmp_path) == same                       # nothing changed: the same reference
    assert key(tmp_path, dcn_data_parallelism=2) == same   # the slice count does not change the math
    assert key(tmp_path, grad=b"edited model") != same   # the programs changed (model, optimizer)
    assert key(tmp_path, data=Data(seed=1)) != same      # the data source changed
    assert key(tmp_path, learning_rate=0.5) != same      # a config key of the math changed
