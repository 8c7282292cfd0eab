"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p.

Every row carries its own parameters, so one compiled step serves any mix of requests. The
PRNG key of a row is `fold_in(PRNGKey(seed), n)` where n counts the tokens that request has
generated: a request's samples depend only on its seed, never on batch composition or on
preemption and recompute.
"""
import jax
import jax.numpy as jnp


def _sample_row(logits, temperature, top_k, top_p, key):
  """logits [V] -> one token id, with this row's filters."""
  order = jnp.argsort(-logits)
  sorted_logits = logits[order] / jnp.maximum(temperature, 1e-6)
  rank = jnp.arange(logits.shape[0])
  keep = jnp.where(top_k > 0, rank < top_k, True)
  probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
  # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < p.
  mass_before = jnp.cumsum(probs) - probs
  keep &= mass_before < top_p
  choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
  return order[choice]


def sample(logits, temperature, top_k, top_p, seeds, counters):
  """logits [B, V] float32; per-row params [B] -> token ids [B] int32."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def stochastic():
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    drawn = jax.vmap(_sample_row)(logits, temperature, top_k, top_p, keys).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)

  # The vocabulary sort is the expensive part: skip it when the whole batch is greedy.
  return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)


def top_candidates(logits, k: int):
  """Each row's k best continuations for beam search: (ids [B, k] int32, log-probs [B, k]
  float32). The compiled step and the streamed path both return these."""
  logprobs, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
  return ids.astype(jnp.int32), logprobs
