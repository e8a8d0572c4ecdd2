"""The MaxText packing index: built (every document read and tokenized) against loaded from the client's cache.

Writes ``--documents`` texts of 50-150 words into 4 ArrayRecord files and 4
Parquet files (row groups of 1,000) in a temporary directory, then for each
format times ``source_for`` on a ``tiny.yml`` config (llama2's sentencepiece
tokenizer as MaxText ships it, ``max_target_length`` 512, packed, shuffled)
twice with the same ``base_output_directory``: cold (no cache: the index is
built and stored, the baseline) and warm (the index and the files' layout
loaded from ``<base_output_directory>/.data_index``); both include listing
the files and loading the tokenizer. The last line is the warm build's time against the
cold one's, for ArrayRecord.

Usage: .venv/bin/python benchmarks/index_cache.py [--documents 100000]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def write(root: pathlib.Path, docs: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter
    from maxtext.input_pipeline.protos import example_pb2

    for k in range(4):
        part = docs[k::4]
        writer = ArrayRecordWriter(str(root / f"part-{k}.array_record"), "group_size:1")
        for doc in part:
            example = example_pb2.Example()
            example.features.feature["text"].bytes_list.value.append(doc.encode())
            writer.write(example.SerializeToString())
        writer.close()
        pq.write_table(pa.table({"text": part}), str(root / f"part-{k}.parquet"), row_group_size=1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from integrations.maxtext import load_maxtext_config
    from integrations.maxtext.text_data import source_for

    import maxtext

    llama2 = pathlib.Path(maxtext.__file__).parent / "assets" / "tokenizers" / "tokenizer.llama2"
    with tempfile.TemporaryDirectory(prefix="index-cache-") as tmp:
        root = pathlib.Path(tmp)
        rng = np.random.default_rng(0)
        write(root, [" ".join(rng.choice(WORDS, size=int(rng.integers(50, 150)))) for _ in range(args.documents)])
        ratios = {}
        for kind in ("arrayrecord", "parquet"):
            suffix = "array_record" if kind == "arrayrecord" else "parquet"
            ec, mt = load_maxtext_config(ROOT / "integrations" / "maxtext" / "configs" / "tiny.yml", [
                f"base_output_directory={root / kind}", "dataset_type=grain", f"grain_file_type={kind}",
                f"grain_train_files={root}/*.{suffix}", f"tokenizer_path={llama2}", "vocab_size=32000",
                "max_target_length=512", "per_device_batch_size=4", "elastic_microbatches=2", "steps=3"])
            times = []
            for _ in range(2):
                start = time.perf_counter()
                source = source_for(ec, mt)
                times.append(time.perf_counter() - start)
            ratios[kind] = times[1] / times[0]
            print(f"{kind}: {args.documents} documents, {source.index.rows} rows: built {times[0]:.2f} s, "
                  f"from the cache {times[1] * 1000:.1f} ms ({ratios[kind]:.4f} x built)", flush=True)
        print(f"index from the cache: {ratios['arrayrecord']:.4f} x building it (ArrayRecord)")


if __name__ == "__main__":
    main()
