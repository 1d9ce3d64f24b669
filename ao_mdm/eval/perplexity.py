"""Perplexities (L2R, any-order, context-order ensemble) and generative perplexity
(docs/design.md, "Orders and evaluation").

All NLLs are in nats per token; a perplexity is exp(mean NLL) over every scored token.
"""
import functools
import math
import time
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm import orders as orders_lib
from ao_mdm import sharding
from ao_mdm.decode import common
from ao_mdm.storage import fs
from ao_mdm.storage import paths
from ao_mdm.train import checkpoints

ENSEMBLE_BUCKETS = 8  # slot-count buckets for the truncated ensemble forwards


class Scorer:
  """Jitted per-slot NLLs of a model on a mesh: params replicated or sharded by the rules.

  `ao-mdm eval` and the validation during training both score through this class, in `dtype`
  (float32 by default, as the authors evaluate, whatever the model trains in).
  """

  def __init__(self, params: Any, cfg: ml_collections.ConfigDict, mesh_cfg=None,
               dtype: str = "float32"):
    self.cfg = ml_collections.ConfigDict({**cfg.to_dict(), "dtype": dtype})
    self.model = model_lib.make_model(self.cfg)
    self.mesh, self.rules, self._param_shardings = placement(cfg, mesh_cfg)
    self.dp = sharding.data_parallel_size(self.mesh, self.rules)
    self.set_params(params)

  def set_params(self, params: Any) -> None:
    """Score with `params` from now on (no recompilation; already-placed params stay put)."""
    self.params = jax.device_put(params, self._param_shardings)

  @functools.cached_property
  def _nll(self) -> Callable:
    # Replicated output: every process of a multi-host run reads all the NLLs.
    return jax.jit(functools.partial(model_lib.slot_nll, self.model),
                   out_shardings=sharding.replicated(self.mesh))

  @property
  def vocab_size(self) -> int:
    return int(self.cfg.vocab_size)

  @property
  def block_size(self) -> int:
    return int(self.cfg.block_size)

  def token_nll(self, ids_BT: np.ndarray) -> np.ndarray:
    """[B, T-1] L2R NLL of tokens 1..T-1 (the generative-perplexity interface)."""
    return l2r_nll(self, ids_BT)[:, 1:]

  def slot_nll(self, tokens_BT: np.ndarray, order_Bt: np.ndarray) -> np.ndarray:
    """[B, t] NLL of slot s (target order[s]) given the tokens at order[:s]; t <= T slots.

    Every process passes the same whole batch; each places its own part on the mesh.
    """
    b = len(tokens_BT)
    pad = -b % self.dp  # the batch is split over the data axes: pad it to a multiple
    if pad:
      tokens_BT = np.concatenate([tokens_BT, np.repeat(tokens_BT[:1], pad, 0)])
      order_Bt = np.concatenate([order_Bt, np.repeat(order_Bt[:1], pad, 0)])
    batch = sharding.batch_sharding(self.mesh, self.rules)
    place = lambda x: jax.make_array_from_callback(
        x.shape, batch, lambda index: x[index])
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      out = self._nll(self.params, place(np.asarray(tokens_BT, np.int32)),
                      place(np.asarray(order_Bt, np.int32)))
    return np.asarray(jax.device_get(out), np.float64)[:b]


_PLACEMENTS: dict = {}  # (model config, mesh config) as JSON -> placement(...)


def placement(cfg: ml_collections.ConfigDict, mesh_cfg=None) -> tuple:
  """(mesh, axis rules, param shardings) of a Scorer of model `cfg` on `mesh_cfg`, built once
  per pair in a process: loading a checkpoint into place and the Scorer share them."""
  mesh_cfg = mesh_cfg or _single_mesh_config()
  key = (cfg.to_json(), mesh_cfg.to_json())
  if key not in _PLACEMENTS:
    mesh, rules = sharding.make_mesh(mesh_cfg), sharding.rules(mesh_cfg)
    boxed = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
    _PLACEMENTS[key] = mesh, rules, sharding.logical_shardings(boxed, mesh, rules)
  return _PLACEMENTS[key]


def param_shardings(cfg: ml_collections.ConfigDict, mesh_cfg=None) -> Any:
  """Where a Scorer on `mesh_cfg` keeps the params (a checkpoint is restored straight there)."""
  return placement(cfg, mesh_cfg)[2]


def _single_mesh_config() -> ml_collections.ConfigDict:
  from ao_mdm.config import base_config  # pylint: disable=g-import-not-at-top
  return base_config().mesh


