"""The KV cache: per-layer keys and values with a length pointer per row.

The cache is passed in and returned, never kept in a mutable collection, so one
call can write any number of tokens at each row's own positions:

  * prefill writes a whole right-padded prompt batch at positions 0..P-1;
  * `verify` writes up to gamma+1 tokens per row in one pass (N+1 for a
    tree of N drafts, one after another);
  * rollback after a rejection only moves `KVCache.lengths`.

A call may also leave its keys and values unwritten (`PendingWrite`): it
attends to the cache's slots before its own and to its own keys directly,
and the caller commits them later. The decode loop's verify does so inside
the switch over verify widths, because XLA copies every cache array that a
branch of a conditional writes, on every cycle; the write after the switch
is one in place (see verification.verify_proposed).

Why stale slots never leak: a query at position t attends to key slots j <= t
only, and every call writes a contiguous run of positions starting at the
row's pointer before it attends (a call that leaves its keys unwritten sees
only the slots before its pointer, and its own keys). So every visible slot
was written by this call or an earlier one for the token that really sits at
that position. Example for one row, after prefill of "a b c" padded to 5 and
a rejected draft "x y":

  slot      0 1 2 3 4
  written   a b c _ _     prefill (slots 3, 4 hold padding junk); pointer = 2
  written   a b c x y     verify writes [c, x, y] at slots 2..4
  rollback  pointer = 3   the correction z goes to slot 3 next call; slot 4
                          holds junk that no query at position <= 3 can see.
"""

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values, with a length pointer per row.

  keys[i], values[i]: [B, K, S, D_head] for layer i, K = num_kv_heads.
  lengths: [B] int32, number of valid slots in each row. Slots at and beyond it
    hold stale values that the attention mask hides.
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  lengths: jax.Array

  def rollback(self, lengths: jax.Array) -> "KVCache":
    """Keeps the first `lengths[b]` slots of each row; nothing is copied.

    `lengths` counts cache slots. In the decode loops a row whose sequence
    has L tokens keeps L - 1 slots: every token but the last, which the next
    step feeds.
    """
    return self.replace(lengths=lengths.astype(jnp.int32))

  def compact(self, start: jax.Array, path: jax.Array) -> "KVCache":
    """Moves an accepted tree path next to the context; the pointer stays.

    A tree pass wrote node j at slot start[b] + j, each node attending to
    the context (the slots before start) and to its own ancestors only.
    `path` [B, D] lists the accepted root-to-node path's nodes, -1 past its
    end; afterwards slot start[b] + i holds node path[b, i]'s keys and
    values. Invariant: a path node saw exactly the context and the nodes
    before it on the path, at the same positions, so with n accepted nodes
    the first start + n slots are then what a chain pass over the accepted
    tokens writes (to float rounding), and `rollback` to any length up to
    start + n leaves the cache a prefill of the accepted sequence would.
    Path nodes never move left past each other (path[b, i] >= i), and the
    gather reads the old cache, so no move overwrites a node still to move.
    """
    num_slots = self.keys[0].shape[2]
    offset = jnp.arange(path.shape[1])
    source = start[:, None] + jnp.maximum(path, 0)  # [B, D]
    # Slots past the path's end go out of range and are dropped.
    target = jnp.where(path >= 0, start[:, None] + offset, num_slots)

    def move(cache: jax.Array) -> jax.Array:  # [B, K, S, Dh]
      nodes = jnp.take_along_axis(cache, source[:, None, :, None], axis=2,
                                  mode="clip")
      return write(cache, nodes, target)

    return self.replace(keys=tuple(map(move, self.keys)),
                        values=tuple(map(move, self.values)))

  def commit(self, pending: "PendingWrite") -> "KVCache":
    """The cache with `pending` written and its pointer one past each row's
    last written slot (past the padding, for a padded one: the decode loop
    then rolls it back to what the cycle accepted)."""
    slots = pending.slots
    return KVCache(
        keys=tuple(write(c, n, slots)
                   for c, n in zip(self.keys, pending.keys, strict=True)),
        values=tuple(write(c, n, slots)
                     for c, n in zip(self.values, pending.values,
                                     strict=True)),
        lengths=slots[:, -1] + 1)


@flax.struct.dataclass
class PendingWrite:
  """The keys and values of T new tokens that a call attended to but did
  not write, and the slots they belong at.

  keys[i], values[i]: [B, K, T, D_head] for layer i.
  slots: [B, T] int32, consecutive from each row's pointer.
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  slots: jax.Array

  def pad(self, width: int) -> "PendingWrite":
    """Extended to `width` tokens at the next slots, repeating the last
    token's keys and values: slots past a row's pointer that no query sees
    before a later call writes them (the module docstring's invariant)."""
    extra = width - self.slots.shape[1]
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)),
                            mode="edge")
    return PendingWrite(
        keys=tuple(map(pad, self.keys)), values=tuple(map(pad, self.values)),
        slots=self.slots[:, :1] + jnp.arange(width))


def init_cache(
    config, batch_size: int, max_len: int
) -> KVCache:
  """An empty cache for a `TransformerConfig`'s layers, heads and dtype."""
  shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
  zeros = lambda: tuple(
      jnp.zeros(shape, config.dtype) for _ in range(config.num_layers)
  )
  return KVCache(
      keys=zeros(), values=zeros(), lengths=jnp.zeros((batch_size,), jnp.int32)
  )


def write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
  """cache [B, H, S, D] <- new [B, H, T, D] at positions [B, T].

  Written per (row, head) under vmap: the scatter then has batch and head as
  batching dimensions, so on a mesh each device writes its own rows and heads
  with no communication.
  """
  write = lambda c, n, p: c.at[p].set(n, mode="drop")  # [S, D] <- [T, D] at [T]
  return jax.vmap(jax.vmap(write, (0, 0, None)))(cache, new, positions)
