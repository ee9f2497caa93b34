"""What EAGLE heads learn from: the target's features recorded while it
generates (self-distillation), resumable, and requests the target writes
itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from experiments.harness import eagle_data
from spec_jax.io import checkpoint, pretrained
from spec_jax.io.bundle import ModelBundle

LAYERS = (2, 4, 6)
PROMPTS = [[5, 9, 11, 3, 7, 2], [40], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8],
           [100, 200, 300], [17, 71, 17, 71, 17]]
SETTINGS = dict(layers=LAYERS, length=32, top_k=8, max_new_tokens=12,
                batch_size=2, temperature=0.0, seed=0)
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>"
            "{% endif %}")


@pytest.fixture(scope="module")
def bundle():
  """The built-in target, stopping at its most common greedy token after
  these prompts, so that some replies end early and some run to the limit."""
  model, tokenizer = checkpoint.load_model(pretrained.ROOT / "target")
  padded, lengths = sj.pad_prompts(PROMPTS)
  greedy = np.asarray(sj.generate_autoregressive(
      jax.random.key(0), model, padded, lengths,
      sj.DecodeConfig(max_new_tokens=12,
                      sampling=sj.Sampling(temperature=0))).tokens)
  stop = int(np.bincount(greedy.ravel()).argmax())
  return ModelBundle(model, tokenizer, stop, TEMPLATE)


@pytest.fixture(scope="module")
def distilled(bundle, tmp_path_factory):
  return eagle_data.distill_features(
      bundle, PROMPTS, tmp_path_factory.mktemp("distill") / "features",
      **SETTINGS)


def test_distilled_rows_are_greedy_replies_with_the_forward_features(
    bundle, distilled):
  prompts = sorted(PROMPTS, key=len)  # the rows' order
  padded, lengths = sj.pad_prompts(prompts)
  greedy = sj.generate_autoregressive(
      jax.random.key(0), bundle.model, padded, lengths,
      sj.DecodeConfig(eos_id=bundle.stop_ids or None, max_new_tokens=12,
                      sampling=sj.Sampling(temperature=0)))
  logits, _, hidden = bundle.model.forward(
      jnp.asarray(distilled.tokens),
      bundle.model.init_cache(*distilled.tokens.shape), hidden_layers=LAYERS)
  hidden = np.stack(hidden, 2)
  top_logits, top_ids = jax.lax.top_k(logits, 8)
  stopped = 0
  for row, prompt in enumerate(prompts):
    reply = np.asarray(greedy.tokens[row, :greedy.num_tokens[row]])
    length, start = distilled.lengths[row], distilled.loss_from[row]
    stopped += reply[-1] == bundle.eos_id
    np.testing.assert_array_equal(distilled.tokens[row, :length],
                                  np.concatenate([prompt, reply]))
    assert start == len(prompt) - 1
    np.testing.assert_allclose(distilled.hidden[row, :length],
                               hidden[row, :length], rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(distilled.top_ids[row, start:length],
                                  top_ids[row, start:length])
    np.testing.assert_allclose(distilled.top_logits[row, start:length],
                               top_logits[row, start:length], atol=2e-2)
    assert not distilled.top_ids[row, :start].any()  # never written
  assert 0 < stopped < len(prompts)  # both ends of a reply are exercised


def _raise_on_second_call(function):
  calls = []

  def wrapped(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return function(*args, **kwargs)
  return wrapped, calls


def _interrupt_after_one_batch(bundle, path, monkeypatch) -> list:
  """Distills into path and stops at the second batch, as a Ctrl-C would;
  returns the list that counts the decode calls from then on."""
  interrupted, calls = _raise_on_second_call(
      eagle_data._decode_with_features)  # pylint: disable=protected-access
  monkeypatch.setattr(eagle_data, "_decode_with_features", interrupted)
  with pytest.raises(KeyboardInterrupt):
    eagle_data.distill_features(bundle, PROMPTS, path, **SETTINGS)
  return calls


def test_distillation_resumes_after_the_last_batch_written(
    bundle, distilled, tmp_path, monkeypatch):
  calls = _interrupt_after_one_batch(bundle, tmp_path / "features",
                                     monkeypatch)
  assert not (tmp_path / "features").exists()  # only whole caches there
  resumed = eagle_data.distill_features(bundle, PROMPTS,
                                        tmp_path / "features", **SETTINGS)
  assert len(calls) == 4  # 3 batches: one done, one interrupted, two after
  for name in eagle_data.FeatureCache.FIELDS:
    np.testing.assert_array_equal(getattr(resumed, name),
                                  getattr(distilled, name))


def test_a_changed_config_is_not_resumed_into(bundle, tmp_path, monkeypatch):
  _interrupt_after_one_batch(bundle, tmp_path / "features", monkeypatch)
  with pytest.raises(ValueError, match="Delete the folder"):
    eagle_data.distill_features(bundle, PROMPTS, tmp_path / "features",
                                **dict(SETTINGS, top_k=4))


def test_a_cache_of_other_layers_is_refused(bundle, tmp_path, monkeypatch):
  """A finished cache opens only for the layers it holds; a staging folder
  resumes only for them."""
  path = tmp_path / "features"
  eagle_data.distill_features(bundle, PROMPTS, path, **SETTINGS)
  eagle_data.FeatureCache.open(path, SETTINGS["layers"])
  other = tuple(reversed(SETTINGS["layers"]))
  with pytest.raises(ValueError, match="holds the inputs of blocks"):
    eagle_data.FeatureCache.open(path, other)
  _interrupt_after_one_batch(bundle, tmp_path / "staged", monkeypatch)
  with pytest.raises(ValueError, match="features of other blocks"):
    eagle_data.distill_features(bundle, PROMPTS, tmp_path / "staged",
                                **dict(SETTINGS, layers=other))


def test_prompts_too_long_for_the_cache_are_refused(bundle, tmp_path):
  with pytest.raises(ValueError, match="raise seq_len"):
    eagle_data.distill_features(bundle, [list(range(30))],
                                tmp_path / "features", **SETTINGS)


def test_user_requests_continue_the_user_header_and_resume(
    bundle, tmp_path, monkeypatch):
  generate, prompts = eagle_data.decoding.generate_autoregressive, []

  def spy(key, model, padded, lengths, config):
    prompts.extend(p[:n].tolist() for p, n in zip(padded, lengths))
    return generate(key, model, padded, lengths, config)

  monkeypatch.setattr(eagle_data.decoding, "generate_autoregressive", spy)
  requests = eagle_data.user_requests(bundle, 6, tmp_path, max_tokens=8,
                                      batch_size=4, seed=0)
  assert len(requests) == len(set(requests)) == 6
  assert all(r and r == r.strip() for r in requests)
  # The template cut where the user's text starts: "<|user|>".
  header = bundle.tokenizer.encode("<|user|>", add_special_tokens=False).ids
  assert prompts and all(p == header for p in prompts)
  monkeypatch.setattr(eagle_data.decoding, "generate_autoregressive",
                      lambda *a, **k: pytest.fail("regenerated"))
  assert eagle_data.user_requests(bundle, 6, tmp_path, max_tokens=8,
                                  batch_size=4, seed=0) == requests