def l2r_nll(scorer: Scorer, tokens_BT: np.ndarray) -> np.ndarray:
  """[B, T] NLL of each token under the identity order."""
  b, t = tokens_BT.shape
  return scorer.slot_nll(tokens_BT, np.broadcast_to(np.arange(t), (b, t)))


def random_orders(seed: int, b: int, t: int) -> np.ndarray:
  return np.array(orders_lib.random_orders(jax.random.key(seed), b, t))


def ensemble_nll(scorer: Scorer, tokens_BT: np.ndarray, order_BT: np.ndarray, m: int,
                 seed: int, max_rows: int = 256) -> tuple[np.ndarray, dict]:
  """[B, T] context-order ensemble NLL (paper eq. 7) per slot of `order_BT`, and its cost.

  For the target at slot i, the context set order[:i] is reshuffled m - 1 times; the target's
  probability is averaged over the m orders (the original included). Each reshuffled forward
  stops at slot i (slot counts rounded up to ENSEMBLE_BUCKETS sizes), and the reshuffles of many
  targets run in one batch.
  """
  if m < 1:
    raise ValueError(f"ensemble size M={m} must be >= 1")
  b, t = tokens_BT.shape
  logp_BTE = np.empty((b, t, m))
  logp_BTE[:, :, 0] = -scorer.slot_nll(tokens_BT, order_BT)
  rng = np.random.default_rng(seed)
  bounds = common.bucket_bounds(t, ENSEMBLE_BUCKETS)
  slots_computed = b * t  # the original order: one full forward
  for lo, hi in zip([0] + bounds[:-1], bounds):
    jobs = [(bi, i, r) for i in range(lo, min(hi, t)) for bi in range(b) for r in range(1, m)]
    for start in range(0, len(jobs), max_rows):
      chunk = jobs[start:start + max_rows]
      order_Nt = np.empty((len(chunk), hi), np.int32)
      for row, (bi, i, _) in enumerate(chunk):
        order_Nt[row, :i] = rng.permutation(np.array(order_BT[bi, :i]))
        order_Nt[row, i:] = order_BT[bi, i:hi]  # slot i holds the target; later slots unused
      nll = scorer.slot_nll(tokens_BT[[bi for bi, _, _ in chunk]], order_Nt)
      for row, (bi, i, r) in enumerate(chunk):
        logp_BTE[bi, i, r] = -nll[row, i]
      slots_computed += len(chunk) * hi
  # -log(mean_m p_m), computed stably from log-probabilities.
  top = logp_BTE.max(-1, keepdims=True)
  ens = -(top[..., 0] + np.log(np.mean(np.exp(logp_BTE - top), axis=-1)))
  cost = {"slot_forwards": slots_computed, "full_forward_equivalents_per_target":
          slots_computed / (b * t) / t}
  return ens, cost


