"""MaxText data on gs:// (integrations.maxtext.data_files) and the client's packing-index cache (index_cache).

GCS is fake-gcs-server on loopback (tests/gcs_emulator.py), reached as a MaxText user's config reaches GCS:
``grain_train_files=gs://bucket/glob`` with ``$STORAGE_EMULATOR_HOST`` naming the endpoint.
"""

import dataclasses
import io
import pathlib
import pickle
import threading

import numpy as np
import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)
pytest.importorskip("pyarrow")

import elastic  # noqa: E402
from integrations.maxtext import load_maxtext_config  # noqa: E402
from integrations.maxtext.data import KEYS  # noqa: E402
from integrations.maxtext.data_files import DataFiles, gcs_glob_regex  # noqa: E402
from integrations.maxtext.documents import Tokenizer  # noqa: E402
from integrations.maxtext.text_data import index_cache_dir, source_for  # noqa: E402
from tests.gcs_emulator import GcsEmulator, emulator_binary  # noqa: E402
from tests.maxtext.maxtext_assets import LLAMA2, QWEN3, TINY, Over  # noqa: E402
from tests.maxtext.text_files import documents, upload, write_arrayrecord, write_parquet  # noqa: E402

pytestmark = pytest.mark.skipif(not emulator_binary(), reason="fake-gcs-server is not installed (the dev extra)")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator with gs://data/text/ holding the same 40 documents as 2 ArrayRecord files and 2 Parquet files
    (and a local copy of each), ``$STORAGE_EMULATOR_HOST`` and this module's shard cache set."""
    root = tmp_path_factory.mktemp("gcs-data")
    docs = documents()
    write_arrayrecord(root / "part-0.array_record", docs[:25])
    write_arrayrecord(root / "part-1.array_record", docs[25:])
    write_parquet(root / "part-0.parquet", docs[:18])
    write_parquet(root / "part-1.parquet", docs[18:])
    with GcsEmulator(root / "fake-gcs-server.log") as server, pytest.MonkeyPatch.context() as env:
        server.create_bucket("data")
        upload(server.endpoint, "data", {f"text/{p.name}": p for p in root.glob("part-*")})
        upload(server.endpoint, "data", {"other/part-9.array_record": root / "part-0.array_record"})
        env.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
        env.setenv("XDG_CACHE_HOME", str(root / "host-cache"))   # this "host"'s shard cache
        yield server, root


@pytest.fixture(scope="module")
def configs(gcs):
    _, root = gcs
    return load_maxtext_config(TINY, [
        f"base_output_directory={root / 'runs'}", "dataset_type=grain", "grain_file_type=arrayrecord",
        "grain_train_files=gs://data/text/*.array_record", f"tokenizer_path={LLAMA2}", "vocab_size=32000",
        "max_target_length=32", "per_device_batch_size=4", "elastic_microbatches=2", "steps=3", "num_epoch=100"])


def same_batches(a, b, calls=((0, 0), (0, 1), (3, 1), (11, 0))) -> None:
    for s, m in calls:
        x, y = a.batch(s, m), b.batch(s, m)
        for k in KEYS:
            assert x[k].tobytes() == y[k].tobytes(), (s, m, k)


def test_gcs_arrayrecord_and_parquet_give_the_rows_local_files_give(gcs, configs, tmp_path):
    from maxtext.utils import gcs_utils

    server, root = gcs
    ec, mt = configs
    files = DataFiles("grain_train_files").glob("gs://data/text/*.array_record")
    # MaxText's own glob of the pattern (gcs_utils.gcs_glob_pattern, as its find_data_files) in GCS's listing order;
    # the emulator ignores match_glob, so its answer is filtered here by the glob: the same files, the same order.
    theirs = [p for p in gcs_utils.gcs_glob_pattern("gs://data/text/*.array_record")
              if gcs_glob_regex("text/*.array_record").fullmatch(p[len("gs://data/"):])]
    assert [f.path for f in files] == theirs == ["gs://data/text/part-0.array_record",
                                                 "gs://data/text/part-1.array_record"]
    assert [f.size for f in files] == [(root / f"part-{i}.array_record").stat().st_size for i in (0, 1)]
    remote = source_for(ec, mt)
    same_batches(remote, source_for(ec, Over(mt, grain_train_files=str(root / "*.array_record"))))
    for pattern in ("gs://data/text/part-*.parquet", "gs://data/**/*.parquet", "gs://data/text/part-{0,1}.parquet"):
        parquet = source_for(ec, Over(mt, grain_file_type="parquet", grain_train_files=pattern))
        assert [f.path for f in parquet.documents.files] == [f"gs://data/text/part-{i}.parquet" for i in (0, 1)]
        same_batches(parquet, remote)
    hf = dict(dataset_type="hf", hf_path="parquet", tokenizer_path=str(QWEN3), vocab_size=151936)
    same_batches(source_for(ec, Over(mt, **hf, hf_train_files="gs://data/text/*.parquet")),
                 source_for(ec, Over(mt, **hf, hf_train_files=str(root / "*.parquet"))))
    # A worker reads its own rows: shipped without caches, it fetches only the shards those rows are in.
    plain = source_for(ec, Over(mt, enable_data_shuffling=False, packing=False))
    shipped = pickle.loads(pickle.dumps(plain))
    shipped.documents.store.cache_dir = str(tmp_path / "worker-cache")
    assert shipped.documents._source is None and not shipped.documents._local
    same_batches(shipped, plain, calls=((0, 0),))   # documents 0..3: in part-0
    assert [p.name for p in (tmp_path / "worker-cache" / "data" / "text").iterdir()] == \
        [f"part-0.array_record.g{files[0].version}"]
    same_batches(shipped, plain, calls=((3, 1),))   # documents 28..31: part-1 now too
    assert len(list((tmp_path / "worker-cache" / "data" / "text").iterdir())) == 2
    assert gcs_glob_regex("a/**/b*.x").fullmatch("a/b1.x") and not gcs_glob_regex("a/*.x").fullmatch("a/b/c.x")


