"""spec_jax against llama.cpp on the same weights, prompts and threads.

The GGUF a package ships is re-written with its tensors dequantized to F32
and to F16 (`dequantized_gguf`); llama.cpp (through `llama-cpp-python`) reads
those files, and spec_jax the same GGUF's weights as float32 and as bfloat16
(`weight_dtype`), so both tools decode the same numbers, each at its own
precision. On each prompt, greedy, each tool runs AR and prompt lookup at each
number of drafts, taking turns prompt by prompt (llama.cpp, then spec_jax's
batch-1 AR and SD); each tool's output is checked against its own AR.

Both prompt-lookup drafters propose the continuation of the longest match
of the context's last `ngram.max_n` down to 1 tokens (spec_jax: down to
`ngram.min_n`); llama-cpp-python's `LlamaPromptLookupDecoding` takes the
earliest occurrence of that match, spec_jax the latest.
"""

import logging
import os
import pathlib
import time

import gguf
import jax
import ml_collections
import numpy as np

from experiments.harness import compare, loading
from experiments.harness import config as config_lib
from spec_jax.decoding import generate, generate_autoregressive, pad_prompts
from spec_jax.io import gguf as gguf_io

_log = logging.getLogger(__name__)

# Tensor types written per weight type. Norms and other 1-D tensors stay F32,
# as llama.cpp's converter keeps them.
WEIGHT_TYPES = {"F32": gguf.GGMLQuantizationType.F32,
                "F16": gguf.GGMLQuantizationType.F16}
# spec_jax's weight dtype for the same comparison.
OUR_DTYPE = {"F32": "float32", "F16": "bfloat16"}


def dequantized_gguf(source: str, path: pathlib.Path, weight_type: str):
  """Writes `source` to `path` with every tensor dequantized: 2-D ones to
  `weight_type`, the rest to F32; the metadata is copied as it is."""
  reader = gguf.GGUFReader(source)
  arch = str(reader.fields["general.architecture"].contents())
  partial = path.with_name(path.name + ".partial")
  writer = gguf.GGUFWriter(str(partial), arch)
  for name, field in reader.fields.items():
    # The writer sets these itself; general.file_type would still name the
    # source's quantization.
    if name.startswith("GGUF.") or name in ("general.architecture",
                                            "general.alignment",
                                            "general.file_type"):
      continue
    vtype = field.types[0]
    sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(name, field.contents(), vtype, sub_type)
  for tensor in reader.tensors:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    values = values.reshape(shape).astype(np.float32)
    kind = WEIGHT_TYPES[weight_type] if values.ndim == 2 else (
        gguf.GGMLQuantizationType.F32)
    if kind == gguf.GGMLQuantizationType.F16:
      values = values.astype(np.float16)
    writer.add_tensor(tensor.name, values, raw_dtype=kind)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  os.replace(partial, path)


def _llama(path: pathlib.Path, threads: int, context: int, drafts: int,
           max_ngram: int):
  """A llama.cpp model; with drafts > 0, drafting by prompt lookup."""
  import llama_cpp  # pylint: disable=import-outside-toplevel
  from llama_cpp import llama_speculative  # pylint: disable=import-outside-toplevel
  draft = (llama_speculative.LlamaPromptLookupDecoding(
      max_ngram_size=max_ngram, num_pred_tokens=drafts) if drafts else None)
  return llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads,
                         n_ctx=context, n_batch=context, draft_model=draft,
                         verbose=False, seed=0)


def _llama_greedy(llm, prompt: list[int], max_new_tokens: int,
                  stop_ids) -> tuple[list[int], float]:
  """(tokens, seconds): llama.cpp's greedy continuation of `prompt`, from an
  empty cache, prompt evaluation included."""
  llm.reset()
  tokens = []
  start = time.perf_counter()
  for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0,
                            repeat_penalty=1.0, reset=True):
    if token in stop_ids:
      break
    tokens.append(int(token))
    if len(tokens) == max_new_tokens:
      break
  return tokens, time.perf_counter() - start


def _ours(loaded, config, gammas):
  """{name: fn(prompts [1, P], lengths [1]) -> (tokens, seconds)}:
  spec_jax's AR and SD at each gamma, batch 1, greedy, compiled on first use
  of each prompt width."""
  stop_ids = loaded.target.stop_ids
  target = loaded.target.model
  key = jax.random.key(config.seed)

  def run(gamma):
    decode_config = config_lib.decode_config(config, 0.0, gamma=gamma or 1,
                                             eos_id=stop_ids)
    def decode(ids, lengths):
      start = time.perf_counter()
      if gamma:
        result = generate(key, target, loaded.drafter, ids, lengths,
                          decode_config)
      else:
        result = generate_autoregressive(key, target, ids, lengths,
                                         decode_config)
      tokens = np.asarray(jax.block_until_ready(result.tokens))[0]
      seconds = time.perf_counter() - start
      count = int(result.num_tokens[0])
      return [t for t in tokens[:count].tolist() if t not in stop_ids], seconds
    return decode

  return {"ar": run(0), **{f"lookup_{g}": run(g) for g in gammas}}


def _tokens_per_s(per_prompt: list) -> dict:
  tokens = sum(len(t) for t, _ in per_prompt)
  seconds = sum(s for _, s in per_prompt)
  return {"tokens": tokens, "seconds": seconds,
          "tokens_per_s": tokens / seconds}