def evaluate_blocks(scorer: Scorer, blocks_NT: np.ndarray, *, orders: int = 1,
                    any_order_blocks: Optional[int] = None, ensemble: Sequence[int] = (),
                    batch_size: int = 8, seed: int = 0,
                    progress: Optional[Callable] = None, per_sequence: bool = False) -> dict:
  """L2R and ensemble perplexities over every block; any-order over `any_order_blocks` of them.

  The any-order estimate (`orders` random orders per block, with its standard error) uses a seeded
  shuffle of the blocks cut to `any_order_blocks` (None: all), as the authors' loaders do. The
  ensemble draws one random order per block and reshuffles its contexts (paper eq. 7).
  `progress(n)` is called as blocks are done; the total is `evaluation_units(...)`. The orders
  depend only on `seed` and the block count, so two models evaluated alike are paired; with
  `per_sequence` the result also lists each sequence's mean NLL (for paired differences).
  """
  if orders < 1:
    raise ValueError(f"orders={orders} must be >= 1")
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1")
  n, t = blocks_NT.shape
  ao_rows = _any_order_rows(n, any_order_blocks, seed)
  l2r, ens = [], {m: [] for m in ensemble}
  cost = {m: 0.0 for m in ensemble}
  for start in range(0, n, batch_size):
    tokens = blocks_NT[start:start + batch_size]
    b = len(tokens)
    l2r.append(l2r_nll(scorer, tokens).mean(1))
    if ensemble:
      order = random_orders(seed * 1_000_003 + start + 1, b, t)
      for m in ensemble:
        e, c = ensemble_nll(scorer, tokens, order, m, seed + start)
        ens[m].append(e.mean(1))
        cost[m] += c["full_forward_equivalents_per_target"] * b
    if progress:
      progress(b)
  any_order = []
  for start in range(0, len(ao_rows), batch_size):
    tokens = blocks_NT[ao_rows[start:start + batch_size]]
    b = len(tokens)
    per_order = [scorer.slot_nll(tokens, random_orders(
        seed * 1_000_003 + n + start * orders + k, b, t)).mean(1) for k in range(orders)]
    any_order.append(np.stack(per_order, 1))
    if progress:
      progress(b)
  l2r = np.concatenate(l2r)
  ao = np.concatenate(any_order)  # [sequences, orders]
  m_ao = len(ao)
  # Standard error of the any-order mean NLL over sequences (each averaged over its orders).
  se_nll = ao.mean(1).std(ddof=1) / math.sqrt(m_ao) if m_ao > 1 else float("nan")
  out = {"l2r_ppl": math.exp(l2r.mean()), "l2r_nll": float(l2r.mean()),
         "any_order_ppl": math.exp(ao.mean()), "any_order_nll": float(ao.mean()),
         "any_order_se": math.exp(ao.mean()) * se_nll,  # delta method, in perplexity units
         "any_order_nll_se": float(se_nll), "orders": orders, "any_order_sequences": m_ao,
         "tokens": int(n * t), "sequences": int(n)}
  if per_sequence:
    out["l2r_nll_seq"] = l2r.tolist()
    out["any_order_nll_seq"] = ao.mean(1).tolist()
    out["any_order_rows"] = ao_rows.tolist()
  if ensemble:
    out["ensemble_ppl"] = {str(m): math.exp(np.concatenate(ens[m]).mean()) for m in ensemble}
    out["ensemble_cost_full_forwards_per_target"] = {str(m): cost[m] / n for m in ensemble}
  return out


def _any_order_rows(n: int, limit: Optional[int], seed: int) -> np.ndarray:
  if limit is None or limit >= n:
    return np.arange(n)
  if limit < 1:
    raise ValueError(f"any_order_blocks={limit} must be >= 1 (or None for all)")
  return np.sort(np.random.default_rng(seed).permutation(n)[:limit])


def evaluation_units(n: int, any_order_blocks: Optional[int]) -> int:
  """Progress units of evaluate_blocks over n blocks."""
  return n + (n if any_order_blocks is None else min(n, any_order_blocks))


UNIGRAM_FILE = "tokenizer/train_token_counts.npy"  # saved with each run and its export


def unigram_nll(counts_V: np.ndarray, blocks_NT: np.ndarray) -> float:
  """Mean NLL (nats) of the blocks' tokens under the training split's unigram distribution,
  add-one smoothed: the baseline a model must beat to have used any context."""
  logp_V = np.log((counts_V + 1.0) / (counts_V.sum() + len(counts_V)))
  return float(-logp_V[np.asarray(blocks_NT)].mean())


def load_unigram_counts(checkpoint: str) -> Optional[np.ndarray]:
  """The training token counts saved with a run or export (None for runs made before them)."""
  path = fs.join(checkpoint, UNIGRAM_FILE)
  return fs.read_npy(path) if fs.isfile(path) else None


def unigram_entropy(ids: Sequence[int]) -> float:
  """Entropy (nats) of a sample's token frequencies: low values expose repetition."""
  _, counts = np.unique(np.asarray(ids), return_counts=True)
  p = counts / counts.sum()
  return float(-(p * np.log(p)).sum())


