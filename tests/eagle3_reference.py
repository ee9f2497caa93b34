"""An EAGLE-3 head in numpy, written from the published description
(../shared/eagle3_format.md, SpecForge's and vLLM's layer), independently of
spec_jax/eagle.py, to check it against; and random heads in the published
names, shapes and layouts.

It keeps no cache: each draft reruns the layer over every pair so far under
a causal mask (the layer is causal, so earlier outputs do not change), in
float64.
"""

import json

import numpy as np
import safetensors.numpy


def rms_norm(x, weight, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight


def rotate(x, positions, theta):
  """Rotate-half RoPE of x [T, heads, d] at positions [T]."""
  d = x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
  angles = positions[:, None] * inv_freq  # [T, d/2]
  cos = np.cos(np.concatenate([angles, angles], -1))[:, None]
  sin = np.sin(np.concatenate([angles, angles], -1))[:, None]
  half = d // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


def settings(config: dict) -> dict:
  """The layer's settings from either layout's config.json."""
  layer = config.get("transformer_layer_config", config)
  heads = layer["num_attention_heads"]
  return dict(
      prefix="layers.0." if "transformer_layer_config" in config
      else "midlayer.",
      heads=heads, kv_heads=layer.get("num_key_value_heads", heads),
      head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
      theta=layer.get("rope_theta", 10000.0), eps=layer["rms_norm_eps"],
      norm_before_residual=config.get(
          "norm_before_residual", "transformer_layer_config" in config),
      fc_norm=config.get("fc_norm", False),
      norm_output=config.get("norm_output", True))


def feature_layers(config: dict, num_layers: int) -> list[int]:
  """The target blocks whose inputs the head reads, low to high: the
  config's eagle_aux_hidden_state_layer_ids name block outputs (output i is
  block i + 1's input); without them, blocks 2, L // 2 and L - 3."""
  ids = config.get("eagle_aux_hidden_state_layer_ids")
  if ids is None:
    return sorted({2, num_layers // 2, num_layers - 3})
  return sorted(i + 1 for i in ids)


def layer(w: dict, s: dict, hidden, tokens, table):
  """The decoder layer over pairs (hidden [T, H], tokens [T]) at positions
  0..T-1: (pre-norm outputs [T, H], draft-vocabulary logits [T, K])."""
  p = s["prefix"]
  length = len(tokens)
  embedded = table[tokens]
  normed_hidden = rms_norm(hidden, w[p + "hidden_norm.weight"], s["eps"])
  residual = normed_hidden if s["norm_before_residual"] else hidden
  x = np.concatenate([rms_norm(embedded, w[p + "input_layernorm.weight"],
                               s["eps"]), normed_hidden], -1)
  d, heads, kv_heads = s["head_dim"], s["heads"], s["kv_heads"]
  q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(length, heads, d)
  k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(length, kv_heads, d)
  v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(length, kv_heads, d)
  positions = np.arange(length, dtype=np.float64)
  q, k = rotate(q, positions, s["theta"]), rotate(k, positions, s["theta"])
  causal = np.tril(np.ones((length, length), bool))
  out = np.zeros((length, heads, d))
  for h in range(heads):
    kv = h // (heads // kv_heads)
    scores = q[:, h] @ k[:, kv].T / np.sqrt(d)
    scores = np.where(causal, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out[:, h] = weights @ v[:, kv]
  a = residual + out.reshape(length, -1) @ w[p + "self_attn.o_proj.weight"].T
  n = rms_norm(a, w[p + "post_attention_layernorm.weight"], s["eps"])
  gate = n @ w[p + "mlp.gate_proj.weight"].T
  up = n @ w[p + "mlp.up_proj.weight"].T
  a = a + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
  out = rms_norm(a, w["norm.weight"], s["eps"]) if s["norm_output"] else a
  return a, out @ w["lm_head.weight"].T


def greedy_drafts(tensors: dict, config: dict, features, tokens,
                  target_table, steps: int, wrong: dict | None = None):
  """One row: features [n, F * H_t] (the target's, concatenated low to high)
  over the prompt tokens[:n], tokens [n + 1]. Returns drafts [steps] (target
  ids) and full-vocabulary logits [steps, V], -inf off the draft
  vocabulary. `wrong` overrides settings: a deliberately wrong layer, for
  the negative control."""
  w = {name: np.asarray(t, np.float64) for name, t in tensors.items()}
  s = {**settings(config), **(wrong or {})}
  table = w.get("embed_tokens.weight", target_table)
  vocab = table.shape[0]
  draft_ids = np.asarray(tensors["d2t"]) + np.arange(len(tensors["d2t"]))
  if s["fc_norm"]:  # an RMSNorm per feature layer's chunk
    chunks = np.split(features, len(features[0]) // len(w["fc_norm.0.weight"]),
                      -1)
    features = np.concatenate(
        [rms_norm(chunk, w[f"fc_norm.{i}.weight"], s["eps"])
         for i, chunk in enumerate(chunks)], -1)
  hidden = list(features @ w["fc.weight"].T)
  pair_tokens = list(tokens[1:])  # pair t is (f_t, x_{t+1})
  drafts, all_logits = [], []
  for _ in range(steps):
    a, logits = layer(w, s, np.stack(hidden), np.array(pair_tokens), table)
    full = np.full(vocab, -np.inf)
    full[draft_ids] = logits[-1]
    drafts.append(int(np.argmax(full)))
    all_logits.append(full)
    hidden.append(a[-1])  # the next pair: (own output, the draft)
    pair_tokens.append(drafts[-1])
  return np.array(drafts), np.stack(all_logits)


def random_head(rng, *, hidden_size, target_hidden_size, vocab, draft_vocab,
                heads, kv_heads, intermediate, num_features=3,
                head_dim=None, rope_theta=None, embed_tokens=False,
                speculators=False, norm_before_residual=None,
                fc_norm=False, norm_output=None, aux_layers=None, eps=1e-6):
  """(config.json dict, {name: float32 array}) of a random head in the
  published names and shapes; weights scaled so that the draft's logits
  are spread (argmax margins far above float32 rounding)."""
  d = head_dim or hidden_size // heads
  p = "layers.0." if speculators else "midlayer."
  normal = lambda *shape, scale=1.0: (
      rng.normal(size=shape) * scale / np.sqrt(shape[-1])).astype(np.float32)
  norm = lambda: (1 + 0.1 * rng.normal(size=hidden_size)).astype(np.float32)
  tensors = {
      "fc.weight": normal(hidden_size, num_features * target_hidden_size),
      p + "self_attn.q_proj.weight": normal(heads * d, 2 * hidden_size),
      p + "self_attn.k_proj.weight": normal(kv_heads * d, 2 * hidden_size),
      p + "self_attn.v_proj.weight": normal(kv_heads * d, 2 * hidden_size),
      p + "self_attn.o_proj.weight": normal(hidden_size, heads * d),
      p + "mlp.gate_proj.weight": normal(intermediate, hidden_size),
      p + "mlp.up_proj.weight": normal(intermediate, hidden_size),
      p + "mlp.down_proj.weight": normal(hidden_size, intermediate),
      p + "input_layernorm.weight": norm(),
      p + "hidden_norm.weight": norm(),
      p + "post_attention_layernorm.weight": norm(),
      "norm.weight": norm(),
      "lm_head.weight": normal(draft_vocab, hidden_size, scale=4.0),
  }
  if fc_norm:
    for i in range(num_features):
      # Scales far from 1, so that a missing norm shows.
      tensors[f"fc_norm.{i}.weight"] = (
          (1 + i) * (1 + 0.1 * rng.normal(size=target_hidden_size))
      ).astype(np.float32)
  if embed_tokens:
    tensors["embed_tokens.weight"] = normal(vocab, hidden_size, scale=8.0)
  draft_ids = np.sort(rng.choice(vocab, draft_vocab, replace=False))
  tensors["d2t"] = (draft_ids - np.arange(draft_vocab)).astype(np.int64)
  t2d = np.zeros(vocab, bool)
  t2d[draft_ids] = True
  tensors["t2d"] = t2d
  layer_config = {"hidden_size": hidden_size, "intermediate_size":
                  intermediate, "num_attention_heads": heads,
                  "num_key_value_heads": kv_heads, "rms_norm_eps": eps,
                  "vocab_size": vocab, "num_hidden_layers": 1,
                  "hidden_act": "silu"}
  if head_dim is not None:
    layer_config["head_dim"] = head_dim
  if rope_theta is not None:
    layer_config["rope_theta"] = rope_theta
  if speculators:
    config = {"speculators_model_type": "eagle3",
              "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": layer_config,
              "draft_vocab_size": draft_vocab,
              "target_hidden_size": target_hidden_size}
  else:
    config = dict(layer_config, architectures=["LlamaForCausalLMEagle3"],
                  model_type="llama", draft_vocab_size=draft_vocab)
    if target_hidden_size != hidden_size:
      config["target_hidden_size"] = target_hidden_size
  if norm_before_residual is not None:
    config["norm_before_residual"] = norm_before_residual
  if fc_norm:
    config["fc_norm"] = True
  if norm_output is not None:
    config["norm_output"] = norm_output
  if aux_layers is not None:
    config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
  return config, tensors


def write_head(folder, config: dict, tensors: dict) -> None:
  """The head as a published folder: config.json and model.safetensors."""
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config, indent=2))
  safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"))
