"""Checkpoint I/O, below everything that trains, decodes or evaluates: the layout of a training
work dir and its checks, free of JAX (`layout.py`), and the Orbax checkpoints of a run and of an
export: the training manager, restores that skip unreadable steps, the work dir's lock, loading
params for evaluation and sampling, writing exports (`checkpoints.py`)."""
