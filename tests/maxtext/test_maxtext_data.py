"""integrations.maxtext.data: MaxText's synthetic batch, indexable by (step, microbatch)."""

import pathlib
import pickle
import socket

import numpy as np
import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)

from integrations.maxtext import SyntheticSource, load_maxtext_config  # noqa: E402
from integrations.maxtext.data import KEYS, maxtext_synthetic_batch  # noqa: E402

TINY = pathlib.Path(__file__).resolve().parents[2] / "integrations" / "maxtext" / "configs" / "tiny.yml"


def test_microbatches_tile_maxtexts_global_batch_and_every_step_is_the_same():
    ec, mt = load_maxtext_config(TINY, ["dcn_data_parallelism=2", "elastic_microbatches=4"])
    source = pickle.loads(pickle.dumps(SyntheticSource.from_configs(ec, mt)))   # as shipped to workers
    spec = source.element_spec()
    assert set(spec) == set(KEYS) and all(s == ((2, 16), np.int32) for s in spec.values())
    whole = maxtext_synthetic_batch(mt, ec.global_batch_size)
    for key in KEYS:
        tiled = np.concatenate([source.batch(5, m)[key] for m in range(ec.microbatches)])
        np.testing.assert_array_equal(tiled, whole[key])
        np.testing.assert_array_equal(source.batch(0, 1)[key], source.batch(9, 1)[key])   # like MaxText's
    np.testing.assert_array_equal(whole["inputs"][:, 1:], whole["targets"][:, :-1])   # next-token targets
    assert whole["inputs"].max() < mt.vocab_size and len(np.unique(whole["inputs"])) > 10
    with pytest.raises(ValueError, match="microbatch 4"):
        source.batch(0, 4)


def test_an_unreachable_storage_endpoint_is_one_whole_line_with_its_cause():
    import elastic
    from integrations.maxtext.data_files import DataFiles

    with socket.socket() as s:   # a port nothing listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(elastic.ConfigError) as e:
        DataFiles("grain_train_files", endpoint=f"127.0.0.1:{port}", attempts=2, timeout_s=5).glob("gs://b/*.rec")
    assert str(e.value) == (f"config key 'grain_train_files': listing gs://b/*.rec: cannot reach the storage endpoint "
                            f"http://127.0.0.1:{port} ($STORAGE_EMULATOR_HOST): [Errno 111] Connection refused "
                            "(after 2 attempts)")
