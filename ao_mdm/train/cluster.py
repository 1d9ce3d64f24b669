"""A training run of several processes (the hosts of a TPU VM slice, SLURM tasks, local
processes): joining it, agreeing at every step boundary whether to stop, and ending every
process with one line when one of them is lost (docs/launching.md, "When a host stops").

JAX's own preemption service is turned off: it takes SIGTERM over in C, cannot see Ctrl-C, and
a signal during start-up could not be saved; training's `StopRequest` hears both signals and
`StopAgreement` makes every process stop at the same step. The distributed runtime runs in its
recoverable mode, so that the loss of a process is reported to us (`Watchdog`) instead of
aborting this one; the loss of process 0, which hosts the runtime's service, still aborts in C++,
and a SIGABRT handler turns that into the same one line. Single-process runs use none of this.
"""

from collections.abc import Callable
import ctypes
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ao_mdm.checkpoint import layout
from ao_mdm.runtime import hosts, quiet

WATCH_S = 2.0  # how often the watchdog asks the runtime which processes live


class JoinTimeout(TimeoutError):
  """No answer from the coordinator in time. The join cannot be cancelled and would block the
  interpreter's exit, so a command that catches this must end the process at once."""

  exit_now = True


class _Run:
  """What the lines of a lost run say: this process, the work dir, its newest checkpoint."""

  process, count, workdir, heartbeat_s = 0, 1, "", hosts.HEARTBEAT_S
  checkpoint: int | None = None
  ending = False  # set once this process is on its way out: a peer leaving is no news then
  exit_code = 2  # what a SIGABRT from the runtime ends the process with


RUN = _Run()


def multi_process() -> bool:
  return RUN.count > 1


def join(
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  timeout: int = 180,
  heartbeat_s: int = hosts.HEARTBEAT_S,
) -> None:
  """Join a multi-process run (explicit coordinator flags, or an auto-detected TPU VM / SLURM
  launch); a single process does nothing. Gives up after `timeout` seconds with JoinTimeout,
  and a signal works while it waits: the join runs in a thread that this one watches."""
  if coordinator:
    if num_processes is None or process_id is None or not 0 <= process_id < num_processes:
      raise ValueError(
        f"--coordinator needs --num_processes >= 1 and --process_id in "
        f"[0, num_processes); got {num_processes}, {process_id}"
      )
    kwargs = dict(
      coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )
  elif hosts.detected_launcher():
    kwargs = {}  # jax.distributed reads the coordinator from the launcher's variables
  else:
    return
  jax.config.update("jax_enable_preemption_service", False)
  jax.config.update("jax_enable_recoverability", True)
  if not os.environ.get("AO_MDM_TRACEBACK"):
    quiet.silence_for_good()
  failure = []

  def connect():
    try:  # jax's own deadline comes later, so that ours gives the error
      jax.distributed.initialize(
        **kwargs, initialization_timeout=timeout + 60, heartbeat_timeout_seconds=heartbeat_s
      )
    except Exception as e:
      failure.append(e)

  thread = threading.Thread(target=connect, daemon=True)
  thread.start()
  where = coordinator or f"the coordinator of this {hosts.detected_launcher()} job"
  thread.join(timeout)
  if thread.is_alive():
    raise JoinTimeout(
      f"no answer from {where} within {timeout} s (--init_timeout); is process 0 "
      "running and the address reachable from here?"
    )
  if failure:
    raise OSError(f"could not join {where}: {str(failure[0]).strip().splitlines()[0]}")
  RUN.process, RUN.count, RUN.heartbeat_s = jax.process_index(), jax.process_count(), heartbeat_s
  if RUN.count > 1:
    _on_abort()
    threading.Thread(target=_watch, daemon=True, name="ao_mdm-watchdog").start()


def note_checkpoint(workdir: str, step: int | None) -> None:
  """The newest complete checkpoint of this run as this process knows it, named by the line of
  a stopped run (a lost run's line lists the work dir's steps first: _list_checkpoints)."""
  RUN.workdir, RUN.checkpoint = workdir, step


UNLISTED = -1  # the checkpoint noted before the work dir's steps are listed


def newest_checkpoint() -> str:
  """What the last line of a stopped run says of its checkpoints."""
  if RUN.checkpoint == UNLISTED:
    return (
      f"its checkpoints in {RUN.workdir or 'the work dir'} were not listed yet (a restart "
      "resumes from the newest that reads)"
    )
  if RUN.checkpoint is None:
    return f"no checkpoint of this run is complete yet in {RUN.workdir or 'the work dir'}"
  return f"the newest complete checkpoint is step {RUN.checkpoint} in {RUN.workdir}"


LIST_S = 5.0  # how long a lost run's line waits for the work dir's steps to be listed


def _list_checkpoints() -> None:
  """The newest complete checkpoint as a restart finds it (the work dir's steps listed, for
  LIST_S at most), not the one this process last verified, which lags a save behind."""
  found = []

  def newest():
    try:
      found.append(layout.newest_complete_step(RUN.workdir))
    except Exception:  # unlisted: the noted step stands
      pass

  if RUN.workdir:
    thread = threading.Thread(target=newest, daemon=True, name="ao_mdm-list-steps")
    thread.start()
    thread.join(LIST_S)
  if found:
    RUN.checkpoint = found[0]


