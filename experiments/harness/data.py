"""The corpus: real text on every machine, split by file, tokenized.

By default the corpus is the Python standard library's own source, which every
Python installation carries: code completion is a standard benchmark for
speculative decoding (HumanEval in Chen et al. 2023). Any text file or folder
can be used instead.
"""

import os
import pathlib
import sysconfig
import zlib

import numpy as np
import tokenizers

from spec_jax.io.pretrained import EOS


def corpus_files(source: str = "") -> list[pathlib.Path]:
  """Sorted text files of the corpus.

  Args:
    source: "" for the standard library's .py files (without site-packages), a
      folder (every .py, .txt and .md file below it) or one text file.
  """
  if not source:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if "site-packages" not in f.parts]
  else:
    root = pathlib.Path(source)
    if not root.exists():
      raise FileNotFoundError(f"corpus source {source!r} does not exist.")
    files = [root] if root.is_file() else [
        f for f in root.rglob("*") if f.suffix in (".py", ".txt", ".md")]
  if not files:
    raise ValueError(f"no text files found in {root}.")
  return sorted(files)


def _file_hashes(files) -> list[int]:
  """Hashes of paths relative to the corpus root, the same on every machine."""
  root = pathlib.Path(os.path.commonpath(files))
  return [zlib.crc32(f.relative_to(root).as_posix().encode()) for f in files]


def split_texts(files, heldout_percent: int = 5):
  """(train texts, held-out texts), split deterministically.

  Files are held out by a stable hash of their path in the corpus, so the split never moves
  and no held-out file leaks into training. A corpus with no file held out by
  the hash holds out the file of smallest hash; a one-file corpus holds out
  its last heldout_percent of lines.
  """
  texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
  if len(files) == 1:
    lines = texts[0].splitlines(keepends=True)
    cut = len(lines) - max(1, len(lines) * heldout_percent // 100)
    return ["".join(lines[:cut])], ["".join(lines[cut:])]
  hashes = _file_hashes(files)
  heldout = [h % 100 < heldout_percent for h in hashes]
  if not any(heldout):
    heldout[int(np.argmin(hashes))] = True
  train = [t for t, h in zip(texts, heldout) if not h]
  return train, [t for t, h in zip(texts, heldout) if h]


def train_tokenizer(texts, vocab_size: int) -> tokenizers.Tokenizer:
  """A byte-level BPE tokenizer (as GPT-2's) trained on texts.

  Byte-level means any text encodes, and decoding gives it back exactly.
  """
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(texts, trainer)
  return tokenizer


def encode_corpus(tokenizer: tokenizers.Tokenizer, texts) -> np.ndarray:
  """All texts as one int32 token stream, each followed by EOS."""
  eos = tokenizer.token_to_id(EOS)
  ids = []
  for encoding in tokenizer.encode_batch(list(texts)):
    ids.extend(encoding.ids)
    ids.append(eos)
  return np.asarray(ids, np.int32)


def random_windows(tokens: np.ndarray, batch_size: int, length: int,
                   rng: np.random.Generator) -> np.ndarray:
  """[batch_size, length] random windows of a token stream."""
  starts = rng.integers(0, len(tokens) - length, batch_size)
  return np.stack([tokens[s:s + length] for s in starts])


def prompts_from_texts(tokenizer, texts, num_prompts: int,
                       prompt_tokens: int, seed: int) -> list[str]:
  """Prompts of prompt_tokens tokens, each starting at a line start of a
  different text (texts taken in a seeded order); past one per text, the
  texts are taken again in the same order, each at another line start."""
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(texts))
  prompts = []
  # A few passes at most: a text too short for one prompt is for none.
  for index in np.tile(order, 8):
    text = texts[index]
    line_starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    line_starts = line_starts[:max(1, len(line_starts) // 2)]
    start = line_starts[rng.integers(len(line_starts))]
    ids = tokenizer.encode(text[start:start + 8 * prompt_tokens]).ids
    if len(ids) >= prompt_tokens:
      prompts.append(tokenizer.decode(ids[:prompt_tokens]))
    if len(prompts) == num_prompts:
      break
  return prompts


def repeating_prompts(prompts: list[str], restart_lines: int = 2) -> list[str]:
  """Each prompt followed by its first restart_lines lines again.

  Models the input of an edit: a file, then the file being written out anew.
  A model that copies continues with the rest of the prompt, which is what
  prompt lookup drafts.
  """
  repeated = []
  for prompt in prompts:
    head = "".join(prompt.splitlines(keepends=True)[:restart_lines])
    repeated.append(prompt.rstrip("\n") + "\n\n" + head)
  return repeated
