"""Every path a user gives: checks of outputs to create and of text files to read, free of JAX,
so a bad path fails before anything is loaded. Each raises one FileNotFoundError /
FileExistsError / ValueError naming the flag and the path."""
import json
import os


def new_output_dir(path: str, flag: str = "--out") -> None:
  """A directory to create: absent or empty, inside a writable directory."""
  if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
    raise FileExistsError(f"{flag} {path!r} exists and is not an empty directory; give a new path")
  _writable_parent(path, flag)


def new_output_file(path: str, flag: str = "--out") -> None:
  """A file to create: absent (nothing is overwritten), inside a writable directory."""
  output_file(path, flag)
  if os.path.lexists(path):
    raise FileExistsError(f"{flag} {path!r} exists; give a new path (nothing is overwritten)")


def output_file(path: str, flag: str = "--out") -> None:
  """A file to (over)write: not a directory, inside a writable directory."""
  if os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is a directory; give a file name")
  _writable_parent(path, flag)


def _writable_parent(path: str, flag: str) -> None:
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):  # missing directories are created
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(f"{flag} {path!r} cannot be written: {parent!r} is not a writable directory")


def directory_flag(path, flag: str) -> None:
  """A directory to use or create: not an existing file."""
  if path and os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is a file; give a directory")


def text_file(path: str, flag: str) -> None:
  """An existing, readable UTF-8 file."""
  if os.path.isdir(path):
    raise ValueError(f"{flag} {path!r} is a directory; give a text file")
  if os.path.exists(path) and not os.path.isfile(path):
    raise ValueError(f"{flag} {path!r} is not a regular file (a pipe or device?); give a text file")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{flag} {path!r}: no such file")
  try:
    with open(path, encoding="utf-8") as f:
      while f.read(1 << 20):
        pass
  except UnicodeDecodeError as e:
    raise ValueError(f"{flag} {path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
  except OSError as e:
    raise ValueError(f"{flag} {path!r} cannot be read ({e.strerror})") from None


def jsonl_records(path: str, what: str) -> list[dict]:
  """The JSON objects of a JSON-lines file (blank lines skipped); `what` names it in errors."""
  if not path or not os.path.isfile(path):
    raise FileNotFoundError(f"{what} {path!r}: no such file")
  records = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} line {number} is not JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise ValueError(f"{what} {path} line {number} is not a JSON object")
      records.append(record)
  if not records:
    raise ValueError(f"{what} {path} holds no records")
  return records
