"""Parity with transformers: the same checkpoint gives the same logits and
greedy continuations in spec_jax and in PyTorch.

Needs torch and transformers (`pip install torch==2.13.0`, then
`pip install -e '.[hf]'`); skipped without them.
"""

import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="parity tests need torch: pip install torch==2.13.0")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers: pip install "
    "-e '.[hf]'")

import spec_jax as sj
from experiments.harness import loading
from spec_jax.io import checkpoint, hf, pretrained

TOKENIZER = pretrained.ROOT / "target" / "tokenizer.json"
VOCAB = 512
# Tiny models with the features of real ones: 6 query heads sharing 2
# key/value heads (3 per group), Llama-3 rope scaling that touches all three
# frequency bands (original_max_position_embeddings 32 with head_dim 16),
# tied and untied embeddings, Qwen2's q/k/v biases.
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
        bos_token_id=None, eos_token_id=None),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0,
                         "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
        bos_token_id=None, eos_token_id=None),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        bos_token_id=None, eos_token_id=None),
}


def _randomize(model, seed):
  """Random weights everywhere, biases and norm scales included: HF's init
  leaves biases at 0 and norm scales at 1, which would hide a misplaced one."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=generator)
      is_norm = "norm" in name or ".ln_" in name or name.endswith("ln_f.weight")
      param.copy_(1 + 0.1 * noise if is_norm and name.endswith("weight")
                  else 0.1 * noise)
  return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_pair(request, tmp_path_factory):
  """(family, HF torch model, folder it is saved in)."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      CONFIGS[request.param](), dtype=torch.float32)
  model = _randomize(model, seed=len(request.param))
  folder = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(folder)
  shutil.copy(TOKENIZER, folder / "tokenizer.json")
  return request.param, model, folder


def _torch_model(folder):
  return transformers.AutoModelForCausalLM.from_pretrained(
      folder, dtype=torch.float32).eval()


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(tokens))).logits.numpy()


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 40))


def test_logits_match_transformers(hf_pair):
  _, torch_model, folder = hf_pair
  bundle = hf.load_hf(folder)
  logits = np.asarray(sj.score(bundle.model, TOKENS))
  np.testing.assert_allclose(logits, _torch_logits(torch_model, TOKENS),
                             atol=1e-4, rtol=0)


def _hf_greedy(model, prompt, max_new_tokens):
  with torch.no_grad():
    output = model.generate(torch.tensor([prompt]), do_sample=False,
                            max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, pad_token_id=0,
                            attention_mask=torch.ones(1, len(prompt), dtype=int))
  return output[0, len(prompt):].tolist()


def test_greedy_continuations_match_transformers(hf_pair):
  _, torch_model, folder = hf_pair
  model = hf.load_hf(folder).model
  prompt = TOKENS[0, :12].tolist()
  config = sj.DecodeConfig(gamma=3, max_new_tokens=16,
                           sampling=sj.Sampling(temperature=0.0))
  prompts, lengths = sj.pad_prompts([prompt])
  ours = sj.generate_autoregressive(jax.random.key(0), model, prompts, lengths,
                                    config)
  assert np.asarray(ours.tokens[0]).tolist() == _hf_greedy(torch_model, prompt,
                                                           16)


def test_speculative_greedy_matches_transformers(tmp_path):
  """A Llama target with a GPT-2 draft (one vocabulary): SD's greedy output is
  the target's, which is transformers' greedy output."""
  folders = {}
  for name in ("llama", "gpt2"):
    torch_model = _randomize(transformers.AutoModelForCausalLM.from_config(
        CONFIGS[name](), dtype=torch.float32), seed=len(name))
    torch_model.save_pretrained(tmp_path / name)
    shutil.copy(TOKENIZER, tmp_path / name / "tokenizer.json")
    folders[name] = tmp_path / name
  target, draft = (bundle.model for bundle in loading.load_pair(
      f"hf:{folders['llama']}", f"hf:{folders['gpt2']}"))
  prompt = TOKENS[1, :12].tolist()
  prompts, lengths = sj.pad_prompts([prompt])
  result = sj.generate(jax.random.key(0), target, sj.ModelDrafter(draft),
                       prompts, lengths,
                       sj.DecodeConfig(gamma=3, max_new_tokens=16,
                                sampling=sj.Sampling(temperature=0.0)))
  assert np.asarray(result.tokens[0]).tolist() == _hf_greedy(
      _torch_model(folders["llama"]), prompt, 16)


def test_export_round_trip_matches_transformers(tmp_path):
  """The built-in draft, exported to HF format, gives the same logits in
  transformers; a Llama-family spec_jax model too."""
  draft, tokenizer = checkpoint.load_model(pretrained.ROOT / "draft")
  llama = sj.Model.init(sj.TransformerConfig(
      vocab_size=VOCAB, d_model=96, num_layers=2, num_heads=6, num_kv_heads=2,
      d_ff=160, max_len=128, norm="rms", position="rope", mlp="swiglu",
      qkv_bias=False, bias=False, tie_embeddings=False, rope_theta=500_000.0,
      rope_scaling=sj.RopeScaling(factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_len=32)),
      jax.random.key(0))
  for name, model in (("draft", draft), ("llama", llama)):
    hf.save_hf(tmp_path / name, model, tokenizer)
    np.testing.assert_allclose(
        _torch_logits(_torch_model(tmp_path / name), TOKENS),
        np.asarray(sj.score(model, TOKENS)), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compare_hf_benchmark_runs(tmp_path):
  from configs import compare_hf as compare_hf_configs
  from experiments.harness import compare_hf
  report = compare_hf.compare(compare_hf_configs.get_config("runlocal"),
                              tmp_path)
  greedy = report["rows"][0]
  assert greedy["greedy_rows_equal_to_hf_plain"]["sd"] == 1.0
  assert greedy["hf_assisted"]["target_passes"] > 0
  assert "error" in report["rows"][1]["hf_assisted"]  # batch 2
