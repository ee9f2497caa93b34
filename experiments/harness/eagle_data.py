"""What an EAGLE head learns from: token sequences and the target's features.

Sequences come from the corpus (windows of the token stream) or from the
target itself (self-distillation, as EAGLE regenerates its data: the head
learns the target's own continuations, which is what it drafts against, not
the corpus's). A chat model replies to instructions; a base model (the
built-in target) continues windows of the corpus. Instructions are of two
kinds:
- the target's own user turns (Magpie, Xu et al. 2024): sampled from its
  chat template cut after the user header, so they follow the requests the
  model was tuned on (chat, advice, writing, questions);
- made from the training files of the corpus, the Python standard library:
  each function with a docstring gives a "write this function" request, its
  source an "explain this code" one, and each module docstring a
  summarisation request. Held-out files (data.split_texts) are never used.

The target's features are cached on disk (`FeatureCache`): a forward of
SmolLM2-135M runs at about 475 tokens/s on the 2-core CPU, while the head
trains several times faster, so a cache lets training take many passes over
data that cost one target forward. Self-distillation records them while it
generates (`distill_features`): the decode steps compute every feature and
logit of the reply anyway, which halves the data stage's cost against
generating and then running the target over the result.
"""

import ast
import dataclasses
import functools
import json
import logging
import pathlib
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import data, records
from spec_jax import decoding
from spec_jax.io.bundle import ModelBundle
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


def user_requests(bundle: ModelBundle, num: int, folder, *, max_tokens: int,
                  batch_size: int, seed: int) -> list[str]:
  """num distinct user requests that the target writes itself (Magpie).

  The chat template is cut where the user's text would start, and the
  target continues it at T=1, Magpie's setting (a top-p sorts the
  vocabulary at every step: SmolLM2's requests took 4x as long with one).
  What it writes is a request like those it was tuned on. Requests it did
  not end within max_tokens are kept as cut; empty and repeated ones are
  dropped. Each batch is written to folder/batch_NNNN.json, and a restarted
  run skips those on disk.
  """
  marker = "\x00"
  template = bundle.apply_chat_template([{"role": "user", "content": marker}],
                                        add_generation_prompt=False)
  header = bundle.tokenizer.encode(template[:template.index(marker)],
                                   add_special_tokens=False).ids
  padded, lengths = decoding.pad_prompts([header] * batch_size)
  config = decoding.DecodeConfig(
      eos_id=bundle.stop_ids or None, max_new_tokens=max_tokens,
      sampling=decoding.Sampling(temperature=1.0))
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  requests, number = {}, 0
  while len(requests) < num:
    path = folder / f"batch_{number:04d}.json"
    if not path.exists():
      result = decoding.generate_autoregressive(
          jax.random.fold_in(jax.random.key(seed), number), bundle.model,
          padded, lengths, config)
      tokens, counts = np.asarray(result.tokens), np.asarray(result.num_tokens)
      records.write_json(path, [
          bundle.tokenizer.decode(tokens[row, :counts[row]].tolist())
          for row in range(batch_size)])
    for text in json.loads(path.read_text()):
      if text.strip():
        requests.setdefault(text.strip())
    number += 1
    _log.info("user requests: %d/%d", min(len(requests), num), num)
  return list(requests)[:num]


@functools.partial(jax.jit, static_argnames=("layers", "top_k", "num_steps",
                                             "length", "sampling"))
def _decode_with_features(target: Model, key, prompts, prompt_lengths, *,
                          layers, top_k, num_steps, length, sampling):
  """Decodes num_steps tokens after right-padded prompts [B, P], keeping
  what the target computes on the way.

  Returns the prompts' features [B, P, F, D] (from the prefill) and, for
  decode step i (which feeds the token at position prompt_length - 1 + i),
  the token it emits [B, S], its features [B, S, F, D], and its top_k
  logits and their ids [B, S, K].
  """
  cache, prompt_hidden = target.prefill_with_hidden(
      prompts, prompt_lengths, length, hidden_layers=layers)
  last = jnp.take_along_axis(prompts, prompt_lengths[:, None] - 1, 1)[:, 0]

  def step(carry, key):
    cache, token = carry
    logits, cache, hidden = target.forward(token[:, None], cache,
                                           hidden_layers=layers)
    logits = logits[:, 0]
    top_logits, top_ids = jax.lax.top_k(logits, top_k)
    token = sampling.sample(key, sampling.probs(logits))
    return (cache, token), (token, jnp.stack(hidden, 2)[:, 0], top_ids,
                            top_logits)

  _, (tokens, hidden, top_ids, top_logits) = jax.lax.scan(
      step, (cache, last), jax.random.split(key, num_steps))
  by_row = lambda x: jnp.moveaxis(x, 0, 1)
  return (jnp.stack(prompt_hidden, 2).astype(jnp.float16), by_row(tokens),
          by_row(hidden).astype(jnp.float16), by_row(top_ids),
          by_row(top_logits).astype(jnp.float16))


