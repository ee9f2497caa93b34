"""Block verification against the token rule: expected accepted drafts on the
very same drafts (exact, paired), and tau and speedup in the full loop.

On the same drafts, each rule's expected number of accepted drafts is exact:
the token rule's sum_k prod_{i<=k} min(1, p_i/q_i), and block verification's
sum_n n P(n) from `rules.block.num_accepted_law`. The drafts come from
the draft model at real contexts (every prefix of the held-out prompts), so
the per-draft difference is a paired sample whose mean and standard error
give the significance of the gain. The full-loop runs then measure what the
gain is worth in tau and wall-clock speedup, each rule beside its own AR run.
"""

import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from scipy import stats

from experiments.harness import compare, loading
from experiments.harness import config as config_lib
from spec_jax import rules
from spec_jax.decoding import pad_prompts
from spec_jax.verification import verify

_log = logging.getLogger(__name__)


def _contexts(prompt_ids: list[list[int]], min_length: int, stride: int):
  """Every prefix of every prompt at lengths min_length, +stride, ..."""
  return [ids[:n] for ids in prompt_ids
          for n in range(min_length, len(ids) + 1, stride)]


@jax.jit
def _expected_accepted(draft_tokens, draft_probs, target_probs):
  """[B] expected accepted drafts under the token rule and under block
  verification, for the same drafts."""
  accept = rules.acceptance_probs(draft_tokens, draft_probs, target_probs)
  token = jnp.cumprod(accept, axis=-1).sum(-1)
  law = rules.block.num_accepted_law(draft_tokens, draft_probs,
                                     target_probs)
  block = (law * jnp.arange(law.shape[-1])).sum(-1)
  return token, block


def same_drafts(loaded: loading.Loaded, contexts, gamma: int, sampling,
                draws: int, seed: int) -> dict:
  """Paired exact expectations over `draws` draft samples per context."""
  prompts, lengths = (jnp.asarray(x) for x in pad_prompts(contexts))
  max_len = prompts.shape[1] + gamma + 2
  target, drafter = loaded.target.model, loaded.drafter
  tokens = jnp.pad(prompts, ((0, 0), (0, gamma + 2)))
  target_cache = target.prefill(prompts, lengths, max_len)
  draft_state = drafter.prefill(prompts, lengths, max_len)
  token, block = [], []
  for draw in range(draws):
    proposal = drafter.propose(draft_state, target_cache, tokens, lengths,
                               jax.random.key(seed * 1000 + draw), gamma,
                               sampling)
    verified = verify(target, proposal.target_cache, tokens, lengths,
                      proposal.tokens, sampling)
    pair = _expected_accepted(proposal.tokens, proposal.probs, verified.probs)
    token.append(np.asarray(pair[0]))
    block.append(np.asarray(pair[1]))
  token, block = np.concatenate(token), np.concatenate(block)
  gain = block - token
  standard_error = gain.std(ddof=1) / np.sqrt(len(gain))
  z = gain.mean() / standard_error if standard_error > 0 else np.inf
  return {"samples": len(gain),
          "tau_token": 1 + float(token.mean()),
          "tau_block": 1 + float(block.mean()),
          "gain": float(gain.mean()), "gain_standard_error": float(
              standard_error), "z": float(z),
          # One-sided: block accepts more than the token rule. The gain is
          # in expectation over drafts; on one draft either rule can win.
          "p_value": float(stats.norm.sf(z)),
          "block_higher_fraction": float((gain > 1e-6).mean()),
          "block_lower_fraction": float((gain < -1e-6).mean())}


def compare_rules(config: ml_collections.ConfigDict, loaded: loading.Loaded,
                   prompts) -> list[dict]:
  """One row per (temperature, gamma): the paired comparison on the same
  drafts, and both rules in the full loop."""
  prompt_ids = compare.encode(loading.Prompts.of(prompts),
                              loaded.target.tokenizer)
  contexts = _contexts(prompt_ids, config.min_context, config.context_stride)
  rows = []
  for temperature in config_lib.temperatures(config):
    sampling = config_lib.sampling(config, temperature)
    for gamma in config_lib.gammas(config):
      row = {"temperature": temperature, "gamma": gamma,
             "contexts": len(contexts),
             "same_drafts": same_drafts(loaded, contexts, gamma, sampling,
                                        config.draws, config.seed)}
      for rule in ("token", "block"):
        run_config = ml_collections.ConfigDict(config.to_dict())
        run_config.verification = rule
        run = compare.compare_at(run_config, loaded, prompts, temperature,
                                 gamma=gamma)
        row[rule] = {"tokens_per_cycle": run["sd"]["tokens_per_cycle"],
                     "acceptance_rate": run["sd"]["acceptance_rate"],
                     "speedup": run["speedup"]}
      same = row["same_drafts"]
      _log.info("T=%g gamma=%d: same drafts tau %.3f (token) vs %.3f (block),"
                " z = %.1f; loop tau %.2f vs %.2f, speedup %.2fx vs %.2fx",
                temperature, gamma, same["tau_token"], same["tau_block"],
                same["z"], row["token"]["tokens_per_cycle"],
                row["block"]["tokens_per_cycle"], row["token"]["speedup"],
                row["block"]["speedup"])
      rows.append(row)
  return rows


def format_table(rows: list[dict]) -> str:
  lines = [f"{'T':>3} {'gamma':>5} {'tau token':>9} {'tau block':>9} "
           f"{'gain':>7} {'z':>6} | {'loop tau':>13} {'speedup':>13}",
           f"{'':>3} {'':>5} {'(same drafts, exact)':>27} {'':>13} | "
           f"{'token / block':>13} {'token / block':>13}"]
  for r in rows:
    same = r["same_drafts"]
    lines.append(
        f"{r['temperature']:>3g} {r['gamma']:>5d} {same['tau_token']:>9.3f} "
        f"{same['tau_block']:>9.3f} {same['gain']:>+7.3f} {same['z']:>6.1f} | "
        f"{r['token']['tokens_per_cycle']:>6.2f} / "
        f"{r['block']['tokens_per_cycle']:<4.2f} "
        f"{r['token']['speedup']:>5.2f}x / {r['block']['speedup']:.2f}x")
  return "\n".join(lines)
