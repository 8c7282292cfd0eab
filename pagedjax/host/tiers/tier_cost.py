"""Recompute or load: the arithmetic that decides whether lower-tier hits are promoted.

When a prompt's cached prefix continues below the device (k blocks found, in order, in tier 2,
host RAM, or tier 3, disk), the engine may load the first j of them and recompute the other
k - j (only a prefix can be loaded: a block's K/V are valid only after all the blocks before
it). The cost of a choice j, in seconds:

  cost(j)        = load_s(found[:j]) + recompute_s(k - j)
  recompute_s(m) = m * block_size * prefill_s_per_token
  load_s(blocks) = sum over the tiers t the blocks come from of latency_s[t]
                   + sum over the blocks of block_bytes / bytes_per_s[t of the block]

A block evicted earlier in the same iteration and still on the device counts as tier 1: it is
copied on the device, latency 0 and bandwidth unbounded here. Tier 3's figures are its whole
path, disk read then host-to-device copy:
latency_s[3] = disk latency + host latency and 1 / bytes_per_s[3] = 1 / disk + 1 / host
bandwidth. The promotion rule picks j: 'auto' the least cost (ties go to loading), 'load' all
k, 'recompute' none.

Preemption (scheduler.py, preemption 'auto' and victim 'cost') weighs the same figures: a
victim holding c cached tokens in b blocks costs
  recompute_tokens_s(c) = c * prefill_s_per_token            (prefilled again on readmission)
  swap_s(b)             = 2 * (latency_s[2] + b * block_bytes / bytes_per_s[2])
                          (copied out to host RAM and back in; the host link is taken as
                          symmetric, its host-to-device figures stand for both directions)

The figures are measured on the running machine at engine start (pagedjax/tiering.py:
prefill_s_per_token from a full prefill call of max_batch_size rows x prefill_chunk tokens, the
batch a recomputation joins; bandwidth and latency from timed transfers of scratch blocks) or
set in config.tiers to study the policy for other hardware.
"""
import dataclasses
import math
from typing import Dict, Sequence

PROMOTION_RULES = ('auto', 'load', 'recompute')


@dataclasses.dataclass
class TierCosts:
  block_size: int
  block_bytes: int  # one block's bytes as stored (codes, scales and zero points included)
  prefill_s_per_token: float
  bytes_per_s: Dict[int, float]  # tier -> bandwidth of a load into the device
  latency_s: Dict[int, float]  # tier -> fixed seconds of one batched load from that tier

  @classmethod
  def for_tiers(cls, block_size: int, block_bytes: int, prefill_s_per_token: float,
                host: tuple, disk: tuple) -> 'TierCosts':
    """From (bytes/s, latency s) of the host-to-device copy and of the disk read."""
    (host_bw, host_lat), (disk_bw, disk_lat) = host, disk
    # Tier 1: a block evicted this iteration, still on the device: copied there, free here.
    return cls(block_size, block_bytes, prefill_s_per_token,
               {1: math.inf, 2: host_bw, 3: 1 / (1 / disk_bw + 1 / host_bw)},
               {1: 0.0, 2: host_lat, 3: disk_lat + host_lat})

  def recompute_s(self, num_blocks: int) -> float:
    return self.recompute_tokens_s(num_blocks * self.block_size)

  def recompute_tokens_s(self, num_tokens: int) -> float:
    return num_tokens * self.prefill_s_per_token

  def swap_s(self, num_blocks: int) -> float:
    """A swap-out and the swap-in that brings the blocks back (see the module docstring)."""
    if not num_blocks:
      return 0.0
    return 2 * (self.latency_s[2] + num_blocks * self.block_bytes / self.bytes_per_s[2])

  def load_s(self, tiers: Sequence[int]) -> float:
    return (sum(self.latency_s[t] for t in set(tiers)) +
            sum(self.block_bytes / self.bytes_per_s[t] for t in tiers))

  def blocks_to_load(self, tiers: Sequence[int], rule: str) -> int:
    """How many of the found blocks (their tiers, in prefix order) to load under `rule`."""
    if rule not in PROMOTION_RULES:
      raise ValueError(f'promotion rule {rule!r} is not allowed: one of {PROMOTION_RULES}')
    if rule == 'load':
      return len(tiers)
    if rule == 'recompute' or not tiers:
      return 0
    # cost(j) for every j in one pass: load_s(tiers[:j]) as a running sum, recompute_s
    # inlined (the same floats as the definition above)
    k, bs, per_token = len(tiers), self.block_size, self.prefill_s_per_token
    block_s = {t: self.block_bytes / self.bytes_per_s[t] for t in set(tiers)}
    costs, seen, latency, transfer = [self.recompute_s(k)], set(), 0.0, 0.0
    for j, t in enumerate(tiers, 1):
      if t not in seen:
        seen.add(t)
        latency = sum(self.latency_s[u] for u in set(seen))
      transfer += block_s[t]
      costs.append(latency + transfer + (k - j) * bs * per_token)
    best = min(costs)
    return max(j for j, c in enumerate(costs) if c <= best)

  def figures(self) -> dict:
    return {'cost_prefill_s_per_token': self.prefill_s_per_token,
            'cost_block_bytes': self.block_bytes,
            **{f'cost_tier{t}_bytes_per_s': bw for t, bw in self.bytes_per_s.items() if t > 1},
            **{f'cost_tier{t}_latency_s': lat for t, lat in self.latency_s.items() if t > 1}}