def _lost(processes: list) -> None:
  """One line naming the lost processes, then this process ends at once (exit 2): the
  interpreter's own exit would wait on the lost ones."""
  if RUN.ending:
    return
  _list_checkpoints()  # before the end is claimed: meanwhile `fail` waits for this line
  if RUN.ending:
    return
  RUN.ending = True
  names = ", ".join(map(str, processes))
  quiet.say(
    f"error: process {names} of {RUN.count} stopped or became unreachable (silent for "
    f"--heartbeat_timeout={RUN.heartbeat_s} s at most); {newest_checkpoint()}; start "
    "every process again to resume from it"
  )
  os._exit(2)


def _watch() -> None:
  """Every WATCH_S seconds, which processes the runtime still hears (a process that stops
  sending heartbeats drops out after the heartbeat timeout)."""
  client = jax._src.distributed.global_state.client
  assert client is not None  # joined: a run of several processes
  everyone = list(range(RUN.count))
  while not RUN.ending:
    try:
      live = client.get_live_nodes(everyone)
    except Exception:  # the service itself is gone
      _lost([0])
      return
    missing = sorted(set(everyone) - set(live))
    if missing:
      _lost(missing)
      return
    time.sleep(WATCH_S)


_ABORT_HANDLER: list = []  # the C callback, kept alive for the process's lifetime


def _on_abort() -> None:
  """The runtime ends a process whose coordinator (process 0) is gone with LOG(FATAL), i.e.
  abort(): a C-level SIGABRT handler says why in one line and exits instead."""
  callback_type = ctypes.CFUNCTYPE(None, ctypes.c_int)

  def handler(signum):
    del signum
    if RUN.ending:  # the run had ended; the service went first
      os._exit(RUN.exit_code)
    if RUN.process != 0:
      _lost([0])
    _list_checkpoints()
    quiet.say(f"error: the distributed runtime ended process 0; {newest_checkpoint()}")
    os._exit(2)

  _ABORT_HANDLER.append(callback_type(handler))
  ctypes.CDLL(None).signal(signal.SIGABRT, _ABORT_HANDLER[0])


def fail(error: Exception, say: Callable[[], None]) -> None:
  """How a multi-process run ends after `error`: a collective that failed because a process
  was lost waits for the watchdog to name it (within the heartbeat timeout); any other error is
  said by `say()`. Either way the process ends at once, never by an abort."""
  if _peer_lost(error) and not RUN.ending:
    deadline = time.monotonic() + RUN.heartbeat_s + 3 * WATCH_S + LIST_S
    while time.monotonic() < deadline and not RUN.ending:
      time.sleep(0.2)  # the watchdog names the lost process and exits
  RUN.ending = True
  say()
  os._exit(2)


def _peer_lost(error: Exception) -> bool:
  """Whether an error is a collective or the runtime failing (a peer gone), not ours."""
  text = str(error)
  return isinstance(error, jax.errors.JaxRuntimeError) or any(
    s in text for s in ("Gloo", "Connection closed", "UNAVAILABLE", "DEADLINE_EXCEEDED")
  )


def finish(exit_code: int) -> None:
  """The orderly end of a multi-process run: every process reaches the end before any leaves
  (the coordinator's service must outlive its clients), then each exits with `exit_code`."""
  if not multi_process():
    sys.exit(exit_code)
  client = jax._src.distributed.global_state.client
  assert client is not None  # joined: a run of several processes
  try:
    client.wait_at_barrier("ao_mdm:finished", int((RUN.heartbeat_s + 60) * 1000))
  except Exception as e:  # a process was lost on the way out
    line = f"error: {str(e).strip().splitlines()[0]}"
    fail(e, lambda: quiet.say(line))
  RUN.ending, RUN.exit_code = True, exit_code
  sys.stdout.flush()
  if RUN.process == 0:
    time.sleep(1.0)  # the others leave first
  os._exit(exit_code)


class StopAgreement:
  """Every process stops at the same step boundary. At each boundary every process gives its
  local stop code (0: go on; interrupts.StopRequest's codes; LEASE_LOST) and gets the largest
  over all processes: one small all-reduce dispatched at this boundary and read at the next, so
  the decision lags one step and costs no wait on the step that runs. One process: no lag."""

  def __init__(self, mesh: jax.sharding.Mesh):
    self.single = jax.process_count() == 1
    if self.single:
      return
    devices = mesh.devices.reshape(-1)
    self._mesh = jax.sharding.Mesh(devices, ("all",))
    self._sharding = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec("all"))
    self._max = jax.jit(
      jnp.max, out_shardings=jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
    )
    self._pending = None

  def __call__(self, code: int) -> int:
    if self.single:
      return code
    n = self._mesh.devices.size
    local = jax.make_array_from_callback(
      (n,), self._sharding, lambda index: np.full((1,), code, np.int32)
    )
    previous, self._pending = self._pending, self._max(local)
    return 0 if previous is None else int(previous)


LEASE_LOST = 3  # above interrupts.StopRequest's codes: another run took the work dir over
