"""Cloud Storage for storage/fs.py: one google-cloud-storage client, bounded retries, errors as
one clear line, and the environment that points every client (tensorstore, gcsfs, Orbax through
etils.epath) at STORAGE_EMULATOR_HOST when it is set."""

from collections.abc import Iterator
import contextlib
import functools
import json
import os
import sys
import time

GCS = "gs://"
EMULATOR = "STORAGE_EMULATOR_HOST"
TIMEOUT_ENV = "AO_MDM_STORAGE_TIMEOUT"  # seconds a Cloud Storage call may retry before failing
DEFAULT_TIMEOUT_S = 60


class VersionMismatch(FileExistsError):
  """A conditional write found another version of the object (or one already there)."""


def split(path: str) -> tuple[str, str]:
  """gs://BUCKET/KEY -> (BUCKET, KEY)."""
  bucket, _, key = path[len(GCS) :].partition("/")
  return bucket, key.strip("/")


def timeout_s() -> float:
  """The bound on waiting for an unanswering Cloud Storage: --storage_timeout."""
  return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)


_OUTAGE: list = [None]  # time.monotonic() when calls began to go unanswered; None: answering


def wait_s() -> float:
  """What the next call may wait: timeout_s() in all over one outage, however many calls (a
  check, then a listing, then a read) it spans; any answer starts the clock again."""
  since = _OUTAGE[0]
  left = timeout_s() if since is None else timeout_s() - (time.monotonic() - since)
  return max(left, 0.5)


def unanswered(since: float) -> None:
  """Notes that a call begun at `since` got no answer (the outage began then at the latest)."""
  if _OUTAGE[0] is None or since < _OUTAGE[0]:
    _OUTAGE[0] = since


def configure() -> None:
  """Points every Cloud Storage client at STORAGE_EMULATOR_HOST when it is set (tensorstore,
  gcsfs and google-cloud-storage, anonymously), makes etils.epath (Orbax's paths) use gcsfs, not
  TensorFlow's client, which cannot be pointed anywhere but Google, and turns gcsfs's listing
  cache off (objects this layer writes or deletes would not show in it). Before the first use."""
  os.environ.setdefault("EPATH_USE_TF", "false")
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
  gcsfs_options: dict[str, bool | str] = {"use_listings_cache": False}
  host = os.environ.get(EMULATOR)
  if host:
    host = host if "://" in host else f"http://{host}"
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    gcsfs_options["token"] = "anon"
  for key, value in gcsfs_options.items():  # read by fsspec when it is imported, so also:
    os.environ.setdefault(f"FSSPEC_GCS_{key.upper()}", json.dumps(value).strip('"'))
  fsspec = sys.modules.get("fsspec")
  if fsspec is not None:
    fsspec.config.conf.setdefault("gcs", {}).update(gcsfs_options)


@functools.cache
def start_tensorstore() -> None:
  """Makes tensorstore set up its Cloud Storage credentials now: against an emulator it says so
  on stderr once per process, which a caller that silences stderr around this keeps quiet."""
  configure()
  import tensorstore as ts

  start = time.monotonic()
  try:
    store = ts.KvStore.open({"driver": "gcs", "bucket": "ao-mdm-start"}).result()
    store.read("start").result(timeout=wait_s())
  except TimeoutError:
    unanswered(start)
  except Exception:  # the bucket need not exist
    pass


@functools.cache
def client():
  """The process's google-cloud-storage client (anonymous against an emulator)."""
  configure()
  from google.auth import exceptions as auth_exceptions
  from google.cloud import storage

  if os.environ.get(EMULATOR):
    from google.auth.credentials import AnonymousCredentials

    return storage.Client(project="emulator", credentials=AnonymousCredentials())
  try:
    return storage.Client()
  except auth_exceptions.DefaultCredentialsError:
    raise PermissionError(
      "no Google Cloud credentials for gs:// paths: on a TPU VM the VM's "
      "service account provides them; elsewhere run `gcloud auth "
      "application-default login`, or set STORAGE_EMULATOR_HOST for a local "
      "server"
    ) from None


def retry():
  """Retries of transient errors, for what is left of timeout_s() (wait_s)."""
  from google.api_core import retry as retry_lib

  return retry_lib.Retry(deadline=wait_s(), initial=0.2, maximum=8.0)


def no_answer(path: str) -> TimeoutError:
  where = os.environ.get(EMULATOR) or "storage.googleapis.com"
  return TimeoutError(
    f"{path}: no answer from Cloud Storage ({where}) within {timeout_s():.0f} "
    f"s; set {TIMEOUT_ENV}=SECONDS to wait longer"
  )


class Stuck(TimeoutError):
  """Storage stopped answering while a call that cannot be stopped (Orbax's) still waits on it:
  the command ends the process at once (`exit_now`), not waiting for that call."""

  exit_now = True


def missing_bucket(path: str) -> FileNotFoundError:
  bucket = split(path)[0]
  return FileNotFoundError(
    f"bucket gs://{bucket} does not exist ({path}); create it with "
    f"`gcloud storage buckets create gs://{bucket}`"
  )


@contextlib.contextmanager
def errors(path: str) -> Iterator[None]:
  """Cloud Storage errors as one OSError naming the path; no answer within what is left of the
  bound (wait_s) is a TimeoutError, and an answer of any kind ends the outage."""
  from google.api_core import exceptions
  import requests

  start = time.monotonic()
  try:
    yield
  except (
    exceptions.RetryError,
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    exceptions.ServiceUnavailable,
  ):
    unanswered(start)
    raise no_answer(path) from None
  except exceptions.NotFound as e:
    _OUTAGE[0] = None
    if "bucket" in str(e).lower() and "object" not in str(e).lower():
      raise missing_bucket(path) from None
    raise FileNotFoundError(f"{path}: no such object") from None
  except exceptions.PreconditionFailed:
    _OUTAGE[0] = None
    raise VersionMismatch(f"{path} was changed by another writer") from None
  except exceptions.Forbidden as e:
    _OUTAGE[0] = None
    raise PermissionError(f"{path}: no permission ({str(e).splitlines()[0][:200]})") from None
  _OUTAGE[0] = None


def blob(path: str):
  bucket, key = split(path)
  return client().bucket(bucket).blob(key)


def check_bucket(path: str) -> None:
  """Refuses a gs:// path whose bucket is missing or does not answer (within timeout_s)."""
  with errors(path):
    if not client().bucket(split(path)[0]).exists(timeout=wait_s(), retry=retry()):
      raise missing_bucket(path)


def listing(path: str, recursive: bool, limit: int | None = None) -> tuple[list, list]:
  """(objects, sub-prefixes) under the prefix path/."""
  bucket, key = split(path)
  with errors(path):
    pages = client().list_blobs(
      bucket,
      prefix=f"{key}/" if key else "",
      delimiter=None if recursive else "/",
      max_results=limit,
      timeout=wait_s(),
      retry=retry(),
    )
    blobs = list(pages)
    return blobs, sorted(pages.prefixes)
