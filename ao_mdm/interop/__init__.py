"""Weights of other code bases: the authors' PyTorch checkpoints (`torch_import.py`), a PyTorch
AO-GPT with their parameter names, the oracle of the tests (`torch_reference.py`), and Hugging
Face GPT-2 as the generative-perplexity scorer (`hf_gpt2.py`)."""
