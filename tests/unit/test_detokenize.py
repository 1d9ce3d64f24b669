"""Detokenizers: every rule of every table on a hand-written input with its expected output."""

import pytest

from ao_mdm.data.detokenize import RULES, detokenize

CASES = {  # one (input, expected) per rule, in table order
  "wikitext": [
    ("the players ' union", "the players' union"),
    ("a 2 @-@ 1 win", "a 2-1 win"),
    ("1 @,@ 000 men", "1,000 men"),
    ("3 @.@ 5 m", "3.5 m"),
    ("note : this", "note: this"),
    ("one ; two", "one; two"),
    ("end . Next", "end. Next"),
    ("stop ! Go", "stop! Go"),
    ("who ? Me", "who? Me"),
    ("red , blue", "red, blue"),
    ("a ( b c ) d", "a (b c) d"),
    ("a [ b ] d", "a [b] d"),
    ("a { b } d", "a {b} d"),
    ('he said " yes " then', 'he said "yes" then'),
    ("the ' Hunter ' album", "the 'Hunter' album"),
    ("= = = = Notes = = = =", "==== Notes ===="),
    ("= = = Notes = = =", "=== Notes ==="),
    ("= = Notes = =", "== Notes =="),
    ("40 \N{DEGREE SIGN} C", "40\N{DEGREE SIGN}C"),
    ("line \nnext", "line\nnext"),
    ("line\n next", "line\nnext"),
    ("about N people", "about 1 people"),
    ("John 's car", "John's car"),
  ],
  "ptb": [
    ("john 's car", "john's car"),
    ("the players ' union", "the players' union"),
    ("do n't go", "don't go"),
    ("end \n next", "end\nnext"),
    ("and\\/or", "and/or"),
    ("from N N N to N", "from 1 1 1 to N"),
    ("$ 1 million", "$1 million"),
    ("# 1 seed", "#1 seed"),
    ("the <unk> firm", "the ? firm"),
  ],
  "lm1b": [
    ("see http : / / x.org", "see http://x.org"),
    ("see https : / / x.org", "see https://x.org"),
    ("it 's John 's", "it's John's"),
    ("at home . Then", "at home. Then"),
    ("at home .", "at home."),
    ("why ? Because", "why? Because"),
    ("really ?", "really?"),
    ("stop ! Now", "stop! Now"),
    ("wow !", "wow!"),
    ("red , blue", "red, blue"),
    ("note : this", "note: this"),
    ("one ; two", "one; two"),
    ("and / or", "and/or"),
    ('he said " hi there " to', 'he said "hi there" to'),
    ("the ' x y ' band", "the 'x y' band"),
    ("a ( b c ) d", "a (b c) d"),
    ("a [ b c ] d", "a [b c] d"),
    ("$ 5", "$5"),
    ("\N{POUND SIGN} 5", "\N{POUND SIGN}5"),
  ],
  "lambada": [
    ("\N{LEFT DOUBLE QUOTATION MARK}hi", '\n"hi'),
    ("hi\N{RIGHT DOUBLE QUOTATION MARK}", '\nhi"'),
    ("end of text  \n", "\nend of text"),
    ("  start", "\nstart"),
  ],
}


@pytest.mark.parametrize("dataset", sorted(RULES))
def test_every_rule_has_a_case_and_each_case_holds(dataset):
  assert len(CASES[dataset]) == len(RULES[dataset])
  for text, expected in CASES[dataset]:
    assert detokenize(dataset, text) == expected, text


def test_a_wikitext_paragraph():
  text = " = Valkyria Chronicles III = \n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場のヴァルキュリア3 ) , commonly referred to as Valkyria Chronicles III outside Japan , is a tactical role @-@ playing video game . \n"  # noqa: E501  (one WikiText line as it is)
  assert detokenize("wikitext", text) == (
    " = Valkyria Chronicles III =\nSenjō no Valkyria 3: Unrecorded Chronicles (Japanese: "
    "戦場のヴァルキュリア3), commonly referred to as Valkyria Chronicles III outside Japan, is a "
    "tactical role-playing video game.\n"
  )
