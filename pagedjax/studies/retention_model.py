"""Hold times for the `retention` eviction policy (host/policies.py: Retention), fitted from a
trace, and the fluid bound they come from. numpy only.

The fluid model of a cache of C blocks: each release (one turn of a conversation, its n cached
blocks less the root every request shares) is held for a time T chosen by its class, then
dropped. Held that long, it costs n x min(T, until its conversation's next turn, or the end of
the trace) block-ticks and gains the blocks the next turn reads if that turn comes within T. A
cache that is always full has C x (the trace's ticks) block-ticks to spend, so the best hold per
class solves a knapsack: hold each class for the T maximizing gain - lambda x cost, lambda
raised until the spending fits (Lagrangian relaxation; the classes are few, the releases many).
A cache that evicts the smallest release tick + T first realizes it: every class's hold shifts
by the same amount until the pool is full, so only the differences between holds matter.

`bound` is the same knapsack scored on the releases it was fitted on, for any classing of them:
an upper estimate of what a policy that decides by a release's class and age can get from the
information the classes carry (a relaxation: the fluid cache is full on average, a real one at
every moment; docs/policy_lab.md compares the two). Ticks count what the policy's clock
counts: one per block released and one per turn's end.
"""
import math
from typing import Callable, Dict, Sequence

import numpy as np

from pagedjax.host.policies import Retention

TRACE_BLOCK_TOKENS = 512


def releases(records) -> Dict[str, np.ndarray]:
  """Per release of `records` (BlockTraceRecords in trace order; requests with a conversation
  and at least two full blocks): its request (index in records), its tick, blocks (less the root), the conversation's finished
  turns, the ticks since its previous turn (-1 for a first turn), the output tokens, the ticks
  until its next turn (inf: none in the slice), and the blocks that turn reads of it (less the
  root). Also the slice's ticks, root hits (blocks) and prompt tokens."""
  last, turns, previous_tick = {}, {}, {}
  out = {k: [] for k in ('request', 'tick', 'blocks', 'turns', 'think', 'output', 'gap', 'read')}
  tick, root_hits, prompt = 0, 0, 0
  for i, r in enumerate(records):
    full = list(r.hash_ids[:r.full_blocks])
    prompt += r.input_length
    if full and tick > 0:
      root_hits += 1  # every request starts with the root block, cached by the first
    c = r.conversation
    if c is not None and c in last:
      j, blocks = last.pop(c)
      k = 0
      while k < min(len(blocks), len(full)) and blocks[k] == full[k]:
        k += 1
      readable = len(full) - (r.input_length % TRACE_BLOCK_TOKENS == 0)  # the last token runs
      out['read'][j] = max(min(k, readable) - 1, 0)
      out['gap'][j] = tick - out['tick'][j]
    tick += len(full) + 1
    if c is None or len(full) < 2:
      continue
    turns[c] = turns.get(c, 0) + 1
    out['think'].append(tick - previous_tick[c] if c in previous_tick else -1)
    previous_tick[c] = tick
    for name, value in (('request', i), ('tick', tick), ('blocks', len(full) - 1), ('turns', turns[c]),
                        ('output', r.output_length), ('gap', math.inf), ('read', 0)):
      out[name].append(value)
    last[c] = (len(out['tick']) - 1, full)
  arrays = {k: np.asarray(v, float) for k, v in out.items()}
  arrays.update(span=float(tick), root_hits=float(root_hits), prompt_tokens=float(prompt))
  return arrays


def hold_grid(span: float, size: int = 64) -> np.ndarray:
  """Candidate holds: 0 (not kept past its release) and geometric from 16 ticks to 4 spans."""
  return np.concatenate([[0.0], np.geomspace(16.0, max(4.0 * span, 32.0), size)])


def _tables(rel, classes: np.ndarray, grid: np.ndarray) -> dict:
  """class -> (gain, cost) per hold in grid."""
  until = np.minimum(rel['gap'], rel['span'] - rel['tick'])
  tables = {}
  for c in np.unique(classes):
    m = classes == c
    n, gap, read, stay = rel['blocks'][m], rel['gap'][m], rel['read'][m], until[m]
    gain = np.array([read[gap <= t].sum() for t in grid])
    cost = np.array([(n * np.minimum(t, stay)).sum() for t in grid])
    tables[c] = (gain, cost)
  return tables


