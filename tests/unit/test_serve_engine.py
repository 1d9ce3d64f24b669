"""The server's engine in this process: a job that raises, in its admission or while its text
is made, fails alone; the jobs beside it finish as they do alone, and the engine goes on."""

import threading
import time

import pytest
from test_grpo import Ids
from test_parallel import cached_model

from ao_mdm.serve import engine as engine_lib


def run(eng, specs):
  """Submits jobs (prompt, max_tokens, seed[, policy]) together; each one's events once all
  ended."""
  events = [[] for _ in specs]
  ended = threading.Semaphore(0)

  def emitter(i):
    def emit(kind, payload):
      events[i].append((kind, payload))
      if kind in ("done", "error"):
        ended.release()

    return emit

  eng.submit(
    [
      engine_lib.Job(prompt, m, emitter(i), seed=seed, temperature=0.0, policy=policy)
      for i, (prompt, m, seed, policy) in enumerate(s + ("parallel",) * (4 - len(s)) for s in specs)
    ]
  )
  for _ in specs:
    assert ended.acquire(timeout=120)
  return events


def text(events):
  assert events[-1][0] == "done", events[-1]
  return "".join(p["text"] for k, p in events if k == "text")


def test_a_job_that_raises_fails_alone_and_the_engine_goes_on(monkeypatch):
  cfg, params = cached_model("ao")
  eng = engine_lib.Engine(params, cfg, Ids(), max_batch=2, max_queue=8, max_tokens_per_step=1)
  progress = eng._progress

  def faulty(job, *args):
    if job.seed == 13:
      raise RuntimeError("boom")
    return progress(job, *args)

  monkeypatch.setattr(eng, "_progress", faulty)
  eng.start()
  try:
    a, b = ((3, 4, 5), 8, 1), ((6, 7), 12, 2)
    too_long = (tuple(range(2, cfg.block_size + 2)), 1, 3)  # past T: refused when admitted
    together = run(eng, [a, ((3, 4, 5), 8, 13), too_long, b])
    assert together[1][-1] == ("error", {"message": "RuntimeError: boom"})
    assert together[2][-1][0] == "error" and eng.stats.failed == 2
    alone = [run(eng, [job])[0] for job in (a, b)]
    assert text(together[0]) == text(alone[0]) and text(together[3]) == text(alone[1])
    assert text(alone[0]) and text(alone[1])
  finally:
    eng.stop()


@pytest.mark.slow  # compiles 60 programs (about 25 s here)
def test_jobs_that_wait_together_are_prefilled_by_one_forward_after_the_warm_up():
  """The engine first compiles every prefill width and step length (`warming` says how far);
  then 4 jobs submitted together into 4 free rows join by one prefill, compiled before, and
  decode as alone."""
  cfg, params = cached_model("ao")
  eng = engine_lib.Engine(params, cfg, Ids(), max_batch=4, max_queue=8, max_tokens_per_step=1)
  seen = []
  batcher = eng.batchers["parallel"]
  warm_up = batcher.warm_up
  batcher.warm_up = lambda progress: warm_up(lambda *a: (seen.append(a), progress(*a)))
  eng.start()
  try:
    deadline = time.monotonic() + 120
    while eng.warming and time.monotonic() < deadline:
      time.sleep(0.05)
    # At 2 rows and at 4: the 4 resizes between the 3 cache lengths (16, 24, 32) a step makes
    # (any growth; a cut to half or less), the prefill widths 8, 16, 32 at each length that
    # holds them (7 inserts), those widths' prefills of 2 rows (and at 4, of 4: 64 slots a row
    # of the batch hold them all) and a step at each length; then a change of size at each.
    assert eng.warming == "" and seen[-1] == (40, 40)
    inserts = []
    insert = batcher._insert
    batcher._insert = lambda *a, **k: (inserts.append(1), insert(*a, **k))[1]
    prefills = batcher._prefill._cache_size()
    jobs = [((3, 4, 5), 8, 1), ((6, 7), 12, 2), ((1,), 5, 3), ((2, 2, 2, 2), 9, 4)]
    together = run(eng, jobs)
    assert len(inserts) == 1 and batcher._prefill._cache_size() == prefills
    alone = [run(eng, [job])[0] for job in jobs]
    assert [text(e) for e in together] == [text(e) for e in alone]
  finally:
    eng.stop()


@pytest.mark.slow  # compiles the adaptive policies' steps (about 30 s here)
def test_jobs_of_every_served_policy_run_together_each_as_it_runs_alone():
  """Margin, confidence and parallel jobs submitted at once: each policy's batch steps its own
  rows, and every job's greedy text is the one it gets alone."""
  cfg, params = cached_model("ao")
  served = ("parallel", "margin", "confidence")
  eng = engine_lib.Engine(
    params, cfg, Ids(), max_batch=2, max_queue=16, max_tokens_per_step=2, policies=served
  )
  eng.start(warm_up=False)
  try:
    jobs = [((3, 4, 5), 8, seed, policy) for policy in served for seed in (1, 2)]
    together = run(eng, jobs)
    alone = [run(eng, [job])[0] for job in jobs]
    for job, both, one in zip(jobs, together, alone):
      assert text(both) == text(one) and text(one), job
    assert eng.stats.failed == 0
  finally:
    eng.stop()


def test_a_job_of_a_policy_not_served_is_refused_before_it_is_queued():
  cfg, params = cached_model("ao")
  eng = engine_lib.Engine(
    params, cfg, Ids(), max_batch=2, max_queue=4, max_tokens_per_step=1, policies=("margin",)
  )
  job = engine_lib.Job((3, 4), 2, lambda *a: None)  # the default policy, parallel
  with pytest.raises(ValueError, match="policy='parallel'; this engine runs margin"):
    eng.submit([job])
  assert not eng.queue
