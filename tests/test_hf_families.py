"""Parity with transformers for the families beyond GPT-2/Llama/Qwen2: Qwen3,
Mistral, Gemma 2 and Gemma 3, on tiny random models whose sliding window is
shorter than the sequence, so that the window mask matters.

Needs torch and transformers; skipped without them.
"""

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="parity tests need torch: pip install torch==2.13.0")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers: pip install "
    "-e '.[hf]'")

import spec_jax as sj
from spec_jax.io import hf
from test_hf_parity import TOKENIZER, VOCAB, _randomize, _torch_logits

WINDOW = 7  # Shorter than the 40-token sequences.
# 6 query heads over 2 key/value heads; head_dim 32 with hidden 96, so that
# heads * head_dim != hidden as in the real Qwen3 and Gemma 3.
SIZES = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160,
             num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=128, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(
        **SIZES, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    "mistral": lambda: transformers.MistralConfig(
        **SIZES, sliding_window=WINDOW, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    # Sliding, global, sliding; soft-capping of scores and logits.
    "gemma2": lambda: transformers.Gemma2Config(
        **SIZES, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # Global layer 1 with linear rope scaling, local layers with their base.
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **SIZES, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0,
                               "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": 10_000.0}}),
}
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, 40))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_pair(request, tmp_path_factory):
  """(family, HF torch model, folder it is saved in)."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      CONFIGS[request.param](), dtype=torch.float32,
      attn_implementation="eager")
  model = _randomize(model, seed=len(request.param))
  folder = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(folder)
  (folder / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
  return request.param, model, folder


def test_logits_match_transformers(hf_pair):
  family, torch_model, folder = hf_pair
  model = hf.load_hf(folder).model
  assert hf.family_of(model.config).model_type == family
  np.testing.assert_allclose(np.asarray(sj.score(model, TOKENS)),
                             _torch_logits(torch_model, TOKENS),
                             atol=1e-4, rtol=0)


def test_incremental_decoding_matches_full_scoring(hf_pair):
  """Past the window, a cached step must mask the same keys as a full pass."""
  model = hf.load_hf(hf_pair[2]).model
  cache = model.init_cache(2, 48)
  first, cache = model(TOKENS[:, :25], cache)
  steps = [first]
  for t in range(25, 40):
    logits, cache = model(TOKENS[:, t:t + 1], cache)
    steps.append(logits)
  # Logits of order 3 (Gemma's are not capped): float32 rounding of other
  # matmul shapes reaches 1.5e-5.
  np.testing.assert_allclose(np.concatenate(steps, 1),
                             sj.score(model, TOKENS), atol=5e-5)


def test_export_round_trip_matches_transformers(hf_pair, tmp_path):
  """save_hf writes a folder transformers reads into the same model."""
  family, torch_model, folder = hf_pair
  bundle = hf.load_hf(folder)
  hf.save_hf(tmp_path, bundle.model, bundle.tokenizer)
  reread = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
  assert reread.config.model_type == family
  np.testing.assert_allclose(_torch_logits(reread, TOKENS),
                             _torch_logits(torch_model, TOKENS),
                             atol=1e-5, rtol=0)
