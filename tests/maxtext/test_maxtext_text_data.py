"""integrations.maxtext.text_data: MaxText's grain and hf pipelines on real files, indexable by (step, microbatch)."""

import dataclasses
import pickle
import re

import numpy as np
import pytest

pytest.importorskip("maxtext")   # the MaxText integration's requirements (integrations/maxtext/requirements.txt)
pytest.importorskip("pyarrow")

import elastic  # noqa: E402
from integrations.maxtext import load_maxtext_config  # noqa: E402
from integrations.maxtext.data import KEYS  # noqa: E402
from integrations.maxtext.text_data import PackedIndex, TextSource, _packed, source_for  # noqa: E402
from tests.maxtext.maxtext_assets import LENGTH, LLAMA2, QWEN3, TINY, Over  # noqa: E402
from tests.maxtext.text_files import documents, write_arrayrecord, write_parquet  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """40 documents in two ArrayRecord files and in one Parquet file (row groups of 7), in the same order."""
    root = tmp_path_factory.mktemp("text")
    docs = documents()
    write_arrayrecord(root / "part-0.array_record", docs[:25])
    write_arrayrecord(root / "part-1.array_record", docs[25:])
    write_parquet(root / "docs.parquet", docs)
    return root, docs


@pytest.fixture(scope="module")
def configs(data):
    """One load of tiny.yml on that ArrayRecord data: 2 microbatches of 4 rows of LENGTH tokens."""
    root, _ = data
    return load_maxtext_config(TINY, [
        f"base_output_directory={root / 'runs'}",   # where the client caches packing indexes
        "dataset_type=grain", "grain_file_type=arrayrecord", f"grain_train_files={root}/*.array_record",
        f"tokenizer_path={LLAMA2}", "vocab_size=32000", f"max_target_length={LENGTH}", "per_device_batch_size=4",
        "elastic_microbatches=2", "steps=3", "num_epoch=100"])


def maxtext_tokens(mt, docs, *, trim=True) -> list[np.ndarray]:
    """What MaxText's own tokenizer code makes of each document (TokenizeAndTrim with use_truncation)."""
    from maxtext.input_pipeline import data_processing_utils, grain_tokenizer

    tokenizer, _ = data_processing_utils.get_tokenizer_and_pad_id(mt)
    op = grain_tokenizer.TokenizeAndTrim("text", LENGTH if trim else 10**9, tokenizer)
    return [op.map({"text": d})["text"] for d in docs]


def maxtext_batches(mt, files, count):
    """The first ``count`` batches of MaxText's own grain pre-training pipeline (in this process, no shuffling)."""
    import grain.python as grain
    from maxtext.input_pipeline import grain_data_processing

    if mt.grain_file_type == "arrayrecord":
        dataset = grain.MapDataset.source(grain.ArrayRecordDataSource(files)).to_iter_dataset()
    else:
        dataset = grain.experimental.ParquetIterDataset(files)
    dataset = grain_data_processing.pretrain_preprocessing_pipeline(dataset, mt, list(mt.train_data_columns),
                                                                    bool(mt.tokenize_train_data), 0, 1)
    it = iter(dataset)
    return [next(it) for _ in range(count)]


