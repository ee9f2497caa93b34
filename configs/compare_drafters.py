"""Drafters side by side on the built-in target: alpha, tau, speedup.

  python -m experiments.compare_drafters --config=configs/compare_drafters.py --workdir=/tmp/drafters

Each variant is the main job's config (configs/quickstart.py) with a few
fields overridden, run on the same held-out prompts at every temperature.
Writes drafters.json and drafters.png. `eagle` runs one variant of each kind
of drafter (--config=configs/compare_drafters.py:eagle). `smollm2` compares prompt lookup,
layer skip and the EAGLE-3 head on SmolLM2-135M-Instruct's chat prompts
(--config=configs/compare_drafters.py:smollm2). Smoke run:
--config=configs/compare_drafters.py:runlocal
"""

from configs import quickstart, smollm2


def get_config(arg=None):
  config = quickstart.get_config()
  del config["gamma"]  # each variant sets its own
  # name -> overrides of the main job's config.
  variants = {
      "draft model, gamma 8": dict(drafter="model", gamma=8),
      "draft model, dynamic gamma": dict(drafter="model", gamma=12,
                                         confidence_threshold=0.1),
      "prompt lookup": dict(drafter="ngram", gamma=4),
      "prompt lookup, edit input": dict(drafter="ngram", gamma=8,
                                        repeat_prompts=True,
                                        prompt_tokens=160),
      "draft model, edit input": dict(drafter="model", gamma=8,
                                      repeat_prompts=True, prompt_tokens=160),
  }
  variants["EAGLE-3 head, gamma 6"] = dict(drafter="eagle3", gamma=6)
  for k in (1, 2, 3, 4, 5):
    variants[f"layer skip, {k} of 6 layers"] = dict(
        drafter="layer_skip", gamma=4, layer_skip=dict(num_layers=k))
  config.variants = variants
  # Runs of AR and SD over all the prompts, taking turns batch by batch; the
  # median time counts.
  config.timing_repeats = 3
  if arg == "eagle":
    # The EAGLE-3 head against the other kinds of drafter, one variant each.
    config.variants = {
        name: variants[name] for name in (
            "draft model, gamma 8", "prompt lookup",
            "layer skip, 1 of 6 layers", "EAGLE-3 head, gamma 6")}
  elif arg == "smollm2":
    # SmolLM2-135M-Instruct on two chat prompts per category (no draft model
    # shares its vocabulary offline).
    config.update(smollm2.get_config().to_dict())
    config.temperatures = (0.0, 1.0)
    config.num_prompts = 2
    config.timing_repeats = 1
    config.variants = {
        "prompt lookup, gamma 4": dict(drafter="ngram", gamma=4),
        "layer skip, 24 of 30 layers": dict(
            drafter="layer_skip", gamma=4, layer_skip=dict(num_layers=24)),
        "EAGLE-3 head, gamma 5": dict(drafter="eagle3", gamma=5,
                                    eagle="/tmp/eagle/smollm2/head"),
    }
  elif arg == "runlocal":
    config.variants = {
        "draft_model": dict(drafter="model", gamma=2),
        "prompt_lookup": dict(drafter="ngram", gamma=2, repeat_prompts=True),
        "layer_skip": dict(drafter="layer_skip", gamma=2,
                           layer_skip=dict(num_layers=1),
                           confidence_threshold=0.2),
        "eagle": dict(drafter="eagle3", gamma=2, eagle="pretrained/eagle"),
    }
    config.num_prompts = 2
    config.max_new_tokens = 8
  return config
