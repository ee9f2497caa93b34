"""What an EAGLE head learns from: token sequences and the target's features.

Sequences come from the corpus (windows of the token stream) or from the
target itself (self-distillation, as EAGLE regenerates its data: the head
learns the target's own continuations, which is what it drafts against, not
the corpus's). A chat model replies to instructions; a base model (the
built-in target) continues windows of the corpus. Instructions are made from
the training files of the corpus, the Python standard library:
each function with a docstring gives a "write this function" request, its
source an "explain this code" one, and each module docstring a summarisation
request. Held-out files (data.split_texts) are never used.

The target's features are computed once and cached on disk (`FeatureCache`):
a forward of SmolLM2-135M runs at about 475 tokens/s on the 2-core CPU, while
the head trains several times faster, so a cache lets training take many
passes over data that cost one target forward.
"""

import ast
import dataclasses
import functools
import logging
import pathlib
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import data
from spec_jax import decoding
from spec_jax.bundle import ModelBundle
from spec_jax.model import Model

_log = logging.getLogger(__name__)


def _summary(docstring: str) -> str:
  """The first paragraph of a docstring on one line."""
  return " ".join(docstring.strip().split("\n\n")[0].split())


def _requests(source: str) -> list[str]:
  """Instructions made from one Python file."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return []
  requests = []
  module_doc = ast.get_docstring(tree)
  if module_doc and len(module_doc) > 200:
    requests.append("Summarize this documentation in a few sentences:\n\n"
                    + module_doc[:1500])
  for node in ast.walk(tree):
    if (not isinstance(node, ast.FunctionDef)
        or node.name.startswith(("_", "test"))):
      continue
    doc = ast.get_docstring(node)
    if not doc or len(_summary(doc)) < 30:
      continue
    args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
    requests.append(f"Write a Python function `{node.name}({args})`. "
                    f"{_summary(doc)}")
    code = textwrap.dedent(ast.get_source_segment(source, node, padded=True)
                           or "")
    if 120 < len(code) < 1500:
      requests.append(f"What does this Python code do?\n\n```python\n{code}"
                      "\n```")
  return requests


def instructions(num: int, seed: int, corpus: str = "") -> list[str]:
  """num instructions from the corpus's training files, in a seeded order."""
  files = data.corpus_files(corpus)
  train_texts, _ = data.split_texts(files)
  requests = [r for text in train_texts for r in _requests(text)]
  order = np.random.default_rng(seed).permutation(len(requests))
  return [requests[i] for i in order[:num]]


def _save_sequences(path: pathlib.Path, sequences: list[np.ndarray]) -> None:
  """Variable-length sequences as one .npz (tokens and offsets), atomically."""
  staging = path.with_name(path.stem + ".partial.npz")
  np.savez(staging, tokens=np.concatenate(sequences),
           offsets=np.cumsum([0] + [len(s) for s in sequences]))
  staging.rename(path)


def load_sequences(path) -> list[np.ndarray]:
  with np.load(path) as stored:
    tokens, offsets = stored["tokens"], stored["offsets"]
  return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def chat_prompts(bundle: ModelBundle, requests: list[str]) -> list[list[int]]:
  """Each request as a user turn in the target's chat template."""
  return [bundle.encode_chat([{"role": "user", "content": r}])
          for r in requests]


def corpus_prompts(tokenizer, num: int, length: int, seed: int,
                   corpus: str = "") -> list[list[int]]:
  """num windows of `length` tokens of the corpus's training files: prompts
  for a target without a chat template to continue."""
  return [w.tolist() for w in corpus_sequences(tokenizer, num, length, seed,
                                               corpus)]


def self_distill(bundle: ModelBundle, prompts: list[list[int]], folder, *,
                 max_new_tokens: int, batch_size: int,
                 temperature: float, seed: int) -> list[np.ndarray]:
  """The target's continuations: [prompt + reply] token arrays, one per
  prompt.

  Generated batch_size at a time, longest prompts last so that a batch holds
  similar lengths; each batch is written to folder/batch_NNNN.npz as it
  completes, and a restarted run skips the batches on disk.
  """
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  order = np.argsort([len(p) for p in prompts], kind="stable")
  config = bundle.decode_config(
      max_new_tokens=max_new_tokens,
      sampling=decoding.Sampling(temperature=temperature))
  batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
  start, generated = time.perf_counter(), 0
  for number, rows in enumerate(batches):
    path = folder / f"batch_{number:04d}.npz"
    if path.exists():
      continue
    batch = [prompts[i] for i in rows]
    batch += [batch[-1]] * (batch_size - len(batch))  # one compiled shape
    padded, lengths = decoding.pad_prompts(batch)
    result = decoding.generate_autoregressive(
        jax.random.fold_in(jax.random.key(seed), number), bundle.model, padded, lengths, config)
    tokens, counts = np.asarray(result.tokens), np.asarray(result.num_tokens)
    _save_sequences(path, [
        np.concatenate([batch[row], tokens[row, :counts[row]]]).astype(
            np.int32) for row in range(len(rows))])
    generated += int(counts[:len(rows)].sum())
    rate = generated / (time.perf_counter() - start)
    _log.info("self-distillation: batch %d/%d, %d tokens generated, %.0f "
              "tokens/s", number + 1, len(batches), generated, rate)
  return [s for number in range(len(batches))
          for s in load_sequences(folder / f"batch_{number:04d}.npz")]