def rows_of(source, count) -> dict[str, np.ndarray]:
    """Global rows 0..count-1 of ``source``, through batch()."""
    per_step = source.microbatches * source.microbatch_size
    steps = -(-count // per_step)
    parts = [source.batch(s, m) for s in range(steps) for m in range(source.microbatches)]
    return {k: np.concatenate([p[k] for p in parts])[:count] for k in KEYS}


def segments(rows) -> list[tuple[int, ...]]:
    """Every packed segment of every row, as its token tuple."""
    out = []
    for r in range(len(rows["inputs"])):
        seg = rows["inputs_segmentation"][r]
        for k in np.unique(seg[seg > 0]):
            out.append(tuple(rows["inputs"][r][seg == k].tolist()))
    return out


def check_row_structure(rows, pad_id) -> None:
    """Segment and position ids as MaxText's packing and ShiftData make them."""
    inputs, seg, pos = rows["inputs"], rows["inputs_segmentation"], rows["inputs_position"]
    np.testing.assert_array_equal(rows["targets"][:, :-1], inputs[:, 1:])   # next-token targets
    assert (rows["targets"][:, -1] == pad_id).all()
    want_tseg = np.concatenate([seg[:, 1:], np.zeros((len(seg), 1), seg.dtype)], axis=1)
    want_tseg[rows["targets"] == pad_id] = 0
    np.testing.assert_array_equal(rows["targets_segmentation"], want_tseg)
    np.testing.assert_array_equal(rows["targets_position"], pos)
    for r in range(len(seg)):
        ids = seg[r][seg[r] > 0]
        assert (np.diff(ids) >= 0).all() and (ids[0] == 1 if len(ids) else True)   # 1..k, in order
        assert (seg[r][len(ids):] == 0).all() and (inputs[r][len(ids):] == 0).all()   # padding after
        for k in np.unique(ids):
            np.testing.assert_array_equal(pos[r][seg[r] == k], np.arange((seg[r] == k).sum()))


def test_packed_rows_are_maxtexts_rows_and_every_document_is_in_one_epoch_once(data, configs):
    root, docs = data
    ec, mt = configs
    mt = Over(mt, enable_data_shuffling=False)
    files = sorted(str(p) for p in root.glob("*.array_record"))
    source = source_for(ec, mt)
    want = maxtext_tokens(mt, docs)
    assert sorted(segments(rows_of(source, source.index.rows))) == sorted(tuple(t.tolist()) for t in want)
    # With MaxText's packing groups (its local batch size: 4 rows), each of its batches holds the same rows as the
    # same 4 rows here (its bins are shuffled inside a group; ours are not).
    grouped = TextSource.build(source.documents, source.tokenizer, length=LENGTH, microbatch_size=4, microbatches=2,
                               bins=4)
    ours = rows_of(grouped, 16)
    for k, theirs in enumerate(maxtext_batches(mt, files, 4)):
        assert set(theirs) == set(KEYS)
        mine = np.concatenate([ours[key][4 * k:4 * k + 4] for key in KEYS], axis=1)
        full = np.concatenate([np.asarray(theirs[key]) for key in KEYS], axis=1)
        assert sorted(map(tuple, mine.tolist())) == sorted(map(tuple, full.tolist())), f"batch {k}"
    check_row_structure(rows_of(source, source.index.rows), pad_id=-1)
    tokens = sum(len(t) for t in want)
    assert -(-tokens // LENGTH) <= source.index.rows < 0.6 * len(docs)   # packed, not one document a row


def test_padded_rows_are_maxtexts_batches(data, configs):
    root, docs = data
    ec, mt = configs
    mt = Over(mt, enable_data_shuffling=False, packing=False)
    source = source_for(ec, mt)
    assert source.index.rows == len(docs)
    files = sorted(str(p) for p in root.glob("*.array_record"))
    ours = rows_of(source, 16)
    for k, theirs in enumerate(maxtext_batches(mt, files, 4)):
        for key in KEYS:
            np.testing.assert_array_equal(ours[key][4 * k:4 * k + 4], theirs[key], err_msg=f"{key}, batch {k}")
    bare = source_for(ec, Over(mt, enable_data_shuffling=False, packing=False, tokenizer_path="tokenizer.llama2"))
    assert bare.tokenizer.path == str(LLAMA2)   # a bare name: MaxText's bundled tokenizer
    assert np.array_equal(bare.batch(1, 1)["inputs"], source.batch(1, 1)["inputs"])
    want = maxtext_tokens(mt, docs)
    for d in range(16):   # one document a row, then MaxText's padding (its pad id, -1 for llama2)
        n = len(want[d])
        np.testing.assert_array_equal(ours["inputs"][d, :n], want[d])
        assert (ours["inputs"][d, n:] == -1).all() and (ours["inputs_segmentation"][d, :n] == 1).all()


def test_batches_are_pure_and_steps_differ(data, configs):
    ec, mt = configs
    source = source_for(ec, mt)   # shuffled (MaxText's default), packed
    spec = source.element_spec()
    assert spec == {k: ((4, LENGTH), np.dtype(np.int32)) for k in KEYS}
    calls = [(s, m) for s in (0, 1, 5, 40) for m in (0, 1)]
    first = {c: source.batch(*c) for c in calls}
    shipped = pickle.loads(pickle.dumps(source))   # as shipped to workers: no caches, no open files
    assert not shipped._tokens and shipped.documents._source is None
    for c in reversed(calls):   # another process's order, twice
        for again in (source.batch(*c), shipped.batch(*c)):
            for k in KEYS:
                assert again[k].tobytes() == first[c][k].tobytes() and again[k].dtype == np.int32
    assert not np.array_equal(first[(0, 0)]["inputs"], first[(0, 1)]["inputs"])
    assert not np.array_equal(first[(0, 0)]["inputs"], first[(1, 0)]["inputs"])
    with pytest.raises(ValueError, match="microbatch 2"):
        source.batch(0, 2)


def test_shuffling_changes_the_order_not_the_documents(data, configs):
    _, docs = data
    ec, mt = configs
    plain = source_for(ec, Over(mt, enable_data_shuffling=False, packing=False))
    seeded = source_for(ec, Over(mt, packing=False))
    other = source_for(ec, Over(mt, packing=False, data_shuffle_seed=7))
    n = len(docs)
    epochs = {name: rows_of(s, 2 * n)["inputs"] for name, s in (("plain", plain), ("0", seeded), ("7", other))}
    for name, rows in epochs.items():
        for epoch in (rows[:n], rows[n:]):   # each epoch holds every document once
            assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, epochs["plain"][:n].tolist())), name
    assert not np.array_equal(epochs["0"][:n], epochs["plain"][:n])
    assert not np.array_equal(epochs["0"][:n], epochs["7"][:n])
    assert not np.array_equal(epochs["0"][:n], epochs["0"][n:])   # a new order each epoch
    np.testing.assert_array_equal(epochs["plain"][:n], epochs["plain"][n:])
    # Packed and shuffled: documents are shuffled before packing, rows each epoch; still each document once.
    packed = source_for(ec, mt)
    rows = rows_of(packed, 2 * packed.index.rows)
    want = sorted(tuple(t.tolist()) for t in maxtext_tokens(mt, docs))
    for half in (slice(0, packed.index.rows), slice(packed.index.rows, None)):
        assert sorted(segments({k: v[half] for k, v in rows.items()})) == want


