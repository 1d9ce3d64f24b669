"""Data: the embedded SOTU corpus, tokenizers, TFDS builders and the grain input pipeline."""
