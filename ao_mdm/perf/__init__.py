"""Measurement, above everything it measures: ahead-of-time compiles for TPU topologies
(`aot.py`), the HLO traffic reader (`hlo.py`), roofline models of the train step and the
decoders (`roofline.py`), and the benchmarks of `ao-mdm bench` (`bench_sample.py`,
`bench_train.py`, `bench_data.py`, `bench_restart.py`)."""
