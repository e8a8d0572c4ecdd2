"""The client refuses a data source whose element_spec is not one microbatch, before anything starts.

``elastic.preflight.check_data_source`` is pure (it reads the spec, never a
batch); the command line calls it once the job is built, so a global-batch
spec is one ``elastic: error:`` line instead of a worker's remote traceback.
"""

import numpy as np
import pytest

import elastic
from elastic.config import ConfigError
from elastic.config_loading import load_config
from elastic.preflight import check_data_source

CFG = load_config("tiny")   # 4 microbatches of per_device_batch_size 2 x ici_fsdp_parallelism 2 = 4 examples


def source(spec):
    return elastic.FunctionSource(lambda step, m: {}, spec)


def refusal(spec, cfg=CFG) -> str:
    with pytest.raises(ConfigError) as e:
        check_data_source(source(spec), cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_microbatch_spec_passes():
    assert (CFG.microbatch_size, CFG.global_batch_size) == (4, 16)
    check_data_source(source({"x": ((4, 8), np.float32), "y": ((4,), np.int32)}), CFG)
    # a key every microbatch carries whole (a table) beside the microbatch's own keys
    check_data_source(source({"x": ((4, 8), np.float32), "table": ((6, 3), np.float32)}), CFG)


def test_a_global_batch_spec_is_refused_naming_the_microbatch_size():
    msg = refusal({"x": ((4, 8), np.float32), "y": ((16, 1), np.float32)})
    assert msg == ("the data source's element_spec()['y'] has shape (16, 1), but element_spec is per microbatch: "
                   "a microbatch here has 4 examples (per_device_batch_size 2 x ici_fsdp_parallelism 2), so its "
                   "leading dimension must be 4, as batch(step, microbatch) returns it; 16 is the global batch "
                   "(4 microbatches x 4)")


def test_a_spec_with_no_microbatch_key_is_refused_with_the_batch_size_that_would_fit():
    msg = refusal({"x": ((8, 8), np.float32)})
    assert "element_spec is per microbatch" in msg and "4 examples" in msg
    assert msg.endswith("(or, if a microbatch of yours has 8 examples, set per_device_batch_size=4)")
    assert "has shape ()" in refusal({"x": ((), np.float32)})


def test_one_microbatch_per_step_makes_the_global_batch_a_microbatch():
    one = CFG.replace(dcn_data_parallelism=1, elastic_microbatches=1)
    check_data_source(source({"x": ((4, 8), np.float32)}), one)


def test_what_is_not_a_data_source_is_left_to_the_trainer():
    check_data_source(object(), CFG)   # the trainer's own check names what a source must have

    class Malformed:
        def element_spec(self):
            return [1, 2]

        def batch(self, step, m):
            return {}
    check_data_source(Malformed(), CFG)


FACTORY = '''
import numpy as np
import elastic
from tests.chaos import own_model

def make_job(config):
    size, total = config.microbatch_size, config.global_batch_size
    data = elastic.FunctionSource(lambda step, m: own_model.make_batch(step, m, size),
                                  {"x": ((total, own_model.FEATURES), np.float32), "y": ((total, 1), np.float32)})
    def init_state(key):
        return own_model.init_params(key), own_model.OPT.init(own_model.init_params(key))
    return elastic.wrap(own_model.train_step, init_state=init_state, data=data, config=config)
'''


def test_the_command_line_refuses_it_in_one_line_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    import elastic.cli

    (tmp_path / "global_spec.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = elastic.cli.main(["run", "tiny", "--trainer", "global_spec:make_job", "--quiet", "run_name=g",
                             f"base_output_directory={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("elastic: error: the data source's element_spec()['x'] has shape (16, 8)")
    assert "16 is the global batch" in err[0]
    assert not (tmp_path / "runs" / "g" / "events.jsonl").exists()   # nothing started
