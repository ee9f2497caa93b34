"""spec_jax against HF transformers on the same weights and prompts.

Four decoders, each timed over the same prompts after a warm-up call:
  hf_plain      transformers `generate` (PyTorch, CPU);
  hf_assisted   transformers assisted generation with the draft as
                `assistant_model`, gamma drafts per cycle;
  ar, sd        spec_jax `generate_autoregressive` and `generate`.
Every row generates exactly max_new_tokens (no EOS stop on either side), so
tokens/s compare like with like. Needs torch and transformers (the `hf` extra).
"""

import logging
import pathlib

import jax
import ml_collections
import numpy as np

from experiments.harness import config as config_lib
from experiments.harness import loading, timing
from spec_jax.decoding import generate, generate_autoregressive
from spec_jax.drafters import ModelDrafter
from spec_jax.io import hf
from spec_jax.stats import DecodeStats

_log = logging.getLogger(__name__)


def hf_folders(config: ml_collections.ConfigDict, workdir) -> tuple[str, str]:
  """HF folders of the target and draft: 'hf:DIR' as given, spec_jax model
  directories exported into workdir/hf/."""
  folders = []
  for name in ("target", "draft"):
    path = config[name]
    if loading.hf_folder(path) is not None:
      folders.append(loading.hf_folder(path))
      continue
    bundle = loading.load(path)
    folder = pathlib.Path(workdir) / "hf" / name
    hf.save_hf(folder, bundle.model, bundle.tokenizer, bundle.eos_id)
    folders.append(str(folder))
  return folders[0], folders[1]


class _ForwardCounter:
  """Counts forward passes of a torch module, to confirm what HF ran."""

  def __init__(self, module):
    self.count = 0
    module.register_forward_hook(self._hook)

  def _hook(self, *_):
    self.count += 1


def _hf_generate(target, draft, prompts: np.ndarray, temperature: float,
                 max_new_tokens: int, gamma: int | None):
  """[B, max_new_tokens] tokens from transformers; assisted when gamma."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0,
               "top_p": 1.0} if temperature > 0 else {"do_sample": False})
  # Everything explicit: transformers' defaults include top_k=50 and, for
  # assistants, a 0.4 confidence threshold that cuts drafts short.
  config = transformers.GenerationConfig(
      max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
      pad_token_id=0, **sampling)
  kwargs = {}
  if gamma:
    # transformers 5 reads these from the assistant's own generation_config.
    for generation_config in (config, draft.generation_config):
      generation_config.num_assistant_tokens = gamma
      generation_config.num_assistant_tokens_schedule = "constant"
      generation_config.assistant_confidence_threshold = 0.0
    kwargs["assistant_model"] = draft
  inputs = torch.from_numpy(prompts.astype(np.int64))
  with torch.inference_mode():
    output = target.generate(inputs, attention_mask=torch.ones_like(inputs),
                             generation_config=config, **kwargs)
  return output[:, prompts.shape[1]:].numpy()


def _equal_length_prompts(config, tokenizer) -> np.ndarray:
  """[N, width] prompts cut to the shortest one's length: no padding, so both
  libraries see identical inputs."""
  prompt_ids = [tokenizer.encode(p).ids
                for p in loading.load_prompts(config, tokenizer)]
  width = min(map(len, prompt_ids))
  if len(prompt_ids) < max(config.batch_sizes):
    raise ValueError(
        f"{len(prompt_ids)} prompts cannot fill a batch of "
        f"{max(config.batch_sizes)}; raise num_prompts or lower batch_sizes.")
  return np.array([ids[:width] for ids in prompt_ids], np.int32)


class _Decoders:
  """The four decoders of one (temperature, batch size), each
  fn(prompts [B, P]) -> tokens [B, max_new_tokens], and what they ran."""

  def __init__(self, models, counters, config, temperature: float,
               batch_size: int, width: int):
    target, draft, hf_target, hf_draft = models
    self.counters, self.gamma, self.sd_stats = counters, config.gamma, []
    # No EOS stop: every row makes max_new_tokens tokens on both sides.
    decode_config = config_lib.decode_config(config, temperature)
    key = jax.random.key(config.seed)
    lengths = np.full((batch_size,), width, np.int32)

    def sd(batch):
      result = generate(key, target, ModelDrafter(draft), batch, lengths,
                        decode_config)
      self.sd_stats.append(result.stats)
      return result.tokens

    hf_decode = lambda gamma: lambda batch: _hf_generate(
        hf_target, hf_draft, batch, temperature, config.max_new_tokens, gamma)
    self.decoders = {
        "hf_plain": hf_decode(None),
        "hf_assisted": hf_decode(config.gamma),
        "ar": lambda batch: generate_autoregressive(
            key, target, batch, lengths, decode_config).tokens,
        "sd": sd,
    }

  def reset(self) -> None:
    """Forgets what the warm-up ran."""
    for counter in self.counters:
      counter.count = 0
    self.sd_stats.clear()

  def measure(self, name: str, batches, repeats: int = 1
              ) -> tuple[dict, list]:
    """(result record, outputs) of one decoder over the batches: the median
    over `repeats` of its time for all of them, after a warm-up call, which
    compiles the spec_jax programs. The warm-up is waited for: JAX dispatches
    asynchronously, so an unfinished warm-up would run inside the first
    timed call. Counts and outputs are the last repeat's."""
    decode = self.decoders[name]
    timing.timed(decode, batches[0])
    totals = []
    for _ in range(repeats):
      self.reset()
      outputs = []
      totals.append(0.0)
      for batch in batches:
        tokens, elapsed = timing.timed(decode, batch)
        outputs.append(np.asarray(tokens))
        totals[-1] += elapsed
    seconds = float(np.median(totals))
    new_tokens = sum(o.size for o in outputs)
    result = {"tokens_per_s": new_tokens / seconds, "wall_s": seconds,
              "new_tokens": new_tokens}
    if name.startswith("hf"):
      result.update(target_passes=self.counters[0].count,
                    draft_passes=self.counters[1].count)
    if name == "hf_assisted":
      verifies = max(result["target_passes"], 1)
      result["tokens_per_target_pass"] = new_tokens / verifies
      result["acceptance_rate"] = (new_tokens - verifies) / (
          verifies * self.gamma)
    if name == "sd":
      stats = DecodeStats.merge(self.sd_stats)
      result.update(acceptance_rate=stats.acceptance_rate,
                    tokens_per_cycle=stats.tokens_per_cycle)
    return result, outputs


