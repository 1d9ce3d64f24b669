"""Evaluation: L2R, any-order, ensemble and generative perplexities (`perplexity.py`) and the
GPT-2 scorer of generated samples (`gpt2_scorer.py`)."""
