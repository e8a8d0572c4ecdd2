"""Small real text datasets for the MaxText data tests: ArrayRecord files of ``tf.train.Example`` records and
Parquet files, as MaxText's grain pipeline reads them (nothing downloads)."""

import pathlib

import numpy as np

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def documents(n=40, seed=0) -> list[str]:
    """``n`` texts of about 6 to 20 tokens, every 7th of 25 to 60 (longer than LENGTH: truncated or chunked)."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(10, 25)) if i % 7 == 3 else int(rng.integers(0, 6)) for i in range(n)]
    return [" ".join(rng.choice(WORDS, size=size)) + f" document {i}." for i, size in enumerate(sizes)]


def write_arrayrecord(path: pathlib.Path, docs, *, tokens=None) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter
    from maxtext.input_pipeline.protos import example_pb2

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for i, doc in enumerate(docs):
        example = example_pb2.Example()
        if tokens is None:
            example.features.feature["text"].bytes_list.value.append(doc.encode())
        else:
            example.features.feature["text"].int64_list.value.extend(tokens[i])
        writer.write(example.SerializeToString())
    writer.close()


def write_parquet(path: pathlib.Path, docs, *, row_group_size=7, column="text") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: docs, "id": list(range(len(docs)))}), str(path), row_group_size=row_group_size)


def upload(endpoint: str, bucket: str, files: dict[str, pathlib.Path]) -> None:
    """Uploads local files to ``gs://bucket/<name>`` on the GCS protocol server at ``endpoint`` (an emulator)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="test", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": endpoint})
    for name, path in files.items():
        client.bucket(bucket).blob(name).upload_from_filename(str(path))
