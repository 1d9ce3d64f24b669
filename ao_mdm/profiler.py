"""jax.profiler traces of a window of work (train steps, a sampling), written into a directory
that may be a bucket: traced into a local directory, then copied through the storage layer.
TensorBoard's profile plugin or XProf opens them (docs/performance.md, "Profiles")."""

from collections.abc import Callable, Iterator
import contextlib
import socket
import tempfile
from typing import Any

import jax

from ao_mdm.storage import fs


@contextlib.contextmanager
def trace(directory: str, log: Callable[[str], None] = print) -> Iterator[None]:
  """A trace of everything the devices and JAX do inside, written to
  `directory/plugins/profile/<run>/<host>_<process>.xplane.pb` (local or gs://)."""
  local = tempfile.mkdtemp(prefix="ao_mdm_profile_")
  jax.profiler.start_trace(local)
  try:
    yield
  finally:
    jax.profiler.stop_trace()
    host = socket.gethostname()
    for name in fs.files(local):
      target = name.replace(f"{host}.", f"{host}_{jax.process_index()}.")
      fs.write_bytes(fs.join(directory, target), fs.read_bytes(fs.join(local, name)))
    fs.rmtree(local)
    log(
      f"wrote a profile to {directory} (open it with `tensorboard --logdir={directory}` and "
      "its profile tab, or with XProf)"
    )


class Window:
  """Traces train steps start .. start + steps - 1 (absolute step numbers; steps=0: none) into
  `directory`, each step annotated as `train` with its number."""

  def __init__(self, directory: str, start: int, steps: int, log: Callable[[str], None]):
    self.directory, self.first, self.last, self.log = directory, start, start + steps - 1, log
    self._trace: contextlib.AbstractContextManager | None = None

  @contextlib.contextmanager
  def step(self, step: int) -> Iterator[None]:
    """Around the dispatch of step `step` (0-based): starts the trace at the window's first."""
    if step == self.first and self.last >= self.first:
      self._trace = trace(self.directory, self.log)
      self._trace.__enter__()
    if self._trace is None:
      yield
      return
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      yield

  def after(self, step: int, outputs: Any) -> None:
    """After step `step` was dispatched: the trace ends once the window's last step ran."""
    if self._trace is not None and step >= self.last:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    if self._trace is not None:
      trace_, self._trace = self._trace, None
      trace_.__exit__(None, None, None)
