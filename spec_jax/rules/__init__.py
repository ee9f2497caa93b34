"""The verification rules: which drafts a cycle keeps, and what it emits next.

Each rule takes the drafts, their laws q and the target's laws p (from
`verification.verify`) and returns the emitted tokens, with an output law
exactly the target's:
  resample        token.py  the token rule: accept d_i with min(1, p/q),
                            correct from norm(max(0, p - q));
  resample_block  block.py  block verification (Sun et al., 2024), the same
                            contract, accepting at least as many drafts;
  resample_tree   tree.py   recursive rejection sampling over a draft tree.
`DecodeConfig(resample=...)` chooses a chain's rule; any function with
`resample`'s contract fits there.

Each module's `outcome(uniform, ...)` is its rule with the acceptance draws
as an input: it returns how many drafts are kept (and, for a tree, which
path) and the law of the token emitted next. The rule draws the uniforms
from its key and one token from that law; the enumeration tests run
`outcome` on every cell of the uniforms to compute the rule's exact law.
"""

from spec_jax.rules.block import resample_block
from spec_jax.rules.token import (acceptance_probs, correction_probs,
                                  draft_token_probs, overlap,
                                  point_mass_acceptance, resample)
from spec_jax.rules.tree import UNUSED, resample_tree, tree_depth

__all__ = [
    "UNUSED", "acceptance_probs", "correction_probs", "draft_token_probs",
    "overlap", "point_mass_acceptance", "resample", "resample_block",
    "resample_tree", "tree_depth",
]
