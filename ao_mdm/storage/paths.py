"""Checks of the paths a user gives, run before JAX loads: the form of a gs:// URL (no local
directory named `gs:` is ever created), ~ expanded, outputs that may be created, inputs that can
be read. Each raises one FileNotFoundError / FileExistsError / ValueError naming the flag."""

import io
import json
import os
import re

from ao_mdm.storage import fs, gcs

_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # any URL but gs://
_MISSPELT = re.compile(r"^(gs|gcs|gcp|google)(:|//)", re.IGNORECASE)


def check(path: str, flag: str = "path") -> str:
  """The path with ~ expanded: gs://BUCKET/... or a local path. Misspelt URLs (gs:/b, gs:b,
  gcs://b, GS://b) and other schemes are refused."""
  path = os.path.expanduser(str(path))
  if fs.is_gcs(path):
    bucket = gcs.split(path)[0]
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
      raise ValueError(
        f"{flag} {path!r}: {bucket!r} is not a Cloud Storage bucket name (3-63 "
        "lowercase letters, digits, '-', '_' or '.'); expected gs://BUCKET/PATH"
      )
    return path.rstrip("/")
  if _URL.match(path) or _MISSPELT.match(path):
    raise ValueError(
      f"{flag} {path!r}: only local paths and gs://BUCKET/PATH are supported"
      + (" (did you mean gs://BUCKET/PATH?)" if _MISSPELT.match(path) else "")
    )
  return path


def new_output_dir(path: str, flag: str = "--out") -> None:
  """A directory to create: absent or empty, inside a writable directory."""
  path = check(path, flag)
  if fs.exists(path) and (not fs.isdir(path) or fs.listdir(path)):
    raise FileExistsError(f"{flag} {path!r} exists and is not an empty directory; give a new path")
  _writable_parent(path, flag)


def new_output_file(path: str, flag: str = "--out") -> None:
  """A file to create: absent (nothing is overwritten), inside a writable directory."""
  output_file(path, flag)
  if fs.exists(check(path, flag)):
    raise FileExistsError(f"{flag} {path!r} exists; give a new path (nothing is overwritten)")


def output_file(path: str, flag: str = "--out") -> None:
  """A file to (over)write: not a directory, inside a writable directory."""
  path = check(path, flag)
  if fs.is_bucket(path):
    raise ValueError(f"{flag} {path!r} is a bucket; give a file name in it")
  if fs.isdir(path):
    raise ValueError(f"{flag} {path!r} is a directory; give a file name")
  _writable_parent(path, flag)


def _writable_parent(path: str, flag: str) -> None:
  if fs.is_gcs(path):
    gcs.check_bucket(path)
    here = fs.parent(path)
    while not fs.is_bucket(here):
      if fs.isfile(here):  # a file where a directory must be
        raise ValueError(f"{flag} {path!r} cannot be written: {here!r} is a file")
      here = fs.parent(here)
    return
  here = _nearest_existing(os.path.dirname(os.path.abspath(path)))  # the rest is created
  if not os.path.isdir(here) or not os.access(here, os.W_OK | os.X_OK):
    raise ValueError(f"{flag} {path!r} cannot be written: {here!r} is not a writable directory")


def _nearest_existing(local_path: str) -> str:
  """The path itself or its nearest ancestor that exists."""
  while not os.path.exists(local_path):
    local_path = os.path.dirname(local_path)
  return local_path


def directory(path, flag: str) -> None:
  """A directory to use or create: not an existing file (on gs://, its bucket exists)."""
  if not path:
    return
  path = check(path, flag)
  if fs.is_gcs(path):
    gcs.check_bucket(path)
  if fs.isfile(path):
    raise ValueError(f"{flag} {path!r} is a file; give a directory")
  if fs.is_gcs(path):
    return
  here = _nearest_existing(os.path.dirname(os.path.abspath(path)))  # where it would be made
  if not os.path.isdir(here):
    raise ValueError(f"{flag} {path!r} cannot be made: {here!r} is a file")


def text_file(path: str, flag: str) -> None:
  """An existing, readable UTF-8 file."""
  path = check(path, flag)
  if not fs.is_gcs(path):
    if os.path.isdir(path):
      raise ValueError(f"{flag} {path!r} is a directory; give a text file")
    if os.path.exists(path) and not os.path.isfile(path):
      raise ValueError(
        f"{flag} {path!r} is not a regular file (a pipe or device?); give a text file"
      )
  if not fs.isfile(path):
    if fs.is_gcs(path) and fs.isdir(path):
      raise ValueError(f"{flag} {path!r} is a directory; give a text file")
    raise FileNotFoundError(f"{flag} {path!r}: no such file")
  try:
    with fs.open_text(path) as f:
      while f.read(1 << 20):
        pass
  except UnicodeDecodeError as e:
    raise ValueError(f"{flag} {path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
  except OSError as e:
    raise ValueError(f"{flag} {path!r} cannot be read ({e.strerror or e})") from None


def jsonl_records(path: str, what: str, numbered: bool = False) -> list:
  """The JSON objects of a JSON-lines file (blank lines skipped), as (line number, object) pairs
  with `numbered`; `what` names it in errors."""
  if not path or not fs.isfile(check(path, what)):
    raise FileNotFoundError(f"{what} {path!r}: no such file")
  records = []
  for number, line in enumerate(io.StringIO(fs.read_text(path)), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{what} {path} line {number} is not JSON ({e.msg})") from None
    if not isinstance(record, dict):
      raise ValueError(f"{what} {path} line {number} is not a JSON object")
    records.append((number, record) if numbered else record)
  if not records:
    raise ValueError(f"{what} {path} holds no records")
  return records
