"""Which process of a launch this is (SLURM and multi-host TPU VMs are detected from their
environment variables, explicit flags override them) and whether a process of this host
lives. Free of JAX, so the command line checks its process flags before JAX loads."""

import os

# Seconds a process may go unheard before the others take it for lost (--heartbeat_timeout).
# The runtime sends a heartbeat every HEARTBEAT_S / 2, so a killed process is noticed after
# HEARTBEAT_S / 2 to HEARTBEAT_S; a live one that cannot send one for longer than HEARTBEAT_S / 2
# (stopped, swapping, a network stall) may be taken for lost. JAX's default is 100 s.
HEARTBEAT_S = 15


def detected_launcher() -> str:
  """'slurm' or 'tpu' when this process was started as one of several by SLURM or on a
  multi-host TPU VM (jax.distributed finds the coordinator itself), else ''."""
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    return "slurm"
  if "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or os.environ.get(
    "MEGASCALE_COORDINATOR_ADDRESS"
  ):
    return "tpu"
  return ""


def launcher_process(
  process_id: int | None = None, num_processes: int | None = None
) -> tuple[int, int]:
  """This host's (index, count) without jax.distributed (`ao-mdm prepare`): the flags, else
  SLURM's or a multi-host TPU VM's variables, else (0, 1)."""
  if process_id is not None or num_processes is not None:
    if process_id is None or num_processes is None:
      raise ValueError("give --process_id and --num_processes together (or neither)")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(
        f"--process_id={process_id} must be in [0, {num_processes}) and "
        f"--num_processes={num_processes} >= 1"
      )
    return process_id, num_processes
  if detected_launcher() == "slurm":
    return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if "," in hosts and os.environ.get("TPU_WORKER_ID", "").isdigit():
    return int(os.environ["TPU_WORKER_ID"]), len(hosts.split(","))
  return 0, 1


def alive(pid: int) -> bool:
  """Whether a process of this host with this pid runs."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True
