"""Decoding: what the decoders share (`common.py`), the three modes (`parallel.py`,
`speculative.py` with its learned `draft.py` head, `confidence.py`), their options (`options.py`)
and `generate.py`, texts from a checkpoint in any mode."""
