"""Device mesh, logical axis rules, where params live on a mesh, host-local <-> global arrays.

docs/design.md, "Sharding", has the mesh axes and the default rules.
"""

from collections.abc import Sequence
import functools
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from ao_mdm import model as model_lib
from ao_mdm import specs

MESH_AXES = specs.MESH_AXES


def _fill(sizes: Sequence[int], total: int, what: str) -> tuple[int, ...]:
  """Replace one -1 in `sizes` so that the product equals `total`."""
  sizes = [int(s) for s in sizes]  # their form is checked by specs.MeshSpec
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if total % known:
      raise ValueError(f"mesh.{what}={tuple(sizes)}: {total} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = total // known
  if int(np.prod(sizes)) != total:
    raise ValueError(
      f"mesh.{what}={tuple(sizes)} has {int(np.prod(sizes))} devices but {total} are available"
    )
  return tuple(sizes)


def make_mesh(mesh_cfg: specs.MeshSpec, devices: Sequence[Any] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh from ICI and DCN sizes (-1 fills the rest)."""
  devices = list(jax.devices() if devices is None else devices)
  n_slices = len({getattr(d, "slice_index", 0) for d in devices})
  dcn = (
    _fill(mesh_cfg.dcn, n_slices, "dcn")
    if n_slices > 1
    else tuple(1 if s == -1 else int(s) for s in mesh_cfg.dcn)
  )
  if int(np.prod(dcn)) != n_slices:
    raise ValueError(f"mesh.dcn={tuple(mesh_cfg.dcn)} does not match {n_slices} slice(s)")
  ici = _fill(mesh_cfg.ici, len(devices) // n_slices, "ici")
  if n_slices > 1:
    arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
  else:
    try:
      arr = mesh_utils.create_device_mesh(ici, devices)
    except (ValueError, NotImplementedError, AssertionError):
      arr = np.asarray(devices).reshape(ici)
  return Mesh(arr, MESH_AXES)


def rules(mesh_cfg: specs.MeshSpec) -> tuple:
  """Logical-to-mesh axis rules of a mesh spec, as Flax expects them."""
  return mesh_cfg.rules


def logical_shardings(abstract_boxed: Any, mesh: Mesh, axis_rules: tuple) -> Any:
  """NamedShardings for a pytree whose leaves carry logical axis names (unboxed structure)."""
  partition_specs = nn.get_partition_spec(abstract_boxed)
  return nn.logical_to_mesh_sharding(partition_specs, mesh, axis_rules)


def batch_sharding(mesh: Mesh, axis_rules: tuple, ndim: int = 2) -> NamedSharding:
  """Sharding of a [batch, ...] array: batch over the data axes, the rest replicated."""
  spec = nn.logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1), axis_rules)
  assert spec is not None  # None only for no names
  return NamedSharding(mesh, spec)


def data_parallel_size(mesh: Mesh, axis_rules: tuple) -> int:
  """How many ways the batch axis is split."""
  names = nn.logical_to_mesh_axes(("batch",), axis_rules)
  assert names is not None  # None only for no names
  spec = names[0]
  axes = spec if isinstance(spec, tuple) else (() if spec is None else (spec,))
  return int(np.prod([mesh.shape[a] for a in axes]))


def global_batch(local_bT: Any, sharding: jax.sharding.Sharding) -> Any:
  """Assemble the global batch from each process's local rows (an array, or a dict of [b, ...]
  arrays)."""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_bT)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


@functools.cache
def placement(cfg: specs.ModelSpec, mesh_spec: specs.MeshSpec | None = None) -> tuple:
  """(mesh, axis rules, param shardings) of model `cfg`'s params on `mesh_spec` (default: one
  device), built once per pair in a process: a checkpoint is restored straight into place, and
  the scorer and the training loop place params alike."""
  mesh_spec = mesh_spec or specs.single_device_mesh()
  mesh, axis_rules = make_mesh(mesh_spec), rules(mesh_spec)
  boxed = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  return mesh, axis_rules, logical_shardings(boxed, mesh, axis_rules)


def param_shardings(cfg: specs.ModelSpec, mesh_spec: specs.MeshSpec | None = None) -> Any:
  """Where params of model `cfg` live on `mesh_spec`: placement's third part."""
  return placement(cfg, mesh_spec)[2]


def parameter_table(params: Any, shardings: bool = False) -> str:
  """clu's table of the parameters: name, shape, dtype, size (the blocks' stacked along L) and,
  with `shardings`, each array's partition spec."""
  from clu import parameter_overview

  return parameter_overview.get_parameter_overview(
    params, include_stats="sharding" if shardings else False
  )