def test_chunking_max_segments_and_best_fit(data, configs):
    _, docs = data
    ec, mt = configs
    chunked = source_for(ec, Over(mt, use_truncation=False, enable_data_shuffling=False))
    full = maxtext_tokens(mt, docs, trim=False)
    assert any(len(t) > LENGTH for t in full)
    pieces = segments(rows_of(chunked, chunked.index.rows))
    want = [tuple(t[i:i + LENGTH].tolist()) for t in full for i in range(0, len(t), LENGTH)]   # TokenizeAndChunk
    assert sorted(pieces) == sorted(want)
    two = source_for(ec, Over(mt, max_segments_per_seq=2))
    rows = rows_of(two, two.index.rows)
    assert rows["inputs_segmentation"].max() == 2 and len(segments(rows)) == len(docs)
    best = source_for(ec, Over(mt, grain_packing_type="best_fit"))
    assert sorted(segments(rows_of(best, best.index.rows))) == sorted(tuple(t.tolist()) for t in
                                                                     maxtext_tokens(mt, docs))


def test_index_packs_as_grains_first_fit():
    import grain.python as grain

    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 20, size=300)
    index = PackedIndex.build(sizes, 20, packing=True, chunk=False, bins=8, max_segments=3)
    elements = [{"inputs": np.full(n, i + 1, np.int32)} for i, n in enumerate(sizes)]
    packed = grain.experimental.FirstFitPackIterDataset(
        grain.MapDataset.source(elements).to_iter_dataset(), length_struct={"inputs": 20}, num_packing_bins=8,
        shuffle_bins=False, max_sequences_per_bin=3)
    theirs = list(packed)
    assert len(theirs) == index.rows
    for r, row in enumerate(theirs):   # the same elements in the same row, in the same segments and positions
        pieces = [[np.full(sizes[e], e + 1, np.int32) for e in index.row(r)]]
        mine = _packed(pieces, 20)
        for key, theirs_key in (("inputs", "inputs"), ("inputs_segmentation", "inputs_segment_ids"),
                                ("inputs_position", "inputs_positions")):
            np.testing.assert_array_equal(mine[key][0], row[theirs_key], err_msg=f"row {r} {key}")
    best = PackedIndex.build(sizes, 20, packing=True, chunk=False, bins=8, best_fit=True)
    theirs = list(grain.experimental.BestFitPackIterDataset(
        grain.MapDataset.source(elements).to_iter_dataset(), length_struct={"inputs": 20}, num_packing_bins=8,
        shuffle_bins=False))
    assert [sorted(np.unique(t["inputs"][t["inputs"] > 0]) - 1) for t in theirs] == \
        [sorted(e for e in best.row(r) if sizes[e]) for r in range(best.rows)]