RATIOS = {"sd_over_hf_assisted": ("sd", "hf_assisted"),
          "ar_over_hf_plain": ("ar", "hf_plain"),
          "sd_over_ar": ("sd", "ar"),
          "hf_assisted_over_hf_plain": ("hf_assisted", "hf_plain")}


def _row(models, counters, config, temperature: float, batch_size: int,
         prompt_ids: np.ndarray) -> dict:
  """The four decoders at one temperature and batch size."""
  count = len(prompt_ids) - len(prompt_ids) % batch_size
  batches = np.split(prompt_ids[:count], count // batch_size)
  decoders = _Decoders(models, counters, config, temperature, batch_size,
                       prompt_ids.shape[1])
  row = {"temperature": temperature, "batch_size": batch_size,
         "gamma": config.gamma, "num_prompts": count,
         "prompt_tokens": prompt_ids.shape[1]}
  outputs = {}
  for name in decoders.decoders:
    try:
      row[name], outputs[name] = decoders.measure(
          name, batches, config.timing_repeats)
    except ValueError as error:
      if name != "hf_assisted" or batch_size == 1:
        raise  # only HF's assisted generation refuses a batch > 1
      row[name] = {"error": str(error)}
      _log.info("T=%g B=%d %s: %s", temperature, batch_size, name, error)
      continue
    _log.info("T=%g B=%d %s: %.1f tok/s", temperature, batch_size, name,
              row[name]["tokens_per_s"])
  speed = lambda name: row[name].get("tokens_per_s")
  row["speedups"] = {ratio: speed(a) / speed(b)
                     for ratio, (a, b) in RATIOS.items()
                     if speed(a) and speed(b)}
  if temperature == 0:
    # Greedy: every decoder should emit the target's argmax sequence.
    reference = np.concatenate(outputs["hf_plain"])
    row["greedy_rows_equal_to_hf_plain"] = {
        name: float(np.mean(np.all(np.concatenate(out) == reference, 1)))
        for name, out in outputs.items()}
  return row


def compare(config: ml_collections.ConfigDict, workdir) -> dict:
  """Runs the four decoders for each temperature and batch size."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(config.threads)
  target_folder, draft_folder = hf_folders(config, workdir)
  target, draft = loading.load_pair(f"hf:{target_folder}",
                                    f"hf:{draft_folder}")
  load_torch = lambda folder: transformers.AutoModelForCausalLM.from_pretrained(
      folder, dtype=torch.float32).eval()
  models = (target.model, draft.model, load_torch(target_folder),
            load_torch(draft_folder))
  counters = (_ForwardCounter(models[2]), _ForwardCounter(models[3]))
  prompt_ids = _equal_length_prompts(config, target.tokenizer)
  rows = [_row(models, counters, config, temperature, batch_size, prompt_ids)
          for temperature in config_lib.temperatures(config)
          for batch_size in config.batch_sizes]
  return {"target": target_folder, "draft": draft_folder,
          "target_params": target.model.num_params,
          "draft_params": draft.model.num_params,
          "torch_threads": torch.get_num_threads(),
          "torch_version": torch.__version__,
          "transformers_version": transformers.__version__,
          "jax_version": jax.__version__, "jax_device": str(jax.devices()[0]),
          "rows": rows}


def format_table(report: dict) -> str:
  lines = [f"{'T':>3} {'B':>2} {'HF plain':>9} {'HF assist':>9} {'AR':>8} "
           f"{'SD':>8} {'SD/HFa':>7} {'AR/HFp':>7}  tok/s"]
  for row in report["rows"]:
    speed = lambda name: row[name].get("tokens_per_s", float("nan"))  # pylint: disable=cell-var-from-loop
    ratio = lambda name: row["speedups"].get(name, float("nan"))  # pylint: disable=cell-var-from-loop
    lines.append(
        f"{row['temperature']:>3g} {row['batch_size']:>2d} "
        f"{speed('hf_plain'):>9.1f} {speed('hf_assisted'):>9.1f} "
        f"{speed('ar'):>8.1f} {speed('sd'):>8.1f} "
        f"{ratio('sd_over_hf_assisted'):>6.2f}x {ratio('ar_over_hf_plain'):>6.2f}x")
  return "\n".join(lines)