def generative_perplexity(scorer: Any, samples: Sequence[Sequence[int]],
                          batch_size: int = 8) -> dict:
  """Mean over samples of exp(mean NLL of tokens 1..n-1) under an L2R scorer, and unigram entropy.

  As the authors score with GPT-2 Large: the first token is not scored, and the reported figure
  is the mean of per-sample perplexities (gen_ppl_sem: its standard error over the samples).
  `scorer` is a Scorer or a gpt2_scorer.GPT2Scorer;
  samples may differ in length (re-tokenized text) and are batched by length.
  """
  if not samples or min(len(s) for s in samples) < 2:
    raise ValueError("samples must be non-empty and hold at least 2 tokens each")
  longest = max(len(s) for s in samples)
  if longest > scorer.block_size:
    raise ValueError(f"a sample has {longest} tokens; the scorer reads at most "
                     f"{scorer.block_size}")
  top = max(max(s) for s in samples)
  if top >= scorer.vocab_size or min(min(s) for s in samples) < 0:
    raise ValueError(f"sample token id {top} is outside the scorer's vocab [0, "
                     f"{scorer.vocab_size})")
  ppl = np.empty(len(samples))
  by_length = {}
  for i, s in enumerate(samples):
    by_length.setdefault(len(s), []).append(i)
  for rows in by_length.values():
    for start in range(0, len(rows), batch_size):
      chunk = rows[start:start + batch_size]
      ids = np.asarray([samples[i] for i in chunk], np.int32)
      ppl[chunk] = np.exp(scorer.token_nll(ids).mean(1))
  entropy = np.asarray([unigram_entropy(s) for s in samples])
  sem = float(ppl.std(ddof=1) / np.sqrt(len(ppl))) if len(ppl) > 1 else float("nan")
  return {"gen_ppl": float(ppl.mean()), "gen_ppl_sem": sem,
          "gen_ppl_median": float(np.median(ppl)), "unigram_entropy": float(entropy.mean()),
          "samples": len(samples)}


PROTOCOLS = ("paper", "custom")


def eval_sets(data_cfg: ml_collections.ConfigDict, tokenizer: Any, block_size: int, *,
              names: Sequence[str] = (), text_file: Optional[str] = None,
              lambada_file: Optional[str] = None, protocol: str = "paper",
              split: str = "validation", max_blocks: Optional[int] = None) -> dict:
  """{name: int32 [N, T] blocks} of registry datasets (prepared first if needed), or of one
  local text file.

  The paper protocol takes each dataset's split from paper.eval_split and packs it as the
  authors do (prepared.paper_blocks); the custom one takes `split`, the consecutive blocks of
  the split's token stream, and at most `max_blocks`.
  """
  from ao_mdm import paper  # pylint: disable=g-import-not-at-top
  from ao_mdm.data import datasets, pipeline, prepare  # pylint: disable=g-import-not-at-top
  if text_file:
    token_lists = [tokenizer.encode(d) for d in datasets.read_text_documents(text_file)]
    return {text_file: pipeline.pack_for_eval(token_lists, tokenizer.eos_id, block_size,
                                              text_file)}
  sets = {}
  for name in names:
    cfg = data_cfg.copy_and_resolve_references()
    cfg.dataset = name
    if name == "lambada":
      if not lambada_file:
        raise ValueError("--datasets=lambada needs --lambada_file=lambada_test.jsonl (OpenAI's "
                         "LAMBADA test file, one JSON object with a 'text' field per line)")
      cfg.text_file = lambada_file
    paper_protocol = protocol == "paper"
    prepared_split = prepare.ensure(cfg, tokenizer,
                                     paper.eval_split(name) if paper_protocol else split)
    sets[name] = pipeline.eval_blocks(
        prepared_split, block_size, max_blocks=None if paper_protocol else max_blocks,
        packing="paper" if paper_protocol else "stream")
  return sets


def evaluate_sets(scorer: Scorer, sets: dict, *, protocol: str = "paper", orders: int = 4,
                  ensemble: Sequence[int] = (), batch_size: int = 8, seed: int = 0,
                  progress: Optional[Callable[[str, int], Callable]] = None,
                  unigram_counts: Optional[np.ndarray] = None) -> dict:
  """evaluate_blocks per set, under the paper protocol (one order, the authors' block counts)
  or a custom one (`orders` per block, every block); adds the wall time of each.

  `progress(name, total)` may return a callback that is given the blocks done; with
  `unigram_counts` each result also holds the unigram perplexity of the same tokens.
  """
  from ao_mdm import paper  # pylint: disable=g-import-not-at-top
  results = {}
  for name, blocks in sets.items():
    if protocol == "paper":
      n_orders, ao_blocks = 1, paper.eval_any_order_blocks(name)
    else:
      n_orders, ao_blocks = orders, None
    update = progress(name, evaluation_units(len(blocks), ao_blocks)) if progress else None
    start = time.perf_counter()
    r = evaluate_blocks(scorer, blocks, orders=n_orders, any_order_blocks=ao_blocks,
                        ensemble=ensemble, batch_size=batch_size, seed=seed, progress=update)
    r["seconds"] = time.perf_counter() - start
    if unigram_counts is not None:  # the baseline on the same tokens
      r["unigram_ppl"] = math.exp(unigram_nll(unigram_counts, blocks))
    results[name] = r
  return results


