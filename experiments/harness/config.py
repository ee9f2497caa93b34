"""The config schema: every field the harness reads, declared once, and the
one place where a config becomes decode settings.

Experiment configs (configs/*.py) start from `base_config()` and add their
own fields. Lists are tuples, which read naturally on the command line:
--config.temperatures=0,1 gives (0, 1), --config.temperatures=0.7 gives
(0.7,). A renamed field fails with ml_collections' "Did you mean ..." message;
`check` accepts the old comma and range strings that a tuple field receives
from old flags (gammas "1-10").
"""

import ml_collections

from spec_jax import rules
from spec_jax.decoding import DecodeConfig
from spec_jax.draft_length import AdaptiveDraftLength
from spec_jax.draft_tree import TreeTemplate
from spec_jax.sampling import Sampling

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
# config.verification -> a chain's rule (`DecodeConfig.resample`).
RESAMPLERS = {"token": rules.resample, "block": rules.resample_block}


def base_config() -> ml_collections.ConfigDict:
  """The fields every experiment shares, with their defaults."""
  config = ml_collections.ConfigDict()
  # Model directories; "pretrained/NAME" is the built-in pair, "hf:DIR" a
  # Hugging Face folder.
  config.target = "pretrained/target"
  # Where drafts come from: model (config.draft), ngram (prompt lookup in the
  # row's own context, no draft model), layer_skip (the target's first
  # layers, sharing its cache) or eagle3 (an EAGLE-3 head on the target's
  # features, config.eagle).
  config.drafter = "model"
  # The EAGLE-3 head folder (SpecForge, EAGLE or speculators layout), for
  # drafter=eagle3 (experiments.train_eagle writes WORKDIR/head);
  # "pretrained/eagle" is the built-in target's.
  config.eagle = "pretrained/eagle"
  # The draft model directory, for drafter=model.
  config.draft = "pretrained/draft"
  # Dynamic gamma for model and layer_skip: a row stops drafting once the
  # draft's top probability falls below this (0 always drafts gamma tokens).
  config.confidence_threshold = 0.0
  # Prompt lookup: match the last max_n tokens, falling back to min_n.
  config.ngram = ml_collections.ConfigDict({"max_n": 3, "min_n": 1})
  # Layer skip: how many of the target's layers the draft runs.
  config.layer_skip = ml_collections.ConfigDict({"num_layers": 2})
  # Drafts per cycle.
  config.gamma = 8
  # How a chain of drafts is verified: "token" (accept each draft with
  # min(1, p/q), left to right) or "block" (block verification, Sun et al.
  # 2024: the same law, at least as many accepted drafts in expectation).
  config.verification = "token"
  # Verify widths a chain cycle chooses from by its longest proposal: 1
  # (always gamma + 1), 2 (a plain target step when no row proposed
  # anything), 3 (and gamma // 2 + 1). See spec_jax DecodeConfig.
  config.verify_buckets = 2
  # The draft length: "fixed" drafts gamma every cycle; "adaptive" drafts
  # the K in 0..gamma that maximises expected tokens per unit cost, from
  # each row's acceptance so far and costs calibrated at the batch size
  # before the runs (spec_jax.draft_length).
  config.policy = "fixed"
  # The verify widths the adaptive policy drafts for, spread from 1 to
  # gamma + 1 (every width where gamma + 1 is fewer): a cycle pays for the narrowest
  # that holds its drafts, so more widths let it draft nearer its optimum,
  # each one more verify pass compiled into the loop and calibrated. At
  # gamma 8, 6 widths are 1, 2, 4, 5, 7 and 9.
  config.adaptive_verify_buckets = 6
  # For drafter=model or eagle3: () drafts a chain of gamma; branching per
  # depth, e.g. --config.tree=3,2,1,1, draft a tree of that shape instead
  # (spec_jax.TreeTemplate), verified in one pass; gamma is then unused.
  config.tree = ()
  # Temperatures, one run each; 0 is greedy.
  config.temperatures = (0.0, 1.0)
  # Top-k (0 keeps all) and top-p (1 keeps all), applied to p and q alike.
  config.top_k = 0
  config.top_p = 1.0
  # Rows decoded together.
  config.batch_size = 1
  # Runs of AR and SD over all the prompts, taking turns batch by batch; the
  # median time counts.
  config.timing_repeats = 1
  # Tokens generated per prompt (a row also stops at end-of-text).
  config.max_new_tokens = 96
  # Prompts: one per line from prompts_file, or a Spec-Bench style .jsonl
  # of questions by category (num_prompts per category); else num_prompts
  # held-out slices of prompt_tokens tokens from the corpus ("" is the
  # standard library).
  config.prompts_file = ""
  config.num_prompts = 8
  config.prompt_tokens = 64
  config.corpus = ""
  config.heldout_percent = 5
  # Follow each held-out prompt with its first lines again, as when a file is
  # re-emitted with an edit: the input prompt lookup is made for.
  config.repeat_prompts = False
  # Wrap .jsonl questions in the target's own chat template.
  config.chat = False
  # Dtype both models' matmul weights are stored in once loaded, e.g.
  # "bfloat16": activations stay float32 and matmuls sum in float32, and the
  # law SD preserves is then this model's (spec_jax.model.matmul). "" keeps
  # the loaded dtype.
  config.weight_dtype = ""
  config.seed = 0
  # Device mesh: data x model must equal the device count; -1 fills one axis.
  # Batch rows are split over data, heads / MLP / vocab over model (see
  # spec_jax/sharding.py). The default is every device on data, so one device
  # runs as before.
  config.mesh = ml_collections.ConfigDict({"data": -1, "model": 1})
  # A full copy of the draft on every device instead of splitting it over
  # model: a small draft may be faster without the all-reduces.
  config.mesh.replicate_draft = False
  return config


