"""The server's Prometheus page (/metrics), made from the engine's Stats at each scrape:
counters for what only grows, gauges for the load now and for rates over the last WINDOW_S
seconds, histograms of the step time and the time to a first token."""

from collections.abc import Iterator
import time
from typing import Any

import prometheus_client as prom
from prometheus_client import core

from ao_mdm.serve import engine as engine_lib

WINDOW_S = 10.0  # the recent window of the rate gauges


class Metrics:
  """A collector over one engine, in a registry of its own."""

  def __init__(self, engine: engine_lib.Engine):
    self.engine = engine
    self.registry = prom.CollectorRegistry()
    self.ttft = prom.Histogram(
      "ao_mdm_time_to_first_token_seconds",
      "From a job's arrival to its first final text.",
      registry=self.registry,
      buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    )
    self.step = prom.Histogram(
      "ao_mdm_step_seconds",
      "One engine step: a batched forward of the active rows and its bookkeeping.",
      registry=self.registry,
      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    )
    self.registry.register(self)

  def collect(self) -> Iterator[Any]:
    e, s = self.engine, self.engine.stats
    reused = sum(b.reused_slots for b in e.batchers.values())
    counters = [
      ("tokens_generated", "Tokens generated.", s.tokens),
      ("forwards", "Engine steps (batched forwards).", s.forwards),
      ("row_steps", "Rows decoding a job, summed over the engine steps.", s.row_steps),
      ("finished", "Choices finished.", s.finished),
      ("failed", "Choices ended by an error.", s.failed),
      ("cancelled", "Running choices whose client left.", s.cancelled),
      ("prefix_tokens_reused", "Prompt slots copied (--prefix_cache).", reused),
    ]
    for name, doc, value in counters:
      yield core.CounterMetricFamily(f"ao_mdm_{name}", doc, value=value)
    tokens, row_steps, seconds = s.recent(time.monotonic(), WINDOW_S)
    gauges = [
      ("queue_depth", "Jobs (completion choices) waiting for a row.", len(e.queue)),
      ("active_rows", "Rows of the batch decoding a job.", len(e.active)),
      (
        "tokens_per_second",
        f"Tokens generated per second over the last {WINDOW_S:g} s.",
        tokens / seconds if seconds else 0.0,
      ),
      (
        "tokens_per_forward_per_row",
        f"Tokens a row committed per forward over the last {WINDOW_S:g} s (parallel decoding).",
        tokens / row_steps if row_steps else 0.0,
      ),
    ]
    for name, doc, level in gauges:
      yield core.GaugeMetricFamily(f"ao_mdm_{name}", doc, value=level)

  def render(self) -> bytes:
    s = self.engine.stats
    while s.ttft_s:
      self.ttft.observe(s.ttft_s.popleft())
    while s.step_s:
      self.step.observe(s.step_s.popleft())
    return prom.generate_latest(self.registry)
