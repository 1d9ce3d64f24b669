"""Training: the jitted step (`step.py`), the train state and optimizer (`state.py`), the loop
(`loop.py`), checkpoints (`checkpoints.py`), the work dir's layout (`workdir.py`) and ahead-of-time
compiles for TPU topologies (`aot.py`)."""
