"""Decodes the built-in pair on one device and on meshes of 8 CPU devices.

tests/test_sharding.py runs this in a subprocess, because the device count is
fixed when JAX starts and the rest of the suite runs on one device:

  JAX_NUM_CPU_DEVICES=8 python tests/sharded_decode.py --meshes=2x4,1x8 \
      --temperatures=0,1 [--weight_dtype=bfloat16]

Prints one JSON line: per mesh and temperature, whether the tokens equal the
one-device tokens, the target's param bytes, the shardings of its params and
the largest array that a collective of the compiled decode program moves.
"""

import argparse
import json
import re

import jax
import numpy as np

import spec_jax as sj
from spec_jax import decoding, sharding
from spec_jax.io import checkpoint, pretrained

TEXTS = ["def main(argv):\n", "import os\nimport sys\n", "class Foo(object):",
         "    return self.", "for i in range(", "# Copyright 2001", "x = [",
         "if __name__ =="]
# Collectives that move arrays, synchronous or async (`*-start`, whose result
# is a tuple of shapes): in the decode program they may only carry tokens and
# per-row values (such as each shard's best logit for a greedy argmax), never
# parameters or caches. All-reduces and reduce-scatters are left out: they sum
# the partial activations of a model-sharded matmul, as they must.
_COLLECTIVE = re.compile(
    r"= (.*?) (all-gather|all-to-all|collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def largest_move(hlo: str) -> int:
  """Elements of the largest array a moving collective produces."""
  sizes = [int(np.prod([int(d) for d in shape.split(",") if d]))
           for m in _COLLECTIVE.finditer(hlo)
           for shape in _SHAPE.findall(m.group(1))]
  return max(sizes, default=0)


def cache_size(config, prompts, decode_config) -> int:
  """Elements of one layer's keys in the speculative loop."""
  slots = prompts.shape[1] + decode_config.max_new_tokens + decode_config.gamma + 1
  return prompts.shape[0] * config.num_heads * slots * config.head_dim


def decode(target, draft, prompts, lengths, config, mesh):
  """(tokens, HLO text) of one compiled speculative decode."""
  key, prompts, lengths, slots = decoding._place(jax.random.key(7), prompts,
                                                 lengths, mesh, None)
  drafter = sj.ModelDrafter(draft)
  compiled = decoding.generate_jit.lower(key, target, drafter, prompts,
                                         lengths, config, slots).compile()
  result = compiled(key, target, drafter, prompts, lengths)
  return np.asarray(result.tokens), compiled.as_text()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--meshes", default="2x4")
  parser.add_argument("--temperatures", default="0")
  parser.add_argument("--max_new_tokens", type=int, default=12)
  # e.g. bfloat16: both models' matmul weights cast after loading.
  parser.add_argument("--weight_dtype", default=None)
  args = parser.parse_args()
  assert jax.device_count() == 8, jax.device_count()

  def load(mesh=None):
    target, tokenizer = checkpoint.load_model(
        pretrained.resolve("pretrained/target"), mesh, name="target")
    draft, _ = checkpoint.load_model(
        pretrained.resolve("pretrained/draft"), mesh, name="draft")
    if args.weight_dtype:
      target = target.with_weight_dtype(args.weight_dtype)
      draft = draft.with_weight_dtype(args.weight_dtype)
    return target, draft, tokenizer

  target, draft, tokenizer = load()
  unpadded_bytes, _ = sharding.param_bytes(target.params)
  prompts, lengths = sj.pad_prompts([tokenizer.encode(t).ids for t in TEXTS])
  configs = {t: sj.DecodeConfig(gamma=3, max_new_tokens=args.max_new_tokens,
                                sampling=sj.Sampling(temperature=float(t)))
             for t in args.temperatures.split(",")}
  reference = {t: decode(target, draft, prompts, lengths, c, None)[0]
               for t, c in configs.items()}
  report = {}
  for shape in args.meshes.split(","):
    data, model = (int(x) for x in shape.split("x"))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=data, model=model))
    target, draft, _ = load(mesh)
    total, per_device = sharding.param_bytes(target.params)
    specs = jax.tree_util.tree_map_with_path(
        lambda path, x: (sharding._path_name(path), str(x.sharding.spec)),
        target.params)
    entry = {"param_bytes": total, "param_bytes_per_device": per_device,
             "unpadded_param_bytes": unpadded_bytes,
             "num_heads": target.config.num_heads,
             # A gathered parameter or cache would be at least this large.
             "smallest_sharded": min(
                 [x.size for x in jax.tree.leaves((target.params, draft.params))
                  if not x.sharding.is_fully_replicated]
                 + [cache_size(m.config, prompts, config)
                    for m in (target, draft)
                    for config in configs.values()]),
             "specs": dict(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
                 x, tuple))),
             "dtypes": sorted({x.dtype.name
                               for x in jax.tree.leaves(target.params)}),
             "runs": {}}
    for t, config in configs.items():
      tokens, hlo = decode(target, draft, prompts, lengths, config, mesh)
      entry["runs"][t] = {"same_tokens": bool((tokens == reference[t]).all()),
                          "largest_move": largest_move(hlo)}
    report[shape] = entry
  # Tokens each row emitted on one device (no stop id: max_new_tokens each).
  report["reference_lengths"] = {
      t: (tokens != sj.PAD_ID).sum(1).tolist()
      for t, tokens in reference.items()}
  print(json.dumps(report))


if __name__ == "__main__":
  main()
