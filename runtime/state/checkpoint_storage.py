"""Where checkpoints live (:mod:`runtime.state.checkpoint`): a directory on a local disk or GCS, and its entries.

- :func:`directory_problem` and :func:`checked_directory`: what a directory
  names (a local path, made absolute, or ``gs://bucket/path``) and, for GCS,
  the endpoint every client is pointed at (:func:`use_gcs_endpoint`,
  :data:`GCS_ENDPOINT_ENV`).
- orbax's commit protocol as a reader sees it: ``<step>`` holding
  :data:`COMMIT_FILE` is a complete checkpoint; ``<step>`` without it (GCS
  writes in place) and ``<step>.orbax-checkpoint-tmp...`` (a local disk
  writes under a temporary name, then renames) are not. :func:`entries` lists
  both kinds; :func:`discard` removes one, taking it out of the listing
  first, so an interrupted removal leaves a leftover, never a listed
  checkpoint with missing files.
- :func:`step_of`: the step a complete entry holds. jax-elastic's
  ``<step>`` holds the state after ``step`` applied steps, beside its record
  (``meta``). A directory MaxText's trainer wrote (``items``, no record) is
  named by the step whose update it holds, so ``<d>`` is the state after
  ``d + 1`` applied steps (MaxText's ``step`` leaf holds ``d + 1``; the
  reader checks it); :func:`foreign` tells them apart.

Writing and reading a checkpoint's contents is :mod:`runtime.state.checkpoint_orbax`'s.
Nothing here imports orbax or JAX (paths are ``etils.epath`` paths the caller
makes), so a controller can list checkpoints without them.
"""

from __future__ import annotations

import os
import re
import time

__all__ = ["COMMIT_FILE", "GCS_ENDPOINT_ENV", "RECORD_ITEM", "TMP_SUFFIX", "TREE_ITEM", "checked_directory",
           "directory_problem", "discard", "entries", "foreign", "forget_listings", "rmtree", "step_of",
           "use_gcs_endpoint"]

#: The environment variable naming a GCS endpoint (an emulator) when ``gcs_endpoint`` is not given;
#: google-cloud-storage and gcsfs read it too.
GCS_ENDPOINT_ENV = "STORAGE_EMULATOR_HOST"

#: A checkpoint's orbax items: jax-elastic's record, and the state as a named tree (MaxText's name for it).
RECORD_ITEM, TREE_ITEM = "meta", "items"
COMMIT_FILE = "commit_success.txt"           # the commit marker (orbax.checkpoint.path.atomicity.COMMIT_SUCCESS_FILE)
TMP_SUFFIX = ".orbax-checkpoint-tmp"         # orbax's temporary-name suffix (atomicity.TMP_DIR_SUFFIX)
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")


# -- the directory -------------------------------------------------------------


def directory_problem(directory: str) -> str:
    """Why ``directory`` cannot hold checkpoints ("" if it can): it is empty, or a gs:// URL without a valid
    bucket name. A pure check of the text (nothing is reached)."""
    if not directory:
        return "is empty"
    if directory.startswith("gs://") and not re.fullmatch(r"gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/.*)?", directory):
        return "is not gs://bucket/path with a valid bucket name (3-63 of a-z 0-9 . _ -)"
    return ""


def checked_directory(directory: str, gcs_endpoint: str | None) -> tuple[str, bool]:
    """``(directory, on_gcs)``: a local directory made absolute, or a ``gs://`` one as given, with every GCS
    client pointed at ``gcs_endpoint`` (else ``$STORAGE_EMULATOR_HOST``, else the real GCS; see
    :func:`use_gcs_endpoint`). Raises ``ValueError`` for a directory that cannot hold checkpoints, or a
    ``gcs_endpoint`` given with a local directory."""
    if problem := directory_problem(directory):
        raise ValueError(f"checkpoint directory {directory!r} {problem}")
    if directory.startswith("gs://"):
        endpoint = gcs_endpoint or os.environ.get(GCS_ENDPOINT_ENV, "")
        if endpoint and endpoint != "default":   # "default": the real GCS, as google-cloud-storage reads it
            use_gcs_endpoint(endpoint if "://" in endpoint else f"http://{endpoint}")
        return directory, True
    if gcs_endpoint:
        raise ValueError(f"gcs_endpoint is set but {directory!r} is not a gs:// directory")
    return os.path.abspath(os.path.expanduser(directory)), False


