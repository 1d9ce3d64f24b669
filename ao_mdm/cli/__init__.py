"""The `ao-mdm` command: parsing and dispatch (`main.py`), the flags (`options.py`), the input
checks (`checks.py`) and the benchmarks (`bench.py`, `bench_data.py`)."""
