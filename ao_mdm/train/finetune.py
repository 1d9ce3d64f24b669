"""Fine-tuning on prompt/response pairs (config data.pairs; docs/posttraining.md): the run's
tokenizer (its init's), its rows and its validation. The step is train/step.py's (the loss on
response slots only) and the loop train/loop.py's: checkpoints, resume, signals, metrics, mesh."""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ao_mdm import specs
from ao_mdm.data import pairs
from ao_mdm.data import tokenizer as tok_lib
from ao_mdm.eval import perplexity, responses
from ao_mdm.storage import fs


def run_tokenizer(config: specs.Spec, workdir: str, init_from: str | None) -> Any:
  """The tokenizer of the work dir, copied there first from --init_from (a SentencePiece one is
  the model's own: fine-tuning never trains one)."""
  from jax.experimental import multihost_utils

  if config.data.tokenizer != "sentencepiece":
    return tok_lib.run_tokenizer(config, workdir)
  v = config.model.vocab_size
  directory = fs.join(workdir, "tokenizer")
  have = fs.isdir(directory) and any(n.endswith(f"_{v}.model") for n in fs.listdir(directory))
  # Process 0's answer for all: another may look after process 0 has copied it.
  if not multihost_utils.broadcast_one_to_all(np.bool_(have)):
    if not init_from:
      raise ValueError(
        "data.pairs fine-tunes a trained model: give --init_from=RUN_OR_EXPORT (its params "
        "and its tokenizer are used)"
      )
    source = tok_lib.load_saved_tokenizer(config.data, v, init_from)
    assert isinstance(source, tok_lib.SentencePieceTokenizer)
    if jax.process_index() == 0:
      fs.copy(source.model_path, fs.join(directory, fs.basename(source.model_path)))
    multihost_utils.sync_global_devices("tokenizer copied")
  tokenizer = tok_lib.load_saved_tokenizer(config.data, v, workdir)
  tok_lib.check_vocab(tokenizer, v)
  return tokenizer


SPLITS = ("train", "validation")


class PairData:
  """A fine-tuning run's rows: `train` (the batches' source) and the first train.eval_batches x
  train.batch_size rows of each split for validation."""

  def __init__(
    self, config: specs.Spec, workdir: str, init_from: str | None, say: Callable[[str], None]
  ):
    self.tokenizer = tokenizer = run_tokenizer(config, workdir, init_from)
    t, source = config.model.block_size, config.data.pairs
    train, validation = pairs.narrowed(
      *(pairs.rows_for(source, s, tokenizer, t, say).array for s in SPLITS)
    )
    self.train = pairs.Rows(train, "data.pairs train")
    n = config.train.eval_batches * config.train.batch_size
    self.eval_rows = {"train": train[:n], "validation": validation[:n]}
    self.order = config.order
    self.counts = np.bincount(_response_tokens(self.train.array), minlength=config.model.vocab_size)

  def evaluate(self, scorer: Any, splits: tuple, *, seed: int, batch_size: int) -> dict:
    """Per split the mean NLL per response token, the response left to right and at random
    after its prompt, and under the training responses' unigram distribution."""
    out = {}
    for split in splits:
      rows = self.eval_rows[split]
      nll = {
        kind: responses.response_nll(
          scorer,
          rows,
          self.order.replace(kind=kind, ramp_steps=0),
          seed=seed,
          batch_size=batch_size,
        )
        for kind in ("l2r", "random")
      }
      out[split] = {**nll, "unigram": perplexity.unigram_nll(self.counts, _response_tokens(rows))}
    return out


def _response_tokens(rows_NX: np.ndarray) -> np.ndarray:
  """The response tokens (EOS included) of every row, in one flat array."""
  tokens, prompt, length = pairs.split_rows(rows_NX)
  t = np.arange(tokens.shape[1])
  return tokens[(t >= prompt[:, None]) & (t < length[:, None])]