def test_parquet_and_pretokenized_documents_give_the_same_rows(data, configs, tmp_path):
    root, docs = data
    ec, mt = configs
    from_records = source_for(ec, mt)
    from_parquet = source_for(ec, Over(mt, grain_file_type="parquet", grain_train_files=str(root / "*.parquet")))
    assert from_parquet.index.rows == from_records.index.rows
    for s, m in ((0, 0), (2, 1), (9, 0)):
        a, b = from_records.batch(s, m), from_parquet.batch(s, m)
        assert all(np.array_equal(a[k], b[k]) for k in KEYS)
    files = [str(root / "docs.parquet")]
    theirs = maxtext_batches(Over(mt, grain_file_type="parquet", enable_data_shuffling=False, packing=False), files, 2)
    ours = rows_of(source_for(ec, Over(mt, grain_file_type="parquet", grain_train_files=files[0],
                                       enable_data_shuffling=False, packing=False)), 8)
    np.testing.assert_array_equal(ours["inputs"], np.concatenate([t["inputs"] for t in theirs]))
    # Pre-tokenized (tokenize_train_data=false): MaxText's tokens stored as int64 features.
    tokens = [t.tolist() for t in maxtext_tokens(mt, docs)]
    write_arrayrecord(tmp_path / "ids.array_record", docs, tokens=tokens)
    ids = source_for(ec, Over(mt, tokenize_train_data=False, grain_train_files=str(tmp_path / "ids.array_record")))
    for s, m in ((0, 0), (3, 1)):
        a, b = from_records.batch(s, m), ids.batch(s, m)
        assert all(np.array_equal(a[k], b[k]) for k in KEYS)
    # Pre-tokenized documents are not truncated: longer than a row, MaxText's packer refuses them (so does this).
    full = [t.tolist() for t in maxtext_tokens(mt, docs, trim=False)]
    write_arrayrecord(tmp_path / "long.array_record", docs, tokens=full)
    msg = refusal(ec, mt, tokenize_train_data=False, grain_train_files=str(tmp_path / "long.array_record"))
    assert re.search(r"'packing' \(true\): document \d+ has \d+ tokens, more than max_target_length", msg), msg
    ids = source_for(ec, Over(mt, tokenize_train_data=False, grain_train_files=str(tmp_path / "long.array_record"),
                              packing=False))   # padded rows are trimmed
    assert ids.index.element_length.max() == LENGTH


def test_hf_parquet_uses_maxtexts_hugging_face_tokenization(data, configs):
    import transformers

    root, docs = data
    ec, mt = configs
    source = source_for(ec, Over(mt, dataset_type="hf", hf_path="parquet", hf_train_files=str(root / "*.parquet"),
                                 tokenizer_path=str(QWEN3), vocab_size=151936, packing=False,
                                 enable_data_shuffling=False))
    tok = transformers.AutoTokenizer.from_pretrained(str(QWEN3), add_bos_token=True, add_eos_token=True, legacy=False,
                                                     extra_special_tokens={})
    rows = rows_of(source, 8)
    for d in range(8):
        want = tok(docs[d], truncation=True, max_length=LENGTH)["input_ids"]
        np.testing.assert_array_equal(rows["inputs"][d, :len(want)], want)
        assert (rows["inputs_segmentation"][d, len(want):] != 1).all()


def refusal(ec, mt, split="train", **keys) -> str:
    with pytest.raises(elastic.ConfigError) as e:
        source_for(ec, Over(mt, **keys), split=split)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_refusals_are_one_line_naming_the_key(data, configs):
    root, _ = data
    ec, mt = configs
    pattern = str(root / "*.array_record")
    cases = {
        "'dataset_type'": dict(dataset_type="tfds"),
        "'grain_file_type'": dict(grain_file_type="tfrecord"),
        "'grain_train_files' (": dict(grain_train_files=f"{pattern},0.5;{pattern},0.5"),
        "'grain_train_mixture_config_path'": dict(grain_train_mixture_config_path=str(root / "mix.json")),
        "only local files and gs:// objects": dict(grain_train_files="hf://datasets/org/data/*.parquet"),
        "matches no file": dict(grain_train_files=str(root / "*.nothing")),
        "'vocab_size' (128)": dict(vocab_size=128),
        "'hf_path' is 'json'": dict(dataset_type="hf", hf_path="json", hf_train_files=pattern),
        "'grain_packing_type'": dict(grain_packing_type="concat_then_split"),
        "'use_dpo'": dict(use_dpo=True),
        "'use_sft'": dict(use_sft=True),
        "'train_data_columns'": dict(train_data_columns=["text", "id"]),
        "tokenize_train_data=false": dict(tokenize_train_data=False),
        "'tokenizer_path' is empty": dict(tokenizer_path=""),
    }
    for key, keys in cases.items():
        assert key in refusal(ec, mt, **keys), key
    # MaxText stops after num_epoch epochs (default 1); a run that needs more rows is refused before it starts.
    msg = refusal(dataclasses.replace(ec, steps=1000), mt, num_epoch=1)
    assert "'num_epoch' (1): 1000 steps of 8 rows need 8000 rows" in msg and "set num_epoch >= " in msg


