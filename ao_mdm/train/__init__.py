"""Training: the jitted step (`step.py`), the train state and optimizer (`state.py`), the loop
(`loop.py`), its metrics and TensorBoard records (`records.py`), and the draft head's training
(`draft.py`)."""