def read_generated(path: str) -> list[dict]:
  """Records of `ao-mdm sample --out` (JSON lines with 'tokens' and 'text'), checked."""
  records = paths.jsonl_records(path, "--generated")
  for number, r in enumerate(records, 1):
    tokens = r.get("tokens")
    missing = [what for what, ok in (
        ("a 'tokens' list of integers",
         isinstance(tokens, list) and all(isinstance(i, int) for i in tokens)),
        ("a 'text' string", isinstance(r.get("text"), str))) if not ok]
    if missing:
      raise ValueError(f"--generated {path} record {number} lacks {' and '.join(missing)} "
                       "(expected what `ao-mdm sample --out` writes)")
  return records


def generated_ids(records: list[dict], scorer: Any) -> list[list[int]]:
  """Token ids to score: the samples' own ids, or their text re-tokenized for a GPT-2 scorer."""
  from ao_mdm.data import gpt2  # pylint: disable=g-import-not-at-top
  from ao_mdm.eval import gpt2_scorer  # pylint: disable=g-import-not-at-top  (only here)
  if (not isinstance(scorer, gpt2_scorer.GPT2Scorer)
      or all(r.get("tokenizer") == "gpt2" for r in records)):
    return [r["tokens"] for r in records]
  encode = gpt2.GPT2Tokenizer().encode  # other tokenizers: score the text as GPT-2 reads it
  return [encode(r["text"])[:scorer.block_size] for r in records]


def eval_command(checkpoint: str, weights: str, *, datasets: list, text_file: Optional[str],
                 lambada_file: Optional[str], protocol: str, split: str, orders: int,
                 ensemble: list, max_blocks: int, batch_size: int, seed: int,
                 progress: Callable) -> tuple[dict, Optional[np.ndarray]]:
  """`ao-mdm eval`: (results per dataset, unigram counts or None) of a checkpoint;
  `progress(name, total)` returns the per-block update of one dataset."""
  config, params, tokenizer = checkpoints.load_run(
      checkpoint, weights, shardings=lambda c: param_shardings(c.model, c.mesh))
  sets = eval_sets(config.data, tokenizer, config.model.block_size, names=datasets,
                   text_file=text_file, lambada_file=lambada_file, protocol=protocol,
                   split=split, max_blocks=max_blocks or None)
  scorer = Scorer(params, config.model, config.mesh)
  counts = load_unigram_counts(checkpoint)
  results = evaluate_sets(scorer, sets, protocol=protocol, orders=orders, ensemble=ensemble,
                          batch_size=batch_size, seed=seed, progress=progress,
                          unigram_counts=counts)
  return results, counts


def format_table(results: dict, ensemble: list, unigram: bool) -> str:
  """The table `ao-mdm eval` prints: one row per dataset."""
  lines = [f"{'dataset':<24} {'tokens':>8} {'L2R ppl':>9} {'any-order ppl':>16} "
           + (f"{'unigram ppl':>12} " if unigram else "")
           + " ".join(f"{'ens M=' + str(m):>10}" for m in ensemble)]
  for name, r in results.items():
    lines.append(f"{name[-24:]:<24} {r['tokens']:>8} {r['l2r_ppl']:>9.2f} "
                 f"{r['any_order_ppl']:>9.2f} +-{r['any_order_se']:<5.2f}"
                 + (f"{r['unigram_ppl']:>12.2f} " if unigram else "")
                 + " ".join(f"{r['ensemble_ppl'][str(m)]:>10.2f}" for m in ensemble))
  return "\n".join(lines)


def generated_command(generated: str, scorer_path: str, weights: str, batch_size: int) -> dict:
  """`ao-mdm eval --generated`: generative perplexity of samples under a GPT-2 export or an
  ao_mdm checkpoint, with the seconds it took."""
  records = read_generated(generated)
  from ao_mdm.eval import gpt2_scorer  # pylint: disable=g-import-not-at-top  (only here)
  if gpt2_scorer.is_gpt2_export(scorer_path):
    scorer = gpt2_scorer.load_gpt2_scorer(scorer_path)
  else:
    config, params = checkpoints.load_params(
        scorer_path, weights, shardings=lambda c: param_shardings(c.model, c.mesh))
    scorer = Scorer(params, config.model, config.mesh)
  start = time.perf_counter()
  result = generative_perplexity(scorer, generated_ids(records, scorer), batch_size)
  result["seconds"] = time.perf_counter() - start
  return result
