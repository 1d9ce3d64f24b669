"""The decoding policies by name (docs/sampling.md, "Policies"): what `ao-mdm sample --mode`,
`generate.sample_texts`, the harness's generate_until and the benchmarks decode with. Free of
JAX (a built-in policy's sampler is named "module:function" and imported at its first use), so
the command line lists and checks the policies before JAX loads."""

from collections.abc import Callable
import dataclasses
import importlib
from typing import Any

from ao_mdm.decode import options

DRAW = ("temperature", "top_p", "top_k", "top_p_rule", "dtype")  # every built-in policy's


@dataclasses.dataclass(frozen=True)
class Policy:
  """A decoding rule: `static(protocol.Batch, [eos_id], **its options)` builds the
  protocol.Static of a batch, which protocol.sample runs (`sample`).

  orders: the `order` values it takes (() : none; its first one is its default, "authors": left
  to right after known tokens, random without). until_eos: the orders with which it can stop
  each row at its first EOS (it then takes eos_id), and the options it then defaults.
  batched: "module:function" -> its protocol.PolicySpec continuing prompts in a
  batching.Batcher, `fn(cfg, protocol.Continuing(...))` (None: static batches only).
  """

  name: str
  static: str | Callable[..., Any]
  options: tuple[str, ...]
  orders: tuple[str, ...] = ()
  until_eos: tuple[str, ...] = ()
  until_eos_defaults: tuple[tuple[str, Any], ...] = ()
  batched: str | Callable[..., Any] | None = None

  def sample(self, params: Any, cfg: Any, **kwargs) -> Any:
    """protocol.sample by this policy: a common.SampleOutput."""
    from ao_mdm.decode import protocol  # JAX loads here, not with the registry

    return protocol.sample(_resolve(self.static), params, cfg, **kwargs)

  def build(self, batch: Any, **options) -> Any:
    """Its protocol.Static of a protocol.Batch (what a benchmark compiles and times)."""
    return _resolve(self.static)(batch, **options)

  def batch_spec(self, cfg: Any, **kwargs) -> Any:
    """Its PolicySpec for a continuous batch (ValueError when it has none)."""
    if self.batched is None:
      served = [p.name for p in POLICIES.values() if p.batched]
      raise ValueError(
        f"policy {self.name!r} runs in static batches only; a continuous batch (the server, "
        f"GRPO) takes {', '.join(served)}"
      )
    from ao_mdm.decode import protocol

    return _resolve(self.batched)(cfg, protocol.Continuing(**kwargs))

  def order(self, given: str | None, num_known: int) -> str | None:
    """The order it decodes in: `given`, or its default (None: it takes no order)."""
    if not self.orders:
      return None
    if given is not None or self.orders[0] != "authors":
      return given or self.orders[0]
    return authors_order(num_known)


def _resolve(fn: str | Callable[..., Any]) -> Callable[..., Any]:
  """A function, or the one named "module:function" (imported at first use)."""
  if isinstance(fn, str):
    module, name = fn.split(":")
    return getattr(importlib.import_module(module), name)
  return fn


def authors_order(num_known: int) -> str:
  """The authors' order of the unknown positions: with known tokens (a prompt or infill context)
  left to right, as their `cond_generate` (its random permutation is commented out); without, a
  random order, as their `generate` (model_AOGPT_generate.py)."""
  return "l2r" if num_known else "random"


def register(policy: Policy) -> Policy:
  """Adds a policy under its name (refusing one that is taken); returns it."""
  if policy.name in POLICIES:
    raise ValueError(f"a decoding policy named {policy.name!r} exists already")
  POLICIES[policy.name] = policy
  return policy


def get(name: str) -> Policy:
  options.check_choice("mode", name, tuple(POLICIES))
  return POLICIES[name]


def option_names() -> frozenset:
  """Every option some policy takes."""
  return frozenset(name for p in POLICIES.values() for name in p.options)


def check_options(mode: str, given: set) -> None:
  """Refuses options the policy would ignore (e.g. --score outside confidence)."""
  policy = get(mode)
  for name in sorted(given - set(policy.options)):
    takers = [p for p in POLICIES if name in POLICIES[p].options]
    raise ValueError(f"--{name} applies to --mode={' or --mode='.join(takers)}, not --mode={mode}")


def check_until_eos(mode: str, order: str | None, infill: str = "") -> None:
  """Refuses --until_eos where no text follows a first EOS: a policy that chooses its order
  online (confidence), an order in which it cannot stop (speculative at random), an infill text
  (it ends at its text's end already)."""
  policy = get(mode)
  if not policy.until_eos:
    takers = [p for p in POLICIES if POLICIES[p].until_eos]
    raise ValueError(
      f"--until_eos applies to --mode={' or --mode='.join(takers)}, not --mode={mode}"
    )
  if policy.order(order, 0) not in policy.until_eos:
    raise ValueError(
      f"--until_eos with --mode={mode} needs --order={' or --order='.join(policy.until_eos)}, "
      f"not --order={order} (use --mode=parallel for blocks in a random order)"
    )
  if infill:
    raise ValueError(
      "--until_eos applies with --prompt or no text, not --infill: an infill "
      "sample ends where its text ends (end the text with [MASK] to continue it "
      "by --infill_span tokens)"
    )


BUILT_IN = (
  Policy(
    "parallel",
    "ao_mdm.decode.parallel:static",
    ("steps", "schedule", "order", "block_len", *DRAW),
    orders=("authors", "random", "l2r"),
    until_eos=("random", "l2r"),
    until_eos_defaults=(("block_len", options.DEFAULT_BLOCK_LEN),),
    batched="ao_mdm.decode.parallel:continuing",
  ),
  Policy(
    "speculative",
    "ao_mdm.decode.speculative:static",
    ("draft", "order", "draft_head", *DRAW),
    orders=("l2r", "random"),
    until_eos=("l2r",),
    batched="ao_mdm.decode.speculative:continuing",
  ),
  Policy(
    "confidence",
    "ao_mdm.decode.confidence:static",
    ("steps", "schedule", "score", *DRAW),
    batched="ao_mdm.decode.confidence:continuing",
  ),
  Policy(
    "margin",
    "ao_mdm.decode.margin:static",
    ("steps", "schedule", *DRAW),
    batched="ao_mdm.decode.margin:continuing",
  ),
)
POLICIES: dict[str, Policy] = {p.name: p for p in BUILT_IN}
