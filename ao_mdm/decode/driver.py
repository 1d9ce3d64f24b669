"""The driver of a Batcher over a list of requests (GRPO's rollouts, completions, the benches):
requests join rows as they free up, and work that depends on results joins too. It knows no
policy: every policy's Batcher runs it alike."""

import collections
from collections.abc import Callable

from ao_mdm.decode.batching import Batcher, Finished, Request


def decode_all(
  batcher: Batcher,
  requests: list[Request],
  then: Callable[[int, Finished], list[Request]] | None = None,
) -> list[Finished]:
  """Every request decoded through `batcher`, joining rows as they free up; in request order.
  then(i, finished), as request i finishes, may return more requests (numbered on from the
  last): work that depends on results (GRPO's redraws) fills the rows that others free."""
  pending, done = collections.deque(enumerate(requests)), {}
  rows: dict[int, int] = {}  # batch row -> request index
  numbered = len(requests)
  while pending or rows:
    joining = [pending.popleft() for _ in range(min(len(pending), batcher.free_rows()))]
    if joining:
      for row, (i, _) in zip(batcher.add_many([q for _, q in joining]), joining):
        rows[row] = i
    for old, new in batcher.compact().items():
      rows[new] = rows.pop(old)
    busy = [r for r, q in enumerate(batcher.requests) if q is not None]
    # Many steps a call, until rows for the waiting requests or, while then() may add some,
    # half the busy rows finished (no more): a call and an insert cost more host work than a few
    # rows idle a step (reversal's rollout after GRPO: 26 -> 10 calls, about 12% faster).
    half = max(1, len(busy) // 2)
    stop = min(len(pending), half) if pending else (half if then is not None else 0)
    finished = batcher.step(batcher.spec.model.block_size, stop_after=stop)
    for row, f in zip([r for r in busy if batcher.requests[r] is None], finished):
      i = rows.pop(row)
      done[i] = f
      for request in then(i, f) if then else ():
        pending.append((numbered, request))
        numbered += 1
  return [done[i] for i in range(numbered)]