def _knapsack(tables: dict, budget: float) -> tuple:
  """(class -> chosen hold index, gain) spending at most budget block-ticks, the last class's
  step mixed in fluidly to spend all of it (its gain counted; the hold index is the lower)."""
  def pick(lam):
    chosen = {c: int(np.argmax(g - lam * k)) for c, (g, k) in tables.items()}
    return (chosen, sum(tables[c][0][i] for c, i in chosen.items()),
            sum(tables[c][1][i] for c, i in chosen.items()))
  lo, hi = 0.0, 1.0
  while pick(hi)[2] > budget:
    hi *= 2
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if pick(mid)[2] > budget else (lo, mid)
  chosen, gain, cost = pick(hi)
  _, gain_over, cost_over = pick(lo)
  if cost_over > cost:  # mix: part of a class at the next hold
    gain += (gain_over - gain) * min((budget - cost) / (cost_over - cost), 1.0)
  return chosen, gain


def turns_classes(rel) -> np.ndarray:
  return np.array([Retention.turns_class(int(t)) for t in rel['turns']])


def fit_hold(rel, capacity_blocks: int, size: int = 64) -> tuple:
  """Retention.hold (ticks per turns class) for a cache of capacity_blocks, fitted on rel. A
  class with no release in rel gets the hold of the nearest class below it (or 0)."""
  holds = fit_holds(rel, capacity_blocks, turns_classes(rel), size)
  hold, last = [], 0.0
  for c in range(len(Retention.hold)):
    last = holds.get(c, last)
    hold.append(last)
  return tuple(hold)


def fit_holds(rel, capacity_blocks: int, classes: np.ndarray, size: int = 64) -> dict:
  """Hold per class label (any classing of rel's releases) for a cache of capacity_blocks. If
  the cache has room to hold every class until every return the slice shows, the holds of the
  classes that return at all are all alike (LRU among them; the rest 0): how far the slice's
  last returns happened to fall says nothing about later ones."""
  grid = hold_grid(rel['span'], size)
  tables = _tables(rel, np.asarray(classes), grid)
  chosen, _ = _knapsack(tables, capacity_blocks * rel['span'])
  if all(tables[c][0][i] >= tables[c][0][-1] for c, i in chosen.items()):
    return {int(c): float(grid[-1] if tables[c][0][-1] > 0 else 0.0) for c in chosen}
  return {int(c): float(grid[i]) for c, i in chosen.items()}


def bound(rel, capacity_blocks: int, classes: np.ndarray, size: int = 64) -> float:
  """The fluid optimum's hit rate on rel itself with these classes (one label per release)."""
  grid = hold_grid(rel['span'], size)
  _, gain = _knapsack(_tables(rel, np.asarray(classes), grid), capacity_blocks * rel['span'])
  return (rel['root_hits'] + gain) * TRACE_BLOCK_TOKENS / rel['prompt_tokens']


def _bins(values, edges) -> np.ndarray:
  return np.digitize(values, edges)


# Classings of releases by what a cache can see at release time (and two that it cannot), for
# the bound: name -> function(rel) -> one integer label per release.
CLASSINGS: Dict[str, Callable[[dict], np.ndarray]] = {
    'none': lambda rel: np.zeros(len(rel['tick']), int),
    'turns': turns_classes,
    'turns x prompt': lambda rel: turns_classes(rel) * 10 + _bins(rel['blocks'], [4, 8, 16, 32, 64]),
    'turns x prompt x think x output': lambda rel: (
        ((turns_classes(rel) * 10 + _bins(rel['blocks'], [4, 8, 16, 32, 64])) * 10
         + np.where(rel['think'] < 0, 9, _bins(rel['think'], [2000, 4000, 8000, 16000, 32000])))
        * 10 + _bins(rel['output'], [100, 300, 600, 1000])),
    'oracle: returns or not': lambda rel: turns_classes(rel) * 2 + np.isfinite(rel['gap']),
}


def bounds(rel, capacity_blocks: int, names: Sequence[str] = tuple(CLASSINGS)) -> dict:
  return {name: bound(rel, capacity_blocks, CLASSINGS[name](rel)) for name in names}
