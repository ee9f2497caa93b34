"""What speculative decoding counts, and every ratio derived from the counts.

The counters live in the decode loop's carry; each ratio is defined once, here,
and results files, tables and plots all read it from here. Counters add: the
stats of several batches or runs merge with `+` (row counters are
concatenated, loop counters summed), and every ratio of the merged stats is the
ratio of the summed counts, not a mean of per-batch ratios.

Two conventions for "tokens per cycle" meet in the literature:
  * tau = (accepted drafts + 1) per row-cycle: what one verify pass yields,
    counting the correction or bonus token. This is the (1 - a^(G+1)) / (1 - a)
    of Leviathan et al. (2023) and what we report (`tokens_per_cycle`);
  * accepted drafts per row-cycle, which some papers call the acceptance
    length (`accepted_per_cycle` = tau - 1).
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


# The counters kept per row; the others (cycles, width_cycles, limit_cycles)
# count the loop.
ROW_FIELDS = ("row_cycles", "drafted", "accepted", "accepted_per_position",
              "tried_per_position", "overlap_sum", "point_mass_sum",
              "verified")


@flax.struct.dataclass
class DecodeStats:
  """Counters of speculative decoding.

  A row-cycle is one cycle in which that row was still generating.
  """

  cycles: jax.Array  # [] loop iterations.
  row_cycles: jax.Array  # [B] cycles each row took part in.
  drafted: jax.Array  # [B] draft tokens proposed, verified or not.
  accepted: jax.Array  # [B] draft tokens accepted.
  # [B, G] cycles in which the row accepted draft i; for a tree [B, D],
  # cycles whose accepted path reached depth i + 1.
  accepted_per_position: jax.Array
  # [B, G] cycles in which draft i was tried: proposed, with every draft
  # before it accepted (for a tree [B, D], the path reached depth i). With
  # accepted_per_position, a row's own conditional acceptance by position.
  tried_per_position: jax.Array
  overlap_sum: jax.Array  # [B] sum over verified positions of sum_x min(p, q).
  # [B] sum over the same positions of sum_x q(x) p(x): what the same draft
  # laws would be accepted with by a verifier that treats each draft as a
  # point mass (one-hot q, as tpu-inference and sglang-jax verify EAGLE
  # drafts), which is also exact but accepts min(1, p(x)) <= min(1, p/q).
  point_mass_sum: jax.Array
  # [B] verified positions: accepted + the rejected one (for a tree, the
  # contexts with children on the accepted path).
  verified: jax.Array
  # [K] loop iterations whose verify pass had the k-th of the widths the
  # decode chose from (`verification.verify_widths`; a tree's whole pass
  # counts as the widest).
  width_cycles: jax.Array
  # [G+1] loop iterations whose draft limit was K drafts: gamma but where a
  # draft-length policy (draft_length.py) chose fewer; a tree's depth.
  limit_cycles: jax.Array

  @classmethod
  def zeros(cls, batch_size: int, gamma: int,
            num_widths: int = 1) -> "DecodeStats":
    """Counters at 0; gamma sizes the acceptance by position (a tree's depth
    for a tree), num_widths the verify widths counted."""
    row = jnp.zeros((batch_size,), jnp.int32)
    return cls(
        cycles=jnp.zeros((), jnp.int32), row_cycles=row, drafted=row,
        accepted=row,
        accepted_per_position=jnp.zeros((batch_size, gamma), jnp.int32),
        tried_per_position=jnp.zeros((batch_size, gamma), jnp.int32),
        overlap_sum=jnp.zeros((batch_size,), jnp.float32),
        point_mass_sum=jnp.zeros((batch_size,), jnp.float32), verified=row,
        width_cycles=jnp.zeros((num_widths,), jnp.int32),
        limit_cycles=jnp.zeros((gamma + 1,), jnp.int32))

  def count_width(self, index: jax.Array, limit: jax.Array) -> "DecodeStats":
    """Counts one verify pass of the index-th width, in a cycle whose draft
    limit was `limit` drafts."""
    return self.replace(width_cycles=self.width_cycles.at[index].add(1),
                        limit_cycles=self.limit_cycles.at[limit].add(1))

  def record_plain_step(self, active) -> "DecodeStats":
    """The counters after a cycle that drafted nothing and ran the target
    alone (a draft-length policy's K = 0): one token per active row,
    counted under the first verify width (one token, with verify_buckets
    of 2 or 3)."""
    return self.replace(cycles=self.cycles + 1,
                        row_cycles=self.row_cycles + active).count_width(0, 0)

  def record_cycle(self, active, proposed, num_accepted, overlap,
                   point_mass) -> "DecodeStats":
    """The counters after one cycle of a chain.

    Args:
      active: [B] bool, rows still generating when the cycle began.
      proposed: [B, G] bool, positions where a row proposed a draft (dynamic
        gamma and prompt lookup may propose fewer than gamma).
      num_accepted: [B] accepted drafts.
      overlap: [B, G] sum_x min(p, q) at each position.
      point_mass: [B, G] sum_x q(x) p(x) at each position.
    """
    position = jnp.arange(proposed.shape[1])
    # The accepted positions and the first rejected one.
    verified = proposed & (position <= num_accepted[:, None])
    return self.record(active, proposed, verified, num_accepted, overlap,
                       point_mass, tried=verified)

  def record(self, active, drafted, verified, num_accepted, overlap,
             point_mass, tried) -> "DecodeStats":
    """The counters after one cycle of a chain or a tree.

    Args:
      active: [B] bool, rows still generating when the cycle began.
      drafted: [B, N] bool, the drafts (chain positions, tree nodes) a row
        proposed and the target scored.
      verified: [B, M] bool, where a draft law was tested: a chain's accepted
        positions and its first rejected one; the context nodes on a tree's
        accepted path that have children.
      num_accepted: [B] accepted drafts, the accepted path's length.
      overlap: [B, M] sum_x min(p, q) at the same M positions or contexts.
      point_mass: [B, M] sum_x q(x) p(x) there (for a tree context, its
        first child's).
      tried: [B, G] bool, the positions (depths) tried, as in
        `tried_per_position`.
    """
    depth = self.accepted_per_position.shape[1]
    accepted = jnp.where(active, num_accepted, 0)
    drafted = active[:, None] & drafted
    verified = active[:, None] & verified
    return self.replace(
        cycles=self.cycles + 1,
        row_cycles=self.row_cycles + active,
        drafted=self.drafted + drafted.sum(-1),
        accepted=self.accepted + accepted,
        accepted_per_position=self.accepted_per_position + (
            jnp.arange(depth) < accepted[:, None]),
        tried_per_position=self.tried_per_position + (active[:, None] & tried),
        overlap_sum=self.overlap_sum + jnp.where(verified, overlap, 0.0).sum(-1),
        point_mass_sum=self.point_mass_sum + jnp.where(
            verified, point_mass, 0.0).sum(-1),
        verified=self.verified + verified.sum(-1))

  def __add__(self, other: "DecodeStats") -> "DecodeStats":
    """The stats of both runs: rows concatenated, loop counters summed."""
    rows = lambda name: np.concatenate([np.asarray(getattr(self, name)),
                                        np.asarray(getattr(other, name))])
    total = lambda name: (np.asarray(getattr(self, name))
                          + np.asarray(getattr(other, name)))
    return DecodeStats(cycles=total("cycles"),
                       width_cycles=total("width_cycles"),
                       limit_cycles=total("limit_cycles"),
                       **{name: rows(name) for name in ROW_FIELDS})

  def select_rows(self, keep) -> "DecodeStats":
    """These stats for the rows `keep` ([B] bool or indices) only, e.g. to
    leave out rows that only pad a batch; loop counters are kept."""
    keep = np.asarray(keep)
    return self.replace(**{name: np.asarray(getattr(self, name))[keep]
                           for name in ROW_FIELDS})

  def put_rows(self, into: "DecodeStats", index) -> "DecodeStats":
    """`into` with its rows index [B] replaced by this one's rows, in jit;
    an index past into's rows drops that row. Loop counters are into's."""
    return into.replace(**{
        name: getattr(into, name).at[index].set(getattr(self, name),
                                                mode="drop")
        for name in ROW_FIELDS})

  def clear_rows(self, clear) -> "DecodeStats":
    """Row counters set to 0 where clear [B] (bool), in jit."""
    zero = lambda x: jnp.where(clear.reshape((-1,) + (1,) * (x.ndim - 1)),
                               jnp.zeros_like(x), x)
    return self.replace(**{name: zero(getattr(self, name))
                           for name in ROW_FIELDS})

  @classmethod
  def merge(cls, stats: list["DecodeStats"]) -> "DecodeStats":
    """The sum of a non-empty list of stats (see `__add__`)."""
    merged = stats[0]
    for other in stats[1:]:
      merged = merged + other
    return merged

  @property
  def acceptance_rate(self) -> float:
    """Accepted over drafted tokens."""
    return float(self.accepted.sum() / max(int(self.drafted.sum()), 1))

  @property
  def tokens_per_cycle(self) -> float:
    """tau: accepted drafts plus the correction or bonus, per row-cycle.

    Counts what each verify produced, before EOS or max_new_tokens cut the
    last cycle short, which is the quantity (1 - a^(G+1)) / (1 - a) models.
    """
    row_cycles = int(self.row_cycles.sum())
    return float((self.accepted.sum() + row_cycles) / max(row_cycles, 1))

  @property
  def accepted_per_cycle(self) -> float:
    """Accepted drafts per row-cycle: tau - 1, the other convention."""
    return float(self.accepted.sum() / max(int(self.row_cycles.sum()), 1))

  @property
  def nodes_per_cycle(self) -> float:
    """Drafts the target scored per row-cycle: gamma for a chain (fewer with
    dynamic gamma or prompt lookup), the used nodes of a tree."""
    return float(self.drafted.sum() / max(int(self.row_cycles.sum()), 1))

  @property
  def mean_overlap(self) -> float:
    """Mean of sum_x min(p, q) over verified positions: the model's alpha."""
    return float(self.overlap_sum.sum() / max(int(self.verified.sum()), 1))

  @property
  def mean_point_mass_acceptance(self) -> float:
    """Mean of sum_x q(x) p(x) over the same positions: a point-mass
    verifier's acceptance of the same drafts (see `point_mass_sum`)."""
    return float(self.point_mass_sum.sum() / max(int(self.verified.sum()), 1))

  @property
  def position_acceptance(self) -> np.ndarray:
    """[G] fraction of row-cycles that accepted draft i (1-based i = index
    + 1): P(the first i drafts are all accepted)."""
    return (np.asarray(self.accepted_per_position).sum(0)
            / max(int(self.row_cycles.sum()), 1))

  @property
  def conditional_position_acceptance(self) -> np.ndarray:
    """[G] P(draft i accepted | proposed, with the drafts before it
    accepted); NaN where no cycle tried draft i. Dividing by the cycles that
    tried it, not by those that accepted draft i - 1, keeps a draft that was
    not proposed (a cycle of fewer drafts under a draft-length policy, a
    short lookup match) from counting as rejected."""
    accepted = np.asarray(self.accepted_per_position, np.float64).sum(0)
    tried = np.asarray(self.tried_per_position, np.float64).sum(0)
    return np.divide(accepted, tried, out=np.full_like(accepted, np.nan),
                     where=tried > 0)

  def summary(self) -> dict:
    """Host-side counts and ratios for logs and JSON."""
    return {
        "cycles": int(self.cycles),
        "row_cycles": int(self.row_cycles.sum()),
        "drafted": int(self.drafted.sum()),
        "accepted": int(self.accepted.sum()),
        "verified": int(self.verified.sum()),
        "overlap_sum": float(self.overlap_sum.sum()),
        "acceptance_rate": self.acceptance_rate,
        "tokens_per_cycle": self.tokens_per_cycle,
        "accepted_per_cycle": self.accepted_per_cycle,
        "nodes_per_cycle": self.nodes_per_cycle,
        "width_cycles": [int(x) for x in self.width_cycles],
        "limit_cycles": [int(x) for x in self.limit_cycles],
        "mean_overlap": self.mean_overlap,
        "mean_point_mass_acceptance": self.mean_point_mass_acceptance,
        # Summed over rows: row-cycles that accepted draft i.
        "accepted_per_position": [
            int(x) for x in np.asarray(self.accepted_per_position).sum(0)],
        "position_acceptance": self.position_acceptance.tolist(),
        # None where no cycle tried the draft (JSON has no NaN).
        "conditional_position_acceptance": [
            None if np.isnan(x) else float(x)
            for x in self.conditional_position_acceptance],
    }
