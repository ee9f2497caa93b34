"""The main job: AR and SD side by side on the built-in pair.

  python -m experiments.run --config=configs/quickstart.py --workdir=/tmp/quickstart

Any field can be overridden, e.g. --config.gamma=6 --config.temperature=0.7,
or another drafter: --config.drafter=ngram, --config.drafter=layer_skip
--config.layer_skip.num_layers=3, --config.confidence_threshold=0.4.
`runlocal` is a seconds-long smoke run: --config=configs/quickstart.py:runlocal
"""

import ml_collections


def add_drafter_fields(config: ml_collections.ConfigDict) -> None:
  """The drafter and its sub-configs, shared by every experiment config."""
  # Where drafts come from: model (config.draft), ngram (prompt lookup in the
  # row's own context, no draft model) or layer_skip (the target's first
  # layers, sharing its cache).
  config.drafter = "model"
  # The draft model directory, for drafter=model.
  config.draft = "pretrained/draft"
  # Dynamic gamma for model and layer_skip: a row stops drafting once the
  # draft's top probability falls below this (0 always drafts gamma tokens).
  config.confidence_threshold = 0.0
  # Prompt lookup: match the last max_n tokens, falling back to min_n.
  config.ngram = ml_collections.ConfigDict({"max_n": 3, "min_n": 1})
  # Layer skip: how many of the target's layers the draft runs.
  config.layer_skip = ml_collections.ConfigDict({"num_layers": 2})


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  # Model directories; "pretrained/NAME" is the built-in pair.
  config.target = "pretrained/target"
  add_drafter_fields(config)
  # Drafts per cycle.
  config.gamma = 8
  # Comma-separated temperatures, one run each; 0 is greedy.
  config.temperature = "0,1"
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
  # Prompts: one per line from prompts_file, else num_prompts held-out slices
  # of prompt_tokens tokens from the corpus ("" is the standard library).
  config.prompts_file = ""
  config.num_prompts = 8
  config.prompt_tokens = 64
  config.corpus = ""
  config.heldout_percent = 5
  # Follow each held-out prompt with its first lines again, as when a file is
  # re-emitted with an edit: the input prompt lookup is made for.
  config.repeat_prompts = False
  config.seed = 0
  # Device mesh: data x model must equal the device count; -1 fills one axis.
  # Batch rows are split over data, heads / MLP / vocab over model (see
  # spec_jax/sharding.py). The default is every device on data, so one device
  # runs as before.
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1
  config.mesh.model = 1
  # A full copy of the draft on every device instead of splitting it over
  # model: a small draft may be faster without the all-reduces.
  config.mesh.replicate_draft = False
  if arg == "runlocal":
    config.num_prompts = 2
    config.max_new_tokens = 8
    config.gamma = 2
  return config
