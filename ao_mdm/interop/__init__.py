"""Weights of other code bases: the authors' PyTorch checkpoints in and out (`torch_import.py`,
`torch_export.py`, both through their state-dict layout, `torch_layout.py`), a PyTorch AO-GPT
with their parameter names, the oracle of the tests (`torch_reference.py`), and Hugging Face
GPT-2 as the generative-perplexity scorer (`hf_gpt2.py`)."""