def test_transient_errors_are_retried_and_failures_are_one_line_naming_the_key_and_object(gcs, configs):
    server, _ = gcs
    ec, mt = configs
    store = DataFiles("grain_train_files", timeout_s=0.5, attempts=5)
    file = store.glob("gs://data/text/part-0.parquet")[0]
    server.pause()   # a stalled server: the first attempts time out, a later one is answered
    resume = threading.Timer(1.5, server.resume)
    resume.start()
    try:
        assert store.read_range(file, 0, 4) == b"PAR1"
    finally:
        resume.join()
    server.pause()
    try:
        with pytest.raises(elastic.ConfigError) as e:
            DataFiles("hf_train_files", timeout_s=0.3, attempts=2).read_range(file, 0, 4)
    finally:
        server.resume()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config key 'hf_train_files': reading gs://data/text/part-0.parquet")
    assert "(after 2 attempts)" in msg
    cases = {
        "config key 'grain_train_files' ('gs://data/text/*.nothing') matches no file":
            dict(grain_train_files="gs://data/text/*.nothing"),
        "config key 'grain_train_files': listing gs://no-such-bucket/*.array_record: not found":
            dict(grain_train_files="gs://no-such-bucket/*.array_record"),
        "config key 'grain_eval_files' ('gs://data/eval/*') matches no file": dict(grain_eval_files="gs://data/eval/*"),
    }
    for want, keys in cases.items():
        with pytest.raises(elastic.ConfigError) as e:
            source_for(ec, Over(mt, **keys), split="eval" if "grain_eval_files" in keys else "train")
        assert str(e.value).startswith(want) and "\n" not in str(e.value), str(e.value)
    # An object replaced after the client listed it: its listed generation is gone, so no other bytes are read.
    other = DataFiles("grain_train_files").glob("gs://data/other/*.array_record")[0]
    upload(server.endpoint, "data", {"other/part-9.array_record": pathlib.Path(__file__)})
    with pytest.raises(elastic.ConfigError, match=r"^config key 'grain_train_files': fetching "
                       r"gs://data/other/part-9.array_record \(generation \d+\) to .*: not found"):
        DataFiles("grain_train_files", cache_dir="unused").local(other)


def arrays(npz: bytes) -> dict[str, bytes]:
    with np.load(io.BytesIO(npz)) as z:
        return {name: z[name].tobytes() for name in z.files}


def test_the_packing_index_is_built_once_and_a_bad_cache_file_is_rebuilt(gcs, configs, monkeypatch, tmp_path):
    ec, mt = configs
    ec = dataclasses.replace(ec, base_output_directory=str(tmp_path))   # a cache of this test's own
    encoded = []
    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text: encoded.append(1) or encode(self, text))
    first = source_for(ec, mt)
    assert len(encoded) == 40   # every document, once
    cache = pathlib.Path(index_cache_dir(ec))
    (stored,) = cache.glob("*.npz")
    assert first.index_origin.startswith("built (40 documents read in ") and first.index_origin.endswith(
        f"), stored in {stored}")
    encoded.clear()
    again = source_for(ec, mt)   # a restarted client: the index and the files' layout from the cache
    assert not encoded and again.index.rows == first.index.rows
    assert again.index_origin == f"read from its cache {stored}"
    encoded.clear()
    same_batches(again, first)
    assert encoded   # batches tokenize their own documents, as always
    for damage in (b"not an npz", stored.read_bytes()[:-100]):
        stored.write_bytes(damage)
        encoded.clear()
        rebuilt = source_for(ec, mt)
        assert len(encoded) == 40 and rebuilt.index.rows == first.index.rows   # not trusted: built anew
        same_batches(rebuilt, first)
    good = stored.read_bytes()
    source_for(ec, Over(mt, data_shuffle_seed=12, packing=False))   # another setting: another key, another file
    assert len(list(cache.glob("*.npz"))) == 2
    (other,) = set(cache.glob("*.npz")) - {stored}
    stored.write_bytes(other.read_bytes())   # a valid file of another key under this key: mismatched
    encoded.clear()
    rebuilt = source_for(ec, mt)
    assert len(encoded) == 40 and arrays(stored.read_bytes()) == arrays(good)   # rebuilt, and stored again
    same_batches(rebuilt, first)
