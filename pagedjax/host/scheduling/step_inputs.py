"""StepInputs: everything one jitted step needs besides params and pool, built on the host.

All arrays are numpy int32/float32 with *bucketed* shapes (batch rows, query tokens per row,
blocks per row rounded up to a bucket), so a long run compiles a handful of times. Padding:
  - padded query tokens have position -1, token 0, and write their K/V into slot 0, which lies
    in the null block (pool.py), so they never touch a real sequence's blocks;
  - padded block-table entries point at the null block, and context_lens bounds what is read;
  - padded rows have context_len 0 and no real queries; their sampled token is ignored.
"""
import dataclasses
from typing import List, NamedTuple, Sequence

import numpy as np

from pagedjax.host.scheduling.allocator import NULL_BLOCK


class StepInputs(NamedTuple):
  """A NamedTuple, so JAX takes it as a pytree of arrays without the host importing jax."""
  tokens: np.ndarray        # [B, T] int32
  positions: np.ndarray     # [B, T] int32, absolute position of each query, -1 = padding
  slot_mapping: np.ndarray  # [B, T] int32, slot receiving each query token's K/V
  block_tables: np.ndarray  # [B, MB] int32
  context_lens: np.ndarray  # [B] int32, cached tokens after this step's writes
  logits_index: np.ndarray  # [B] int32, query index whose logits are sampled (last real one)
  temperature: np.ndarray   # [B] float32
  top_k: np.ndarray         # [B] int32
  top_p: np.ndarray         # [B] float32
  seeds: np.ndarray         # [B] int32
  counters: np.ndarray      # [B] int32, tokens generated so far (PRNG stream position)
  lanes: np.ndarray         # [B] int32, the row's recent-window lane (pool.py); 0 = null lane


@dataclasses.dataclass
class RowSpec:
  """One sequence's share of a step: feed `tokens` starting at position `start`."""
  tokens: Sequence[int]
  start: int
  block_table: Sequence[int]
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  counter: int = 0
  lane: int = 0  # recent-window lane of the sequence, when the pool keeps one


def bucket(n: int, buckets: Sequence[int]) -> int:
  """Smallest bucket >= n."""
  for b in buckets:
    if b >= n:
      return b
  raise ValueError(f'{n} exceeds the largest bucket {buckets[-1]}')


def power_of_two_buckets(max_value: int, min_value: int = 1) -> List[int]:
  """min_value, 2*min_value, ... up to and including max_value."""
  out, b = [], min_value
  while b < max_value:
    out.append(b)
    b *= 2
  out.append(max_value)
  return out


def padded_ids(ids: Sequence[int], buckets: Sequence[int]) -> np.ndarray:
  """Block ids padded with the null block to the smallest bucket >= len(ids) (block copies and
  transfers: pagedjax/device/block_transfer.py)."""
  out = np.full(bucket(len(ids), buckets), NULL_BLOCK, np.int32)
  out[:len(ids)] = ids
  return out


def build_step_inputs(rows: Sequence[RowSpec], block_size: int, batch_buckets: Sequence[int],
                      token_buckets: Sequence[int],
                      table_width_buckets: Sequence[int]) -> StepInputs:
  num_rows = bucket(len(rows), batch_buckets)
  num_tokens = bucket(max(len(r.tokens) for r in rows), token_buckets)
  table_width = bucket(max(len(r.block_table) for r in rows), table_width_buckets)

  tokens = np.zeros((num_rows, num_tokens), np.int32)
  positions = np.full((num_rows, num_tokens), -1, np.int32)
  slots = np.zeros((num_rows, num_tokens), np.int32)  # slot 0 is in the null block
  tables = np.full((num_rows, table_width), NULL_BLOCK, np.int32)
  context_lens = np.zeros(num_rows, np.int32)
  logits_index = np.zeros(num_rows, np.int32)
  temperature = np.zeros(num_rows, np.float32)
  top_k = np.zeros(num_rows, np.int32)
  top_p = np.ones(num_rows, np.float32)
  seeds = np.zeros(num_rows, np.int32)
  counters = np.zeros(num_rows, np.int32)
  lanes = np.zeros(num_rows, np.int32)

  for i, r in enumerate(rows):
    n = len(r.tokens)
    pos = np.arange(r.start, r.start + n)
    table = np.asarray(r.block_table, np.int32)
    if len(table) * block_size < r.start + n:
      raise ValueError(f'row {i}: block table of {len(table)} blocks cannot hold '
                       f'{r.start + n} tokens at block_size {block_size}')
    tokens[i, :n] = r.tokens
    positions[i, :n] = pos
    slots[i, :n] = table[pos // block_size] * block_size + pos % block_size
    tables[i, :len(table)] = table
    context_lens[i] = r.start + n
    logits_index[i] = n - 1
    temperature[i], top_k[i], top_p[i] = r.temperature, r.top_k, r.top_p
    seeds[i], counters[i], lanes[i] = r.seed, r.counter, r.lane
  return StepInputs(tokens, positions, slots, tables, context_lens, logits_index, temperature,
                    top_k, top_p, seeds, counters, lanes)
