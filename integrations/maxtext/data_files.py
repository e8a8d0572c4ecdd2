"""Where MaxText's data files are, for :mod:`integrations.maxtext.documents`: local paths or ``gs://`` objects.

* :meth:`DataFiles.glob` expands a config key's pattern as MaxText's
  ``find_data_files`` does: a local glob (sorted here; MaxText keeps
  ``glob``'s order), or for ``gs://bucket/pattern`` GCS's own glob
  (``list_blobs(match_glob=...)``, as MaxText's ``gcs_utils.gcs_glob_pattern``),
  in GCS's listing order (object names, lexicographic). Each file is a
  :class:`DataFile`: its path, size and version (a GCS object's generation,
  a local file's mtime in ns), fixed when the client lists it.
* :meth:`DataFiles.open` gives a seekable binary file. A GCS object is read
  by ranged requests of the generation listed (pyarrow reads a Parquet
  footer, then one row group's column chunk at a time), so an object
  replaced since is an error, never other bytes.
* :meth:`DataFiles.local` gives a path on this host. ArrayRecord's reader
  reads only local files, so a GCS object is fetched whole into a per-host
  cache directory (``<cache>/<bucket>/<object>.g<generation>``: a new
  generation is a new file), through a temporary file renamed into place
  once its size checks; a second process on the host, or a later run,
  reuses it.

Every request has a deadline (``timeout_s``); connection errors, timeouts,
429 and 5xx answers are retried (``attempts`` times in all, exponential
backoff, :mod:`tenacity`); anything else, or the last failure, is one
``elastic.ConfigError`` line naming the config key and the object.

The endpoint: ``endpoint`` if given, else ``$STORAGE_EMULATOR_HOST`` (what
google-cloud-storage and jax-elastic's checkpoints read; an emulator), with
anonymous credentials; else the real GCS with the default credentials.
:class:`DataFiles` pickles without its client (each process makes its own on
first use) and opens nothing until used.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import re
import tempfile
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import elastic
from runtime import GCS_ENDPOINT_ENV

__all__ = ["DataFile", "DataFiles", "default_cache_dir", "gcs_glob_regex"]

_T = TypeVar("_T")
_CLIENTS: dict[str, Any] = {}   # endpoint -> this process's storage client
_CLIENTS_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class DataFile:
    """One data file as the client listed it: ``path`` (absolute, or ``gs://bucket/object``), ``size`` in bytes,
    ``version`` (GCS generation, local mtime in ns)."""

    path: str
    size: int
    version: int

    @property
    def remote(self) -> bool:
        return self.path.startswith("gs://")

    @property
    def bucket_and_name(self) -> tuple[str, str]:
        bucket, _, name = self.path[len("gs://"):].partition("/")
        return bucket, name


def default_cache_dir() -> str:
    """This host's cache of fetched ArrayRecord shards: ``$XDG_CACHE_HOME/jax-elastic/gcs`` (else
    ``~/.cache/...``), resolved in the process that fetches."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax-elastic", "gcs")


