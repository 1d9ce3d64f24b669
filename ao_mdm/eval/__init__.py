"""Evaluation: the scorer of per-slot NLLs on a mesh (`scoring.py`), L2R, any-order, ensemble and
generative perplexities (`perplexity.py`), the datasets and samples they score (`sets.py`), and
the GPT-2 scorer of generated samples (`gpt2_scorer.py`)."""
