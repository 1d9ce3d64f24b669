"""Detokenizers of the evaluation datasets: one table of rewrite rules per dataset, one function.

The rules are those of the authors' data.py (scxue/AO-GPT-MDM), which follow SEDD/MDLM; each is
(kind, pattern, replacement) with kind "str" (plain replace) or "re" (re.sub), applied in order.
"""

import re

Rule = tuple[str, str, str]

_BRACKETS = tuple(
  ("re", rf"{o}\s*([^{c}]*?)\s*{c}", rf"{u}\1{v}")
  for o, c, u, v in (
    (r"\(", r"\)", "(", ")"),
    (r"\[", r"\]", "[", "]"),
    ("{", "}", "{", "}"),
    ('"', '"', '"', '"'),
    ("'", "'", "'", "'"),
  )
)

RULES: dict[str, tuple[Rule, ...]] = {
  # The authors' second WikiText rule is a regex with literal slashes that never matches real
  # text (a no-op), so it is left out.
  "wikitext": (
    ("str", "s '", "s'"),
    ("str", " @-@ ", "-"),
    ("str", " @,@ ", ","),
    ("str", " @.@ ", "."),
    ("str", " : ", ": "),
    ("str", " ; ", "; "),
    ("str", " . ", ". "),
    ("str", " ! ", "! "),
    ("str", " ? ", "? "),
    ("str", " , ", ", "),
    *_BRACKETS,
    ("str", "= = = =", "===="),
    ("str", "= = =", "==="),
    ("str", "= =", "=="),
    ("str", " \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    ("str", " \n", "\n"),
    ("str", "\n ", "\n"),
    ("str", " N ", " 1 "),
    ("str", " 's", "'s"),
  ),
  "ptb": (
    ("str", " 's", "'s"),
    ("str", "s ' ", "s' "),
    ("str", " n't", "n't"),
    ("str", " \n ", "\n"),
    ("str", "\\/", "/"),
    # The authors replace " N " ten times over; a look-around regex covers any run of N's.
    ("re", r"(?<= )N(?= )", "1"),
    ("str", "$ 1", "$1"),
    ("str", "# 1", "#1"),
    ("str", "<unk>", "?"),
  ),
  "lm1b": (
    ("str", "http : / / ", "http://"),
    ("str", "https : / / ", "https://"),
    ("re", r" '(\w+)", r"'\1"),
    ("re", r" (\w+) \. ", r" \1. "),
    ("re", r" (\w+) \.$", r" \1."),
    ("str", " ? ", "? "),
    ("re", r" \?$", "?"),
    ("str", " ! ", "! "),
    ("re", r" !$", "!"),
    ("str", " , ", ", "),
    ("str", " : ", ": "),
    ("str", " ; ", "; "),
    ("str", " / ", "/"),
    ("re", r'" ([^"]+) "', r'"\1"'),
    ("re", r"' ([^']+) '", r"'\1'"),
    ("re", r"\( ([^()]+) \)", r"(\1)"),
    ("re", r"\[ ([^\[\]]+) \]", r"[\1]"),
    ("str", "$ ", "$"),
    ("str", "\N{POUND SIGN} ", "\N{POUND SIGN}"),
  ),
  "lambada": (
    ("str", "\N{LEFT DOUBLE QUOTATION MARK}", '"'),
    ("str", "\N{RIGHT DOUBLE QUOTATION MARK}", '"'),
    ("re", r"\s+$", ""),
    ("re", r"^\s*", "\n"),  # strip, then one leading newline
  ),
}


def detokenize(dataset: str, text: str) -> str:
  """Apply `dataset`'s rules of RULES to `text`, in order."""
  for kind, pattern, replacement in RULES[dataset]:
    if kind == "str":
      text = text.replace(pattern, replacement)
    else:
      text = re.sub(pattern, replacement, text, count=1 if pattern.startswith("^") else 0)
  return text
