"""A context several times the device's KV memory, served by the engine: a thin front.

The engine itself serves such a request with KV offload (config.offload;
pagedjax/host/scheduling/offload.py and model/streamed_attention.py): the sequence's newest
`window_blocks` blocks stay in the device pool, its older ones live in host RAM (or on the disk
tier) and stream through attention `chunk_blocks` at a time inside the engine's iterations,
beside its other requests, with every sampling mode.
`LongContextDecoder` is that engine with a pool of `pool_blocks` blocks, and a loop that steps it
for one request and reads, step by step, what the long-context study reports
(experiments/long_context.py): each decode step's time and the bytes it streamed.

  decoder = LongContextDecoder(model_cfg, params, LongContextSettings(
      block_size=16, pool_blocks=16, window_blocks=16, chunk_blocks=8, prefill_chunk=64))
  result = decoder.generate(prompt_ids, SamplingParams(max_new_tokens=32))
  result.output_ids, result.step_seconds, result.step_bytes_streamed

Anything else (batches, n > 1 samples, arrival times) goes through `decoder.engine` directly.
"""
import dataclasses
import math
import numbers
import time
from typing import List, Optional, Sequence

import numpy as np

from pagedjax.config import Config, OffloadConfig
from pagedjax.engine import Engine
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.model.llama import ModelConfig


def _positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f'{name}={value!r} is not allowed: an integer >= 1')
  return int(value)


@dataclasses.dataclass(frozen=True)
class LongContextSettings:
  """block_size: tokens per block. pool_blocks: the device pool's blocks (the null block
  aside). window_blocks (W): device blocks an offloaded sequence holds, at most pool_blocks.
  chunk_blocks (C): host blocks per fold step. prefill_chunk: prompt tokens per step (a power
  of two). host_blocks: the offload store's blocks (0: as many as max_seq_len needs).
  placement: where they live, 'host' (RAM) or 'disk' (the disk tier, in the tensorstore
  kvstore disk_kvstore: a directory or URL). layers_per_call: layers per streamed program
  (config.offload.layers_per_call; more than the model's = all of them). cache_blocks:
  config.offload.cache_blocks (offloaded blocks join the prefix cache when base enables it)."""
  block_size: int = 16
  pool_blocks: int = 16
  window_blocks: int = 16
  chunk_blocks: int = 8
  prefill_chunk: int = 64
  host_blocks: int = 0
  placement: str = 'host'
  disk_kvstore: str = ''
  layers_per_call: int = 1
  cache_blocks: bool = True

  def validate(self) -> 'LongContextSettings':
    for name in ('block_size', 'pool_blocks', 'window_blocks', 'chunk_blocks', 'prefill_chunk',
                 'layers_per_call'):
      _positive_int(name, getattr(self, name))
    if self.window_blocks > self.pool_blocks:
      raise ValueError(f'window_blocks={self.window_blocks} is not allowed: at most '
                       f'pool_blocks={self.pool_blocks} (the window lives in the pool)')
    if self.placement not in ('host', 'disk'):
      raise ValueError(f"placement={self.placement!r} is not allowed: 'host' or 'disk'")
    if not isinstance(self.cache_blocks, bool):
      raise ValueError(f'cache_blocks={self.cache_blocks!r} is not allowed: True or False')
    if self.placement == 'disk' and not self.disk_kvstore:
      raise ValueError(f"disk_kvstore={self.disk_kvstore!r} is not allowed with placement="
                       "'disk': a directory or tensorstore kvstore URL")
    return self

  def config(self, base: Config, max_seq_len: int) -> Config:
    """base with this pool, prefill chunk and offload section (max_seq_len sizes the offload
    store when host_blocks is 0): every offloaded block in host RAM, or all on the disk tier."""
    blocks = self.host_blocks or math.ceil(max_seq_len / self.block_size)
    window = dict(device_blocks=self.window_blocks, chunk_blocks=self.chunk_blocks,
                  layers_per_call=self.layers_per_call, cache_blocks=self.cache_blocks)
    offload = (OffloadConfig(host_blocks=blocks, **window) if self.placement == 'host' else
               OffloadConfig(disk_blocks=blocks, disk_kvstore=self.disk_kvstore,
                             placement='disk', **window))
    return dataclasses.replace(
        base,
        pool=dataclasses.replace(base.pool, block_size=self.block_size,
                                 num_blocks=self.pool_blocks + 1),
        engine=dataclasses.replace(base.engine, prefill_chunk=self.prefill_chunk,
                                   max_seq_len=max_seq_len),
        offload=offload)