def use_gcs_endpoint(url: str) -> None:
    """Points every GCS client orbax uses at ``url`` (``http://host:port``, e.g. an emulator), process-wide.

    GCS access in orbax has no per-call endpoint: tensorstore reads
    ``TENSORSTORE_GCS_HTTP_URL`` when it opens a store, gcsfs and
    google-cloud-storage read ``STORAGE_EMULATOR_HOST`` on each request. Both
    are set here (children inherit them); tensorstore gets a fixed test
    token and gcsfs anonymous access, so neither looks for credentials (an
    emulator checks none), and gcsfs skips its zonal-bucket probe through
    the Storage Control API, which emulators do not serve.
    """
    if not re.fullmatch(r"https?://[^/\s]+/?", url):
        raise ValueError(f"gcs_endpoint must look like http://host:port, got {url!r}")
    url = url.rstrip("/")
    os.environ[GCS_ENDPOINT_ENV] = url
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec

    fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"
    # The zonal/HNS subclass is chosen when gcsfs is imported; whatever was imported, use the plain one.
    fsspec.register_implementation("gs", "gcsfs.core.GCSFileSystem", clobber=True)
    fsspec.register_implementation("gcs", "gcsfs.core.GCSFileSystem", clobber=True)


# -- its entries ---------------------------------------------------------------


def entries(directory) -> list:
    """``(path, complete)`` for each entry of ``directory`` that is a step (``<step>``: complete when it
    holds the commit file) or a temporary one (``<step>.orbax-checkpoint-tmp...``: never complete)."""
    forget_listings(directory)
    if not directory.exists():
        return []
    out = []
    for p in directory.iterdir():
        if _STEP_NAME.fullmatch(p.name):
            out.append((p, (p / COMMIT_FILE).exists()))
        elif TMP_SUFFIX in p.name and _STEP_NAME.fullmatch(p.name.split(".", 1)[0]):
            out.append((p, False))
    return out


def foreign(path) -> bool:
    """Whether the step directory ``path`` is one MaxText's trainer wrote: an ``items`` tree and no jax-elastic
    record beside it."""
    return not (path / RECORD_ITEM).exists() and (path / TREE_ITEM).exists()


def step_of(path) -> int:
    """The applied steps of the state the complete step directory ``path`` holds (see the module docstring)."""
    return int(path.name) + (1 if foreign(path) else 0)


def discard(directory, step: int, gcs: bool) -> None:
    """Removes the checkpoint of ``step`` (complete or not) from ``directory``, taking it out of
    :func:`entries`' complete ones first (GCS: its commit file goes first; local: a rename to a temporary
    name)."""
    path = directory / str(step)
    if not path.exists():
        return
    if gcs:
        marker = path / COMMIT_FILE
        if marker.exists():
            marker.unlink()
        rmtree(path)
    else:
        doomed = directory / f"{step}{TMP_SUFFIX}-removed-{os.getpid()}-{time.time_ns()}"
        os.rename(path, doomed)
        rmtree(doomed)


def rmtree(path) -> None:
    path.rmtree(missing_ok=True)
    if path.exists():   # gcsfs can leave a directory placeholder behind the first time (as orbax notes)
        path.rmtree(missing_ok=True)


def forget_listings(path) -> None:
    """gcsfs caches directory listings with no expiry; other processes write here, so list afresh."""
    fs = getattr(getattr(path, "_backend", None), "fs", None)   # etils.epath's fsspec backend (local paths: none)
    if fs is not None:
        fs(str(path)).invalidate_cache()