class DataFiles:
    """The files of one config key (``key``, named in every error), local or on GCS (see the module docstring).

    Built in the client; pickles without its client. ``cache_dir``: where :meth:`local` keeps fetched objects
    (``None``: :func:`default_cache_dir` of the process that fetches).
    """

    def __init__(self, key: str, *, endpoint: str | None = None, cache_dir: str | None = None,
                 timeout_s: float = 60.0, attempts: int = 5):
        self.key = key
        endpoint = endpoint if endpoint is not None else os.environ.get(GCS_ENDPOINT_ENV, "")
        if endpoint and endpoint != "default" and "://" not in endpoint:
            endpoint = f"http://{endpoint}"
        self.endpoint = "" if endpoint == "default" else endpoint.rstrip("/")
        self.cache_dir = cache_dir
        self.timeout_s = float(timeout_s)
        self.attempts = int(attempts)

    # -- listing -----------------------------------------------------------------

    def glob(self, pattern: str) -> list[DataFile]:
        """The files ``pattern`` matches (see the module docstring); ConfigError naming the key if none."""
        if pattern.startswith("gs://"):
            files = self._gcs_glob(pattern)
        elif "://" in pattern:
            raise elastic.ConfigError(f"config key {self.key!r} ({pattern!r}): only local files and gs:// objects "
                                      "are read under jax-elastic (not the Hugging Face hub or other remote "
                                      "stores); copy them and set a local or gs:// glob")
        else:
            import glob

            files = []
            for path in sorted(glob.glob(str(pathlib.Path(pattern).expanduser().resolve()))):
                st = os.stat(path)
                files.append(DataFile(path, st.st_size, st.st_mtime_ns))
        if not files:
            raise elastic.ConfigError(f"config key {self.key!r} ({pattern!r}) matches no file")
        return files

    def _gcs_glob(self, pattern: str) -> list[DataFile]:
        bucket, _, glob = pattern[len("gs://"):].partition("/")
        if not bucket or not glob:
            raise elastic.ConfigError(f"config key {self.key!r} ({pattern!r}) is not gs://bucket/pattern")
        prefix = re.split(r"[*?\[{]", glob, maxsplit=1)[0]
        regex = gcs_glob_regex(glob)

        def listing():
            blobs = self._client().list_blobs(bucket, prefix=prefix or None, match_glob=glob,
                                              timeout=self.timeout_s, retry=None)
            return [(b.name, int(b.size), int(b.generation)) for b in blobs]

        found = self._call(listing, f"listing {pattern}")
        # GCS answers match_glob itself; the filter keeps the meaning where a server ignores it (an emulator).
        return [DataFile(f"gs://{bucket}/{name}", size, generation)
                for name, size, generation in sorted(found) if regex.fullmatch(name)]

    # -- reading -----------------------------------------------------------------

    def open(self, file: DataFile) -> BinaryIO:
        """A seekable binary file of ``file`` (a GCS object: ranged reads of its listed generation)."""
        if not file.remote:
            try:
                return open(file.path, "rb")
            except OSError as e:
                raise elastic.ConfigError(f"config key {self.key!r}: cannot read {file.path}: {e.strerror}") from e
        return io.BufferedReader(_RangedObject(self, file), buffer_size=256 * 1024)

    def read_range(self, file: DataFile, start: int, size: int) -> bytes:
        """``size`` bytes of the GCS object ``file`` from ``start`` (its listed generation), retried."""
        bucket, name = file.bucket_and_name

        def fetch():
            blob = self._client().bucket(bucket).blob(name, generation=file.version)
            return blob.download_as_bytes(start=start, end=start + size - 1, timeout=self.timeout_s, retry=None,
                                          checksum=None)

        data = self._call(fetch, f"reading {file.path} (generation {file.version})")
        if len(data) != size:
            raise elastic.ConfigError(f"config key {self.key!r}: reading {file.path} (generation {file.version}) "
                                      f"bytes {start}..{start + size - 1} gave {len(data)} bytes")
        return data

    def cached_path(self, file: DataFile) -> str:
        """Where :meth:`local` keeps the GCS object ``file`` on this host (fetched or not); a local file's path."""
        if not file.remote:
            return file.path
        bucket, name = file.bucket_and_name
        return str(pathlib.Path(self.cache_dir or default_cache_dir()) / bucket / f"{name}.g{file.version}")

    def local(self, file: DataFile) -> str:
        """A path of ``file`` on this host: the local file itself, or the GCS object fetched into the cache once
        (see the module docstring)."""
        if not file.remote:
            return file.path
        bucket, name = file.bucket_and_name
        target = pathlib.Path(self.cached_path(file))
        try:
            if target.stat().st_size == file.size:
                return str(target)
        except FileNotFoundError:
            pass
        target.parent.mkdir(parents=True, exist_ok=True)

        def fetch():
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
            os.close(fd)
            try:
                blob = self._client().bucket(bucket).blob(name, generation=file.version)
                blob.download_to_filename(tmp, timeout=self.timeout_s, retry=None)
                got = os.path.getsize(tmp)
                if got != file.size:
                    raise _Truncated(f"fetched {got} of {file.size} bytes")
                os.replace(tmp, target)   # atomic: readers see the whole object or none
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

        self._call(fetch, f"fetching {file.path} (generation {file.version}) to {target.parent}")
        return str(target)

    # -- the client and the retry policy -------------------------------------------

    def _client(self):
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(self.endpoint)
            if client is None:
                from google.cloud import storage

                if self.endpoint:
                    from google.auth.credentials import AnonymousCredentials

                    client = storage.Client(project="jax-elastic", credentials=AnonymousCredentials(),
                                            client_options={"api_endpoint": self.endpoint})
                else:
                    client = storage.Client()
                _CLIENTS[self.endpoint] = client
            return client

    def _call(self, fn: Callable[[], _T], what: str) -> _T:
        import tenacity

        try:
            for attempt in tenacity.Retrying(stop=tenacity.stop_after_attempt(self.attempts),
                                             wait=tenacity.wait_exponential(multiplier=0.25, max=4.0),
                                             retry=tenacity.retry_if_exception(_transient), reraise=True):
                with attempt:
                    return fn()
        except elastic.ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure of the storage client becomes one line naming the key
            tries = f" (after {self.attempts} attempt{'s' * (self.attempts > 1)})" if _transient(e) else ""
            raise elastic.ConfigError(f"config key {self.key!r}: {what}: {_reason(e, self.endpoint)}{tries}") from e
        raise AssertionError("unreachable")   # tenacity either returns or raises

    def __repr__(self) -> str:
        return f"DataFiles({self.key!r}, endpoint={self.endpoint or 'GCS'!r})"


