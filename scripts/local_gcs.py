"""Runs a local Cloud Storage server (fake-gcs-server, objects in memory) with a bucket, until
Ctrl-C: `python scripts/local_gcs.py [--port=4443] [--bucket=bucket]`, then in another shell
`export STORAGE_EMULATOR_HOST=...` (the line it prints) and use gs://bucket/... paths.
Needs the [test] extra (pip install -e '.[test]')."""

import argparse
import time

from ao_mdm.storage import emulator


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--port", type=int, default=0, help="0: any free port")
  p.add_argument("--bucket", action="append", help="bucket to create (repeatable)")
  args = p.parse_args()
  server = emulator.LocalServer(tuple(args.bucket or ["bucket"]), port=args.port)
  print(f"export STORAGE_EMULATOR_HOST={server.url}", flush=True)
  print(
    f"buckets: {', '.join(args.bucket or ['bucket'])}; Ctrl-C stops it (the objects go)", flush=True
  )
  try:
    while True:
      time.sleep(3600)
  except KeyboardInterrupt:
    pass
  finally:
    server.stop()


if __name__ == "__main__":
  main()