def _ints(values, name: str) -> tuple[int, ...]:
  """A tuple of ints from a tuple field, expanding old range strings
  ('1-10') and comma strings ('2,4,8') into ints."""
  result = []
  for value in values if isinstance(values, (tuple, list)) else (values,):
    for part in str(value).split(","):
      if "-" in part.strip()[1:]:
        low, high = (int(x) for x in part.split("-"))
        result.extend(range(low, high + 1))
      elif part.strip():
        result.append(int(part))
  if not result:
    raise ValueError(f"{name}={values!r}: give at least one value, e.g. "
                     f"--config.{name}=2,4,8.")
  return tuple(result)


def _positive_ints(config: ml_collections.ConfigDict, name: str, what: str,
                   example: str) -> tuple[int, ...]:
  """config[name], a list field of `what`, as ints >= 1."""
  values = _ints(config[name], name)
  if min(values) < 1:
    raise ValueError(f"{name}={config[name]!r}: give {what} >= 1, e.g. "
                     f"--config.{name}={example}.")
  return values


def gammas(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """config.gammas (the gamma sweep's) as ints >= 1."""
  return _positive_ints(config, "gammas", "gammas", "1,2,4,8")


def temperatures(config: ml_collections.ConfigDict) -> tuple[float, ...]:
  values = config.temperatures
  if not isinstance(values, (tuple, list)):
    values = (values,)
  return tuple(float(t) for value in values for t in str(value).split(",")
               if t.strip())


def sampling(config: ml_collections.ConfigDict, temperature: float) -> Sampling:
  return Sampling(temperature=temperature, top_k=config.top_k,
                  top_p=config.top_p)


def decode_config(config: ml_collections.ConfigDict, temperature: float, *,
                  gamma: int | None = None, eos_id=None) -> DecodeConfig:
  """The decode settings of a config at one temperature (and gamma, for a
  sweep row)."""
  adaptive = config.get("policy", "fixed") == "adaptive"
  return DecodeConfig(
      gamma=config.gamma if gamma is None else gamma,
      max_new_tokens=config.max_new_tokens,
      sampling=sampling(config, temperature), eos_id=eos_id,
      resample=RESAMPLERS[config.verification],
      verify_buckets=(config.adaptive_verify_buckets if adaptive
                      else config.verify_buckets),
      adaptive=AdaptiveDraftLength() if adaptive else None)


def chains(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """config.chains (the tree ablation's chain lengths) as ints >= 1."""
  return _positive_ints(config, "chains", "gammas", "1,4,8")


def batch_sizes(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """config.batch_sizes (the batch-scaling ablation's) as ints >= 1."""
  return _positive_ints(config, "batch_sizes", "batch sizes", "1,8,32")


def tree(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """config.tree as ints; () for a chain."""
  return _ints(config.tree, "tree") if config.get("tree") else ()


def check(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError, before anything loads, on settings that cannot
  work. The drafter's name is checked beside the drafters' registry
  (`loading.check_drafter`)."""
  if config.get("policy", "fixed") not in ("fixed", "adaptive"):
    raise ValueError(f"policy={config.policy!r}: choose fixed or adaptive.")
  if config.get("policy") == "adaptive" and tree(config):
    raise ValueError("policy=adaptive chooses a chain's draft length; a "
                     "tree's template fixes its drafts. Unset --config.tree.")
  if config.verification not in RESAMPLERS:
    raise ValueError(f"verification={config.verification!r}: choose one of "
                     f"{tuple(RESAMPLERS)}.")
  if tree(config):
    if config.drafter not in ("model", "eagle3"):
      raise ValueError(f"tree={config.tree!r} drafts from a draft model or "
                       "an EAGLE-3 head; set --config.drafter=model or "
                       "eagle3.")
    if config.verification != "token" or config.confidence_threshold:
      raise ValueError(f"tree={config.tree!r}: trees verify by recursive "
                       "rejection and draft their whole template; unset "
                       "--config.verification and "
                       "--config.confidence_threshold.")
    if "gammas" in config:
      raise ValueError("a gamma sweep runs chains; compare trees with "
                       "experiments.tree_ablation instead of --config.tree.")
    TreeTemplate(tree(config))
  for temperature in temperatures(config):
    sampling(config, temperature)
  if config.get("weight_dtype") not in ("", None, *WEIGHT_DTYPES):
    raise ValueError(f"weight_dtype={config.weight_dtype!r}: choose one of "
                     f"{WEIGHT_DTYPES}, or '' for the loaded dtype.")
  if "gammas" in config:
    gammas(config)
  if "chains" in config:
    chains(config)
  if "batch_sizes" in config:
    batch_sizes(config)
  if "gamma" in config:
    DecodeConfig(gamma=config.gamma, max_new_tokens=config.max_new_tokens,
                 verify_buckets=config.verify_buckets)
