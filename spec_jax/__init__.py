"""spec_jax: exact, batched speculative decoding in JAX/Flax.

The three steps of a cycle, each a pure function:
  propose   (drafting.py)   the draft proposes gamma tokens and their laws q;
  verify    (decoding.py)   the target scores them in one pass, giving p;
  resample  (rejection.py)  rejection sampling keeps the output law exactly p.
`generate` fuses them into one `lax.while_loop`; `generate_autoregressive` is
the baseline built the same way.
"""

from spec_jax.decoding import (
    PAD_ID,
    DecodeConfig,
    DecodeResult,
    DecodeStats,
    generate,
    generate_autoregressive,
    pad_prompts,
    verify,
)
from spec_jax.drafting import (
    Drafter,
    LayerSkipDrafter,
    ModelDrafter,
    NgramDrafter,
    prompt_lookup,
    propose,
)
from spec_jax.hf import ModelBundle, load_hf, save_hf
from spec_jax.model import (KVCache, Model, RopeScaling, Transformer,
                            TransformerConfig, score)
from spec_jax.rejection import (
    acceptance_probs,
    correction_probs,
    overlap,
    resample,
)
from spec_jax.sampling import Sampling

__all__ = [
    "PAD_ID", "DecodeConfig", "DecodeResult", "DecodeStats", "Drafter",
    "KVCache", "LayerSkipDrafter", "Model", "ModelBundle", "ModelDrafter",
    "NgramDrafter", "RopeScaling", "Sampling", "Transformer",
    "TransformerConfig", "acceptance_probs", "correction_probs", "generate",
    "generate_autoregressive", "load_hf", "overlap", "pad_prompts",
    "prompt_lookup", "propose", "resample", "save_hf", "score", "verify",
]