class _Truncated(ConnectionError):
    """A fetch that ended short (the connection broke): transient."""


class _RangedObject(io.RawIOBase):
    """A GCS object as a seekable raw file: each read is one ranged request of the listed generation."""

    def __init__(self, files: DataFiles, file: DataFile):
        self._files, self._file, self._pos = files, file, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._file.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        size = min(len(buffer), self._file.size - self._pos)
        if size <= 0:
            return 0
        data = self._files.read_range(self._file, self._pos, size)
        buffer[:size] = data
        self._pos += size
        return size


def _transient(e: BaseException) -> bool:
    """A failure worth another attempt: the connection, a deadline, or the server's 408/429/5xx."""
    import requests
    from google.api_core import exceptions as api
    from google.auth import exceptions as auth

    return isinstance(e, (ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout,
                          requests.exceptions.ChunkedEncodingError, auth.TransportError,
                          api.TooManyRequests, api.ServerError))


def _reason(e: BaseException, endpoint: str = "") -> str:
    """What went wrong, in one line: a connection that failed says where it went and its innermost cause
    whole (``[Errno 111] Connection refused``, a name not resolved), not the client library's wrapping of it;
    other text is cut at a word, never inside one."""
    import requests
    from google.api_core import exceptions as api

    if isinstance(e, api.NotFound):
        return "not found (no such bucket, object or generation: missing, or changed since the client listed it)"
    if isinstance(e, api.Forbidden):
        return "access denied"
    if isinstance(e, (ConnectionError, requests.ConnectionError)):
        where = f"the storage endpoint {endpoint} (${GCS_ENDPOINT_ENV})" if endpoint else "GCS"
        return f"cannot reach {where}: {_innermost(e)}"
    return f"{type(e).__name__}: {_cut(' '.join(str(e).split()), 300)}"


def _innermost(e: BaseException) -> str:
    """The deepest cause of ``e``: urllib3's ``reason`` inside requests' error inside the storage client's, the
    ``__cause__`` chain, less the ``HTTPConnection(host=..., port=...): `` that urllib3 puts before it."""
    seen = {id(e)}
    while True:
        inner = getattr(e, "reason", None)
        if not isinstance(inner, BaseException):
            inner = next((a for a in e.args if isinstance(a, BaseException)), None) or e.__cause__
        if not isinstance(inner, BaseException) or id(inner) in seen:
            break
        seen.add(id(inner))
        e = inner
    text = " ".join(str(e).split())
    text = re.sub(r"^\w*Connection(?:Pool)?\(host=[^)]*\): ", "", text)
    return _cut(text or type(e).__name__, 300)


def _cut(text: str, limit: int) -> str:
    """``text`` as is when it fits in ``limit`` characters, else cut at the last space before it, marked."""
    if len(text) <= limit:
        return text
    head = text[:limit].rsplit(" ", 1)[0]
    return f"{head} ... ({len(text) - len(head)} more characters)"


def gcs_glob_regex(glob: str) -> re.Pattern:
    """GCS's ``match_glob`` syntax as a regex over object names: ``*`` and ``?`` stay within one ``/``-separated
    part, ``**`` crosses them (``**/`` also matches no directory), ``[...]`` and ``{a,b}`` as in GCS."""
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = glob.find("]", i + 2)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = glob[i + 1:end]
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = end
        elif c == "{":
            end = glob.find("}", i)
            if end < 0:
                out.append(re.escape(c))
            else:
                out.append("(?:" + "|".join(re.escape(p) for p in glob[i + 1:end].split(",")) + ")")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)
