"""`ao-mdm bench serve --config=configs/bench_serve.py --checkpoint=DIR`: a mix of prompt and
output lengths from 16 concurrent clients against the same requests one at a time; then prompts
behind one shared opening, without and with the server's prefix cache."""

import ml_collections

from ao_mdm.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.bench = ml_collections.ConfigDict()
  c.bench.requests = 64  # each run sends these, one at a time and then concurrently
  c.bench.clients = 16  # concurrent clients
  c.bench.max_batch = 16  # the server's rows (ao-mdm serve --max_batch)
  c.bench.prompt_words = (2, 12)  # a prompt's words, drawn uniformly (demo: T = 64 tokens)
  c.bench.max_tokens = (8, 24)  # a request's max_tokens, drawn uniformly
  c.bench.tokens_per_step = 1  # 1: exact L2R sampling
  c.bench.duration_s = 0  # > 0: repeat the concurrent load this long, the server's memory kept
  # Then the same clients with one opening before every prompt, without and with --prefix_cache.
  c.bench.shared_prefix = ml_collections.ConfigDict()
  c.bench.shared_prefix.words = 24  # the opening's words (0: skip; demo: about 40 of 64 tokens)
  c.bench.shared_prefix.tail_words = (1, 3)  # each prompt's own words after it
  c.bench.shared_prefix.max_tokens = (4, 8)
  c.bench.shared_prefix.cache = 64  # --prefix_cache of the second server
  return c
