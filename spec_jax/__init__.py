"""spec_jax: exact, batched speculative decoding in JAX/Flax.

The three steps of a cycle, each a pure function:
  propose   (drafting.py, drafters.py)  the draft proposes gamma tokens and
                                        their laws q;
  verify    (verification.py)           the target scores them in one pass,
                                        giving p;
  resample  (rules/)                    rejection sampling keeps the output
                                        law exactly p: `resample` (the token
                                        rule) or `resample_block`.
A tree drafter (draft_tree.py, `TreeDrafter`) proposes a tree of drafts
instead; `verify` scores every node in one pass and `resample_tree`
(rules/tree.py) accepts a root-to-node path of it, with the same guarantee.
`generate` (decoding.py) fuses them into one `lax.while_loop`;
`generate_autoregressive` is the baseline built the same way; both decode a
queue of more prompts than rows by refilling finished rows inside the loop
(refill.py). draft_length.py chooses each cycle's draft length from the
rows' acceptance and the measured costs. stats.py holds what a run counts
and every ratio derived from it.

Importing spec_jax loads only what decoding needs: jax, flax, numpy and the
checkpoint readers; the experiment harness lives in experiments/.
"""

from spec_jax import io, rules, sharding, theory, verification
from spec_jax.decoding import (Cycle, DecodeConfig, DecodeResult, PAD_ID,
                               generate, generate_autoregressive, pad_prompts,
                               speculative_cycle, verify_and_resample)
from spec_jax.draft_length import AdaptiveDraftLength, CycleCosts
from spec_jax.draft_tree import TreeTemplate
from spec_jax.drafters import (LayerSkipDrafter, ModelDrafter, NgramDrafter,
                               TreeDrafter, prompt_lookup)
from spec_jax.drafting import Drafter, Proposal, VerifyOutput, propose
from spec_jax.eagle import EagleConfig, EagleDrafter
from spec_jax.io.bundle import ModelBundle
from spec_jax.io.checkpoint import load_model, save_model
from spec_jax.io.eagle3 import load_eagle3, save_eagle3
from spec_jax.io.gguf import load_gguf
from spec_jax.io.hf import load_hf, save_hf
from spec_jax.kv_cache import KVCache
from spec_jax.model import (Model, RopeScaling, Transformer, TransformerConfig,
                            score)
from spec_jax.rules import (acceptance_probs, correction_probs, overlap,
                            resample, resample_block, resample_tree)
from spec_jax.sampling import Sampling
from spec_jax.stats import DecodeStats
from spec_jax.verification import verify

__all__ = [
    "PAD_ID", "AdaptiveDraftLength", "Cycle", "CycleCosts", "DecodeConfig",
    "DecodeResult", "DecodeStats",
    "Drafter", "EagleConfig", "EagleDrafter", "KVCache", "LayerSkipDrafter", "Model", "ModelBundle",
    "ModelDrafter", "NgramDrafter", "Proposal", "RopeScaling", "Sampling",
    "Transformer", "TransformerConfig", "TreeDrafter", "TreeTemplate",
    "VerifyOutput", "acceptance_probs", "correction_probs", "generate",
    "generate_autoregressive", "io", "load_eagle3", "load_gguf", "load_hf",
    "load_model",
    "overlap", "pad_prompts", "prompt_lookup", "propose", "resample",
    "resample_block", "resample_tree", "rules", "save_eagle3", "save_hf",
    "save_model",
    "score", "sharding", "speculative_cycle", "theory", "verification",
    "verify", "verify_and_resample",
]
