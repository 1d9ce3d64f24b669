"""Storage: every path a user gives, local or gs://BUCKET/... File operations (`fs.py`), Cloud
Storage's clients (`gcs.py`), checks of user paths before anything is loaded (`paths.py`), the
exclusive lease of a training work dir (`lease.py`), the persistent compilation cache
(`compile_cache.py`) and a local Cloud Storage server for tests (`emulator.py`)."""
