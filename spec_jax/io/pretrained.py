"""The built-in pair: an 11M target and a 0.5M draft trained on the Python
standard library (configs/train.py), shipped as model directories."""

import pathlib

import tokenizers

from spec_jax.io import checkpoint
from spec_jax.model import Model

# The data sits in spec_jax/pretrained/, beside the package code.
ROOT = pathlib.Path(__file__).parents[1] / "pretrained"
# End of text in the built-in byte-level BPE vocabulary.
EOS = "<|endoftext|>"


def resolve(path: str) -> pathlib.Path:
  """'pretrained/NAME' is the built-in model NAME; anything else a path."""
  if path.startswith("pretrained/"):
    return ROOT / path.split("/", 1)[1]
  return pathlib.Path(path)


def load(name: str) -> tuple[Model, tokenizers.Tokenizer]:
  """The built-in model NAME ("target" or "draft") and its tokenizer."""
  return checkpoint.load_model(ROOT / name, name=name)
