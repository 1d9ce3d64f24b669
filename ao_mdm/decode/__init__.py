"""Decoding: the model's decode interface (`engine.py`), what the decoders share (`common.py`,
with the draw's Gumbel noise in `noise.py` and the step schedules in `schedules.py`), the decode
state and policy protocol with the static loop (`protocol.py`), the policies by name
(`policies.py`: `parallel.py`, `speculative.py` with its learned `draft.py` head,
`confidence.py`, `margin.py`), continuous batching of any policy (`batching.py`), the options'
checks (`options.py`), prompts and generated text (`text.py`) and `generate.py`, texts in any
policy."""