def _summary(runs: dict, ar_tokens: list, categories: list) -> dict:
  """tokens/s over all prompts and per category, and how many prompts match
  the tool's AR."""
  out = {}
  for name, per_prompt in runs.items():
    by_category = {
        category: _tokens_per_s([run for run, c in zip(per_prompt, categories)
                                 if c == category])
        for category in dict.fromkeys(categories)}
    out[name] = {
        **_tokens_per_s(per_prompt),
        "equal_to_ar": sum(t == a for (t, _), a in zip(per_prompt,
                                                       ar_tokens)),
        "prompts": len(per_prompt), "by_category": by_category}
  return out


def compare_llamacpp(config: ml_collections.ConfigDict,
                     workdir: pathlib.Path) -> dict:
  """{"weights": {F32|F16: {"llama_cpp": summary, "spec_jax": summary}}}."""
  import llama_cpp  # pylint: disable=import-outside-toplevel
  if not config.target.startswith("gguf:") and not config.target.endswith(
      ".gguf"):
    raise ValueError(f"target {config.target!r}: llama.cpp reads GGUF files; "
                     "give 'gguf:NAME' or a .gguf path.")
  gammas = config_lib.gammas(config)
  report = {"weights": {}, "threads": config.threads,
            "llama_cpp_version": llama_cpp.__version__}
  for weight_type in config.weight_types:
    run_config = ml_collections.ConfigDict(config.to_dict())
    run_config.weight_dtype = OUR_DTYPE[weight_type]
    loaded = loading.load_models(run_config)  # NotInstalled if it is absent
    source = (gguf_io.packaged(config.target.removeprefix("gguf:"))
              if config.target.startswith("gguf:") else config.target)
    path = workdir / f"{pathlib.Path(source).stem}-{weight_type}.gguf"
    if not path.exists():
      _log.info("writing %s", path)
      dequantized_gguf(str(source), path, weight_type)
    prompts = loading.load_prompt_set(run_config, loaded)
    prompt_ids = compare.encode(prompts, loaded.target.tokenizer)
    # Each prompt at its own power-of-two width, as llama.cpp prefills only
    # the prompt: each width compiles once.
    padded = [pad_prompts([p]) for p in prompt_ids]
    context = (max(ids.shape[1] for ids, _ in padded) + config.max_new_tokens
               + max(gammas) + 8)
    stop_ids = set(loaded.target.stop_ids)
    theirs = {"ar": _llama(path, config.threads, context, 0, config.ngram.max_n),
              **{f"lookup_{g}": _llama(path, config.threads, context, g,
                                       config.ngram.max_n)
                 for g in gammas}}
    ours = _ours(loaded, run_config, gammas)
    # Warm-up: compile ours at each prompt width, load theirs.
    for name in ours:
      for index in compare.first_of_each_width(padded):
        ours[name](*padded[index])
      _llama_greedy(theirs[name], prompt_ids[0], 8, stop_ids)
    runs = {"llama_cpp": {n: [] for n in theirs},
            "spec_jax": {n: [] for n in ours}}
    for index, prompt in enumerate(prompt_ids):
      for name in ours:
        runs["llama_cpp"][name].append(_llama_greedy(
            theirs[name], prompt, config.max_new_tokens, stop_ids))
        runs["spec_jax"][name].append(ours[name](*padded[index]))
      _log.info("%s: prompt %d/%d", weight_type, index + 1, len(prompt_ids))
    row = {tool: _summary(tool_runs, [t for t, _ in tool_runs["ar"]],
                          prompts.categories)
           for tool, tool_runs in runs.items()}
    # Each tool at its own precision: equal greedy outputs are likely, not
    # required.
    row["ar_equal_across_tools"] = sum(
        a == b for (a, _), (b, _) in zip(runs["llama_cpp"]["ar"],
                                         runs["spec_jax"]["ar"]))
    row["categories"] = prompts.categories
    report["weights"][weight_type] = row
  return report


def format_table(report: dict) -> str:
  """The pooled table, then spec_jax / llama.cpp tokens/s per category."""
  lines = [f"{'weights':<8} {'decoder':<10} {'llama.cpp tok/s':>15} "
           f"{'spec_jax tok/s':>14} {'ratio':>6}  equal to own AR"]
  for weight_type, row in report["weights"].items():
    for name, ours in row["spec_jax"].items():
      theirs = row["llama_cpp"][name]
      lines.append(
          f"{weight_type:<8} {name:<10} {theirs['tokens_per_s']:>15.1f} "
          f"{ours['tokens_per_s']:>14.1f} "
          f"{ours['tokens_per_s'] / theirs['tokens_per_s']:>6.2f}  "
          f"llama.cpp {theirs['equal_to_ar']}/{theirs['prompts']}, "
          f"spec_jax {ours['equal_to_ar']}/{ours['prompts']}")
  for weight_type, row in report["weights"].items():
    categories = list(row["spec_jax"]["ar"]["by_category"])
    lines += ["", f"{weight_type}: spec_jax / llama.cpp tokens/s by category",
              f"{'decoder':<10} " + " ".join(f"{c[:14]:>14}"
                                             for c in categories)]
    for name, ours in row["spec_jax"].items():
      theirs = row["llama_cpp"][name]["by_category"]
      lines.append(f"{name:<10} " + " ".join(
          f"{ours['by_category'][c]['tokens_per_s'] / theirs[c]['tokens_per_s']:>14.2f}"
          for c in categories))
  return "\n".join(lines)