@dataclasses.dataclass
class LongContextResult:
  """One request's tokens and what serving it cost, from the engine's own counters."""
  prompt_ids: List[int]
  output_ids: List[int]
  finish_reason: str
  prompt_seconds: float  # the steps up to the first token (compilation included if any)
  step_seconds: List[float]  # each decode step after the first token
  step_bytes_streamed: List[int]  # host -> device K/V bytes of each of those steps
  step_host_blocks: List[int]  # the request's blocks in host RAM before each of those steps
  prompt_bytes_streamed: int
  host_blocks: int  # the most of the request's blocks in host RAM before a decode step
  window_bytes: int  # device K/V bytes of its window
  chunk_bytes: int  # one streamed chunk's K and V (one layer)
  compilations: int  # programs compiled while serving it
  logits: Optional[List[np.ndarray]] = None  # per output token [V], when recorded


class LongContextDecoder:
  """An Engine (`engine`) with offload on, and a loop that serves one request at a time
  step by step (module docstring). record_logits: completions carry their logits."""

  def __init__(self, model_cfg: ModelConfig, params, settings: LongContextSettings, *,
               base: Optional[Config] = None, record_logits: bool = False, step_fn=None,
               tokenizer=None, eos_id: Optional[int] = None):
    """base: the engine's other sections (default Config()); settings replace its pool
    shape, prefill chunk and offload section."""
    self.settings = settings.validate()
    self.model_cfg = model_cfg
    config = settings.config(base or Config(), model_cfg.max_seq_len)
    self.engine = Engine(model_cfg, params, config, record_logits=record_logits,
                         step_fn=step_fn, tokenizer=tokenizer, eos_id=eos_id)
    shapes = self.engine.pool.block_array_shapes()
    self.block_bytes = sum(int(np.prod(s[2:])) * np.dtype(d).itemsize
                           for s, d in shapes.values())  # one block, one layer, K and V

  def close(self) -> None:
    """Removes a disk placement's store (also done when the engine goes)."""
    self.engine.offload.store.close()

  def generate(self, prompt_ids: Sequence[int],
               params: SamplingParams = SamplingParams()) -> LongContextResult:
    """One request through the engine, an iteration at a time: the iterations up to its
    first token are the prefill, each later one a decode step."""
    engine, stats = self.engine, self.engine.stats
    compiled = engine.num_compilations
    request = engine.submit(prompt_ids, params)
    seq = next(s for s in engine.scheduler.waiting if s.request_id == request)
    start, prompt_seconds, prompt_bytes = time.perf_counter(), None, 0
    bytes_before = stats['streamed_bytes']
    steps = {'seconds': [], 'bytes': [], 'host': []}
    while request not in engine.finished:
      t0, before, host = time.perf_counter(), stats['streamed_bytes'], len(seq.host_table)
      engine.step()
      if prompt_seconds is None:
        if seq.output_ids:
          prompt_seconds = time.perf_counter() - start
          prompt_bytes = stats['streamed_bytes'] - bytes_before
      else:
        steps['seconds'].append(time.perf_counter() - t0)
        steps['bytes'].append(stats['streamed_bytes'] - before)
        steps['host'].append(host)
    done = engine.finished[request]
    s = self.settings
    return LongContextResult(
        prompt_ids=list(done.prompt_ids), output_ids=done.output_ids,
        finish_reason=done.finish_reason, prompt_seconds=prompt_seconds,
        step_seconds=steps['seconds'], step_bytes_streamed=steps['bytes'],
        step_host_blocks=steps['host'], prompt_bytes_streamed=prompt_bytes,
        host_blocks=max(steps['host'], default=0),
        window_bytes=s.window_blocks * self.model_cfg.num_layers * self.block_bytes,
        chunk_bytes=s.chunk_blocks * self.block_bytes,
        compilations=engine.num_compilations - compiled, logits=done.logits)
