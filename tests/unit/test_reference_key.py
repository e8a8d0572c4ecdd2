"""The chaos reference is keyed by what determines the math: programs, data source and config."""

import dataclasses
import pathlib

from chaos.harness import reference_report
from elastic.config_loading import load_config


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


def test_keys_without_the_math_role_leave_the_reference_alone(tmp_path):
    # Issue 24: the digest once treated every elastic_* key as neutral and every other key as math,
    # so jax_cache_dir (where compiled programs are cached) changed it. Now the schema's roles decide.
    from elastic.config import MATH_KEYS, REFERENCE_NEUTRAL
    same = key(tmp_path)
    neutral = {"jax_cache_dir": "/tmp/elsewhere", "enable_goodput_recording": "true", "run_name": "other",
               "elastic_data_plane": "grpc", "elastic_chunk_bytes": 65536, "elastic_dispatch_depth": 1,
               "enable_checkpointing": "true", "checkpoint_period": 3, "elastic_rpc_timeout_seconds": 9}
    assert set(neutral) <= REFERENCE_NEUTRAL
    for k, v in neutral.items():
        assert key(tmp_path, **{k: v}) == same, k
    math = {"seed": 7, "per_device_batch_size": 3, "elastic_microbatches": 8, "warmup_steps": 2, "learning_rate": 0.5}
    assert set(math) <= MATH_KEYS
    for k, v in math.items():
        assert key(tmp_path, **{k: v}) != same, k


def test_a_cached_reference_is_reused_only_when_its_digest_is_of_this_runtimes_algorithm(tmp_path):
    import json

    from runtime import STATE_DIGEST

    cfg = load_config("tiny", [f"base_output_directory={tmp_path}"])
    job = lambda c: Job(c, b"grad", Data())  # noqa: E731
    reference_report(job, cfg, cfg.steps)
    name = Job.fits[-1]
    cached = tmp_path / name / "report.json"
    cached.parent.mkdir(parents=True, exist_ok=True)
    digest = f"{STATE_DIGEST}:{'ab' * 16}"
    cached.write_text(json.dumps({"finished": True, "steps_completed": cfg.steps, "final_state_digest": digest,
                                  "digest_algorithm": STATE_DIGEST}))
    fits = len(Job.fits)
    report, _ = reference_report(job, cfg, cfg.steps)
    assert len(Job.fits) == fits and report["final_state_digest"] == digest   # reused
    # One cached before the digest named its algorithm (report_version 1: a sha256): it would never compare
    # identical to this run's digest, so the reference runs again.
    cached.write_text(json.dumps({"finished": True, "steps_completed": cfg.steps, "final_state_sha256": "ab" * 32}))
    reference_report(job, cfg, cfg.steps)
    assert len(Job.fits) == fits + 1 and Job.fits[-1] == name