def corpus_sequences(tokenizer, num: int, length: int, seed: int,
                     corpus: str = "") -> list[np.ndarray]:
  """num random windows of `length` tokens of the corpus's training files."""
  train_texts, _ = data.split_texts(data.corpus_files(corpus))
  stream = data.encode_corpus(tokenizer, train_texts)
  return list(data.random_windows(stream, num, length,
                                  np.random.default_rng(seed)))


@dataclasses.dataclass(frozen=True)
class FeatureCache:
  """The target's features over [N, T] right-padded sequences, on disk.

  tokens [N, T] int32; lengths [N] int32; hidden [N, T, F, D] float16, the
  inputs of the F feature layers; top_ids [N, T, K] int32 and top_logits
  [N, T, K] float16, the target's K largest logits at each position (its law
  there truncated to them; the first is its argmax).
  """

  tokens: np.ndarray
  lengths: np.ndarray
  hidden: np.ndarray
  top_ids: np.ndarray
  top_logits: np.ndarray

  FIELDS = ("tokens", "lengths", "hidden", "top_ids", "top_logits")

  @classmethod
  def open(cls, path) -> "FeatureCache":
    path = pathlib.Path(path)
    return cls(*(np.load(path / f"{name}.npy", mmap_mode="r")
                 for name in cls.FIELDS))

  def batch(self, rows) -> dict[str, np.ndarray]:
    rows = np.sort(rows)  # memory-mapped reads in file order
    return {name: np.asarray(getattr(self, name)[rows])
            for name in self.FIELDS}


@functools.partial(jax.jit, static_argnames=("layers", "top_k"))
def _features(target: Model, tokens, layers, top_k):
  cache = target.init_cache(tokens.shape[0], tokens.shape[1])
  logits, _, hidden = target.forward(tokens, cache, hidden_layers=layers)
  top_logits, top_ids = jax.lax.top_k(logits, top_k)
  return (jnp.stack(hidden, 2).astype(jnp.float16), top_ids,
          top_logits.astype(jnp.float16))


def extract_features(target: Model, sequences: list[np.ndarray], path, *,
                     layers: tuple[int, ...], length: int, top_k: int,
                     batch_size: int) -> FeatureCache:
  """Runs the target once over every sequence (truncated to `length`) and
  writes a FeatureCache at path, atomically (a staging folder renamed)."""
  path = pathlib.Path(path)
  staging = path.with_name(path.name + ".partial")
  staging.mkdir(parents=True, exist_ok=True)
  num, dim = len(sequences), target.config.d_model
  shapes = {"tokens": ((num, length), np.int32),
            "lengths": ((num,), np.int32),
            "hidden": ((num, length, len(layers), dim), np.float16),
            "top_ids": ((num, length, top_k), np.int32),
            "top_logits": ((num, length, top_k), np.float16)}
  arrays = {name: np.lib.format.open_memmap(staging / f"{name}.npy", "w+",
                                            dtype, shape)
            for name, (shape, dtype) in shapes.items()}
  start = time.perf_counter()
  for first in range(0, num, batch_size):
    rows = range(first, min(first + batch_size, num))
    padded = np.zeros((batch_size, length), np.int32)
    for i, row in enumerate(rows):
      sequence = sequences[row][:length]
      padded[i, :len(sequence)] = sequence
      arrays["lengths"][row] = len(sequence)
    outputs = _features(target, padded, layers, top_k)
    count = len(rows)
    arrays["tokens"][first:first + count] = padded[:count]
    for name, value in zip(("hidden", "top_ids", "top_logits"), outputs):
      arrays[name][first:first + count] = np.asarray(value)[:count]
    rate = (first + count) * length / (time.perf_counter() - start)
    _log.info("features: %d/%d sequences, %.0f tokens/s, ETA %.0f s",
              first + count, num, rate, (num - first - count) * length / rate)
  for array in arrays.values():
    array.flush()
  del arrays
  staging.rename(path)
  return FeatureCache.open(path)
