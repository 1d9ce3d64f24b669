"""The paper's runs on OpenWebText (Xue et al., arXiv 2506.19935): `--config=configs/paper.py:NAME`.

The values live in the package (ao_mdm/paper.py), each citing the authors' file it mirrors; NAME
is one of ao_mdm.paper.NAMES (`ao-mdm info --config=configs/paper.py:NAME` prints the sizes):
  ao_small, ao_medium                AO-GPT, mixed(0.9) orders, 1024 x 1024 tokens, 500k steps
  ao_small_random                    pure any-order (the authors' NoCL run, weight decay 0.03)
  ar_small                           L2R baseline on the AO-GPT network
  sigma_small, sigma_medium          sigma-GPT baseline, random orders (as the authors')
  order_small_{order1,order2,order3,l2r,blockwise}   the order study (Fig. 2a): 512 x 1024
                                     tokens, 20k steps of a 500k-step cosine
"""

import ml_collections

from ao_mdm import paper


def get_config(name: str = "ao_small") -> ml_collections.ConfigDict:
  return paper.paper_config(name)