def test_eval_sources_are_maxtexts_eval_data_one_unshuffled_pass_with_a_padded_last_step(data, configs):
    root, docs = data
    ec, mt = configs   # enable_data_shuffling: MaxText's default, true; its eval iterator never shuffles
    pattern = str(root / "*.array_record")
    assert source_for(ec, mt, split="eval") is None   # no grain_eval_files: no eval data
    source = pickle.loads(pickle.dumps(source_for(ec, Over(mt, grain_eval_files=pattern), split="eval")))
    plain = source_for(ec, Over(mt, enable_data_shuffling=False))   # the training rows, in file order
    per_step = ec.microbatches * ec.microbatch_size
    assert source.index.rows == plain.index.rows and source.steps == -(-source.index.rows // per_step)
    assert source.element_spec() == plain.element_spec()
    rows = rows_of(source, source.steps * per_step)
    n = source.index.rows
    assert n % per_step, "the test needs a short last step"
    want = rows_of(plain, n)
    for k in KEYS:
        np.testing.assert_array_equal(rows[k][:n], want[k], err_msg=k)
    # The short last step as MaxText's batch_and_pad fills it: the pad id everywhere, so no target counts.
    assert (rows["inputs"][n:] == -1).all() and (rows["inputs_segmentation"][n:] == -1).all()
    assert (rows["targets_segmentation"][n:] == 0).all()
    last = source.steps - 1
    assert all(np.array_equal(source.batch(last, m)[k], rows_of(source, source.steps * per_step)[k][
        (last * ec.microbatches + m) * 4:(last * ec.microbatches + m + 1) * 4]) for m in range(2) for k in KEYS)
    with pytest.raises(ValueError, match=f"no step {source.steps}: the eval data holds {source.steps} steps"):
        source.batch(source.steps, 0)
    # hf: hf_eval_files (MaxText reads them as the split 'train'), eval_data_columns, tokenize_eval_data.
    hf = dict(dataset_type="hf", hf_path="parquet", hf_train_files=str(root / "*.parquet"),
              tokenizer_path=str(QWEN3), vocab_size=151936)
    assert source_for(ec, Over(mt, **hf), split="eval") is None
    hf_eval = source_for(ec, Over(mt, **hf, hf_eval_files=str(root / "*.parquet"), hf_eval_split="validation"),
                         split="eval")
    hf_plain = source_for(ec, Over(mt, **hf, enable_data_shuffling=False))
    assert hf_eval.shuffle_seed is None and hf_eval.index.rows == hf_plain.index.rows
    np.testing.assert_array_equal(hf_eval.batch(0, 1)["inputs"], hf_plain.batch(0, 1)["inputs"])
    msg = refusal(ec, mt, grain_eval_files=pattern, eval_data_columns=["text", "id"], split="eval")
    assert "'eval_data_columns'" in msg
    assert "tokenize_eval_data=false" in refusal(ec, mt, grain_eval_files=pattern, tokenize_eval_data=False,
                                                  split="eval")
    assert "'eval_per_device_batch_size' (2)" in refusal(ec, mt, grain_eval_files=pattern,
                                                         eval_per_device_batch_size=2, split="eval")
    assert "'grain_eval_files' is empty" in refusal(ec, mt, grain_file_type="parquet", hf_path="org/data",
                                                    grain_train_files=str(root / "*.parquet"), split="eval")
    # Synthetic data: MaxText's eval iterator is its training iterator (the same batch), without an end.
    synthetic = source_for(ec, Over(mt, dataset_type="synthetic"), split="eval")
    assert synthetic.steps is None
    np.testing.assert_array_equal(synthetic.batch(3, 1)["inputs"],
                                  source_for(ec, Over(mt, dataset_type="synthetic")).batch(0, 1)["inputs"])