def distill_features(bundle: ModelBundle, prompts: list[list[int]], path, *,
                     layers: tuple[int, ...], length: int, top_k: int,
                     max_new_tokens: int, batch_size: int, temperature: float,
                     seed: int) -> "FeatureCache":
  """Self-distillation: the target's replies to `prompts`, with its features
  over prompt and reply, as a FeatureCache at path.

  A row is a prompt and up to max_new_tokens of its reply (to the first
  stop token); its loss_from is the prompt's last token, the first whose
  prediction is part of the reply. Prompts longer than
  length - max_new_tokens are dropped. Batches (shortest prompts first)
  go into a staging folder as they complete; a restarted run resumes after
  the last one written, and the folder is renamed to path at the end.
  """
  limit = length - max_new_tokens  # the last step feeds position length - 1
  prompts = sorted((p for p in prompts if len(p) <= limit), key=len)
  if not prompts:
    raise ValueError(f"no prompt fits in {limit} tokens: raise seq_len or "
                     "lower max_new_tokens.")
  staging = _Staging(path, len(prompts), length, layers,
                     bundle.model.config.d_model, top_k)
  sampling = decoding.Sampling(temperature=temperature)
  stop_ids = np.asarray(bundle.stop_ids or (-1,))
  start, generated, resumed_at = time.perf_counter(), 0, staging.rows_done
  for first in range(resumed_at, len(prompts), batch_size):
    batch = prompts[first:first + batch_size]
    rows = len(batch)
    batch += [batch[-1]] * (batch_size - rows)  # one compiled shape
    padded, lengths = decoding.pad_prompts(batch)
    # One step past the longest reply scores the reply's last token too.
    prompt_hidden, tokens, hidden, top_ids, top_logits = (
        np.asarray(x) for x in _decode_with_features(
            bundle.model, jax.random.fold_in(jax.random.key(seed), first),
            padded, lengths, layers=layers, top_k=top_k,
            num_steps=max_new_tokens + 1, length=length, sampling=sampling))
    for i in range(rows):
      stops = np.flatnonzero(np.isin(tokens[i, :max_new_tokens], stop_ids))
      reply = stops[0] + 1 if len(stops) else max_new_tokens
      staging.write(
          first + i,
          np.concatenate([padded[i, :lengths[i]], tokens[i, :reply]]),
          np.concatenate([prompt_hidden[i, :lengths[i] - 1],
                          hidden[i, :reply + 1]]),
          top_ids[i, :reply + 1], top_logits[i, :reply + 1],
          loss_from=lengths[i] - 1)
      generated += reply
    staging.commit(first + rows)
    rate = generated / (time.perf_counter() - start)
    done = first + rows - resumed_at
    _log.info("self-distillation: %d/%d replies, %d tokens generated, %.0f "
              "tokens/s, ETA %.0f s", first + rows, len(prompts), generated,
              rate, (len(prompts) - first - rows) * generated / done / rate)
  return staging.finish()


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

  tokens [N, T] int32; lengths [N] int32; loss_from [N] int32, the first
  position the head is trained to predict from (0 for corpus windows; a
  reply's first token's predecessor for self-distilled rows, so that the
  loss is on the target's replies, not on the prompts); hidden [N, T, F, D]
  float16, the inputs of the F feature layers; top_ids [N, T, K] int32 and
  top_logits [N, T, K] float16, the target's K largest logits at each
  position from loss_from (its law there truncated to them; the first is
  its argmax). layers.json beside them names the feature layers.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  loss_from: np.ndarray
  hidden: np.ndarray
  top_ids: np.ndarray
  top_logits: np.ndarray

  FIELDS = ("tokens", "lengths", "loss_from", "hidden", "top_ids",
            "top_logits")

  @staticmethod
  def layout(num: int, length: int, num_layers: int, dim: int,
             top_k: int) -> dict[str, tuple[tuple[int, ...], type]]:
    """Each field's shape and dtype."""
    return {"tokens": ((num, length), np.int32),
            "lengths": ((num,), np.int32),
            "loss_from": ((num,), np.int32),
            "hidden": ((num, length, num_layers, dim), np.float16),
            "top_ids": ((num, length, top_k), np.int32),
            "top_logits": ((num, length, top_k), np.float16)}

  @classmethod
  def open(cls, path, layers: tuple[int, ...]) -> "FeatureCache":
    """The cache at path, which must hold the features of `layers`.

    Raises:
      ValueError: it holds other layers' (made for another head config).
    """
    path = pathlib.Path(path)
    stored = json.loads((path / "layers.json").read_text())
    if tuple(stored) != tuple(layers):
      raise ValueError(
          f"the feature cache at {path} holds the inputs of blocks "
          f"{tuple(stored)}, but the head reads {tuple(layers)}; use another "
          "workdir, or delete the cache to make it again.")
    return cls(*(np.load(path / f"{name}.npy", mmap_mode="r")
                 for name in cls.FIELDS))

  def batch(self, rows) -> dict[str, np.ndarray]:
    rows = np.sort(rows)  # memory-mapped reads in file order
    return {name: np.asarray(getattr(self, name)[rows])
            for name in self.FIELDS}


class _Staging:
  """A FeatureCache being written, row by row: memory-mapped arrays in
  path.partial, and progress.json with the rows written so far, so that an
  interrupted writer resumes after them. `finish` renames the folder to
  path, so a FeatureCache at path is always whole."""

  def __init__(self, path, num: int, length: int, layers: tuple[int, ...],
               dim: int, top_k: int):
    self.path, self.layers = pathlib.Path(path), tuple(layers)
    self.folder = self.path.with_name(self.path.name + ".partial")
    self.folder.mkdir(parents=True, exist_ok=True)
    num_layers = len(layers)
    progress = self.folder / "progress.json"
    self.rows_done = (json.loads(progress.read_text())["rows"]
                      if progress.exists() else 0)
    layers_file = self.folder / "layers.json"
    if self.rows_done and tuple(json.loads(
        layers_file.read_text())) != self.layers:
      raise ValueError(
          f"{self.folder} holds the features of other blocks than "
          f"{self.layers}: the config changed since it was started. Delete "
          "the folder to start over.")
    records.write_json(layers_file, list(self.layers))
    self.arrays = {}
    for name, (shape, dtype) in FeatureCache.layout(
        num, length, num_layers, dim, top_k).items():
      file = self.folder / f"{name}.npy"
      if self.rows_done:
        array = np.lib.format.open_memmap(file, "r+")
        if array.shape != shape or array.dtype != dtype:
          raise ValueError(
              f"{self.folder} holds {name} {array.shape} {array.dtype}, not "
              f"{shape} {np.dtype(dtype)}: the config changed since it was "
              "started. Delete the folder to start over.")
      else:
        array = np.lib.format.open_memmap(file, "w+", dtype, shape)
      self.arrays[name] = array

  def write(self, row: int, tokens, hidden, top_ids, top_logits,
            loss_from: int = 0) -> None:
    """Row `row`: tokens [L], hidden [L, F, D], and top_ids and top_logits
    [L - loss_from, K] of positions loss_from..L-1."""
    length = len(tokens)
    self.arrays["tokens"][row, :length] = tokens
    self.arrays["lengths"][row] = length
    self.arrays["loss_from"][row] = loss_from
    self.arrays["hidden"][row, :length] = hidden
    self.arrays["top_ids"][row, loss_from:length] = top_ids
    self.arrays["top_logits"][row, loss_from:length] = top_logits

  def commit(self, rows_done: int) -> None:
    """Rows below rows_done are on disk."""
    for array in self.arrays.values():
      array.flush()
    records.write_json(self.folder / "progress.json", {"rows": rows_done})

  def finish(self) -> FeatureCache:
    for array in self.arrays.values():
      array.flush()
    self.arrays = {}
    (self.folder / "progress.json").unlink(missing_ok=True)
    self.folder.rename(self.path)
    return FeatureCache.open(self.path, self.layers)


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
  writes a FeatureCache at path (resuming after the last batch written)."""
  num = len(sequences)
  staging = _Staging(path, num, length, layers, target.config.d_model,
                     top_k)
  start, resumed_at = time.perf_counter(), staging.rows_done
  for first in range(resumed_at, num, batch_size):
    rows = range(first, min(first + batch_size, num))
    padded = np.zeros((batch_size, length), np.int32)
    for i, row in enumerate(rows):
      sequence = sequences[row][:length]
      padded[i, :len(sequence)] = sequence
    hidden, top_ids, top_logits = (
        np.asarray(x) for x in _features(target, padded, layers, top_k))
    for i, row in enumerate(rows):
      n = min(len(sequences[row]), length)
      staging.write(row, padded[i, :n], hidden[i, :n], top_ids[i, :n],
                    top_logits[i, :n])
    staging.commit(rows.stop)
    rate = (rows.stop - resumed_at) * length / (time.perf_counter() - start)
    _log.info("features: %d/%d sequences, %.0f tokens/s, ETA %.0f s",
              rows.stop, num, rate, (num - rows.stop) * length / rate)
  return staging.finish()
