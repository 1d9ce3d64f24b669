"""Storage: every path a user gives, local or gs://BUCKET/... File operations (`fs.py`), Cloud
Storage's clients (`gcs.py`), checks of user paths before anything is loaded (`paths.py`) and the
exclusive lease of a training work dir (`lease.py`)."""
