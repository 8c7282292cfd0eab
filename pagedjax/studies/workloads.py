"""Seeded synthetic request traces: length distributions, Poisson arrivals, real-text prompts.

    python -m pagedjax.studies.workloads --dataset sharegpt --n 2000 --rate 4

Lengths: the means are the ones the vLLM paper (Kwon et al., SOSP 2023, Fig. 11) reports for its
ShareGPT (161.31 in / 337.99 out tokens) and Alpaca (19.31 / 58.45) traces. The shapes are our
choice, not fitted to the datasets: lognormal, long-tailed like real chat lengths. Lengths are
clipped to [1, max_len]; clipping would pull the mean down, so by default the lognormal's location
is solved so that the *clipped* distribution keeps the target mean (`calibrate=False` clips a
plain lognormal instead). `summarize` reports the realized means; check them, do not assume them.

Prompts are real KJV text (pagedjax.studies.text_data) from a random verse, tokenized by the caller's
`encode` and cut to the sampled length, so any tokenizer works. `encode` should not add special
tokens (BOS): traces join separately encoded parts at the token level, which keeps shared
prefixes token-identical whatever the tokenizer's merges would do across a boundary.

Randomness comes from three independent streams (lengths, arrival gaps, text positions) spawned
from one seed, so a rate sweep with a fixed seed replays the same prompts at different rates.

Block-hash traces (Mooncake's, /work/shared/traces): each request gives its prompt as `hash_ids`,
one id per 512-token block, equal ids for equal prefixes. `read_block_trace` streams and checks
such a file (BlockTraceRecord per line); `block_trace_requests` turns it into TraceRequests whose
tokens each id determines alone (`block_tokens`), so a prefix cache of any design and block size
sees exactly the trace's reuse.
"""
import dataclasses
import json
import math
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from pagedjax import config as config_lib
from pagedjax.studies import text_data

Encode = Callable[[str], Sequence[int]]


@dataclasses.dataclass(frozen=True)
class TraceRequest:
  request_id: int  # position in arrival order, 0..n-1
  arrival_time: float  # seconds after the trace starts
  prompt_ids: list[int]
  max_new_tokens: int
  conversation_id: Optional[int] = None  # multi-turn traces: which conversation
  turn: int = 0  # multi-turn traces: 0 for the opening message
  shared_prefix_len: int = 0  # leading prompt tokens shared with other requests by construction


@dataclasses.dataclass(frozen=True)
class LengthDist:
  """Lognormal token lengths with a target mean; sigma (log-space spread) sets the tail."""
  mean: float
  sigma: float

  def __post_init__(self):
    if self.mean <= 0 or self.sigma <= 0:
      raise ValueError(f'LengthDist needs mean > 0 and sigma > 0, got {self}')

  def clipped_mean(self, mu: float, lo: int, hi: int) -> float:
    """E[clip(X, lo, hi)] for X = exp(mu + sigma Z), in closed form."""
    s = self.sigma
    cdf = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
    below = cdf((math.log(lo) - mu) / s)
    above = 1.0 - cdf((math.log(hi) - mu) / s)
    inside = math.exp(mu + s * s / 2) * (cdf((math.log(hi) - mu - s * s) / s) -
                                         cdf((math.log(lo) - mu - s * s) / s))
    return lo * below + inside + hi * above

  def location(self, lo: int, hi: int, calibrate: bool = True) -> float:
    """The lognormal mu: plain (mean of the unclipped law) or solved for the clipped mean."""
    plain = math.log(self.mean) - self.sigma**2 / 2
    if not calibrate:
      return plain
    if not lo < self.mean < hi:
      raise ValueError(f'target mean {self.mean} is not reachable with lengths clipped to '
                       f'[{lo}, {hi}]; raise the limit, lower the mean, or pass calibrate=False')
    a, b = math.log(lo) - 10 * self.sigma, math.log(hi) + 10 * self.sigma
    for _ in range(100):  # clipped_mean rises monotonically with mu
      mid = (a + b) / 2
      a, b = (mid, b) if self.clipped_mean(mid, lo, hi) < self.mean else (a, mid)
    return (a + b) / 2

  def sample(self, n: int, rng: np.random.Generator, max_len: int, min_len: int = 1,
             calibrate: bool = True) -> np.ndarray:
    """n integer lengths in [min_len, max_len]."""
    if not 1 <= min_len <= max_len:
      raise ValueError(f'need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}')
    if min_len == max_len:
      return np.full(n, min_len, np.int64)
    mu = self.location(min_len, max_len, calibrate)
    x = np.exp(mu + self.sigma * rng.standard_normal(n))
    return np.clip(np.rint(x), min_len, max_len).astype(np.int64)


# (input, output) length laws.
DATASETS = {
    'sharegpt': (LengthDist(161.31, 1.0), LengthDist(337.99, 1.0)),
    'alpaca': (LengthDist(19.31, 0.6), LengthDist(58.45, 0.8)),
}


def get_dataset(dataset):
  """(input, output) LengthDists from a name in DATASETS, or a pair given as is.

  A pair serves runs whose limits are too small for the named means, e.g. on CPU:
  (LengthDist(40, 1.0), LengthDist(30, 1.0)).
  """
  if isinstance(dataset, tuple) and len(dataset) == 2 and all(
      isinstance(d, LengthDist) for d in dataset):
    return dataset
  if dataset not in DATASETS:
    raise ValueError(f'unknown dataset {dataset!r}; allowed: {", ".join(DATASETS)} '
                     f'or an (input, output) pair of LengthDist')
  return DATASETS[dataset]


def byte_encode(text: str) -> list[int]:
  """UTF-8 bytes as token ids (vocab 256): a tokenizer that needs nothing, for tests and demos."""
  return list(text.encode('utf-8'))


def _streams(seed: int):
  """Independent generators for lengths, arrival gaps and text positions."""
  return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)]


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
  """Arrival times of a Poisson process at `rate` requests/s, the first at t=0.

  rate=inf sends everything at t=0 (an offline batch).
  """
  if not rate > 0:
    raise ValueError(f'rate must be > 0 requests/s (inf for all at t=0), got {rate}')
  if n == 0:
    return np.zeros(0)
  if math.isinf(rate):
    return np.zeros(n)
  gaps = rng.exponential(1.0 / rate, n - 1)
  return np.concatenate([[0.0], np.cumsum(gaps)])


def text_tokens(encode: Encode, start_verse: int, num_tokens: int) -> list[int]:
  """The first num_tokens tokens of KJV text from verse start_verse on (wrapping at the end)."""
  if num_tokens < 0:
    raise ValueError(f'num_tokens must be >= 0, got {num_tokens}')
  if num_tokens == 0:
    return []
  chars = 4 * num_tokens + 16  # ~4 characters per BPE token; doubled until enough
  limit = 2 * len(text_data.kjv_text()) + 4 * num_tokens
  while True:
    ids = [int(t) for t in encode(text_data.passage(start_verse, chars))]
    if len(ids) >= num_tokens:
      return ids[:num_tokens]
    if chars > limit:
      raise ValueError(f'encode gave only {len(ids)} tokens for {chars} characters of text; '
                       f'{num_tokens} were needed')
    chars *= 2


def _random_tokens(encode, rng, num_tokens):
  return text_tokens(encode, int(rng.integers(len(text_data.kjv_verses()))), num_tokens)


def _ordered(requests: list[TraceRequest]) -> list[TraceRequest]:
  """Sort by arrival (ties keep build order) and number the requests in that order."""
  order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_time, i))
  return [dataclasses.replace(requests[i], request_id=k) for k, i in enumerate(order)]


def synthetic_trace(n_requests: int, dataset='sharegpt', *, encode: Encode = byte_encode,
                    rate: float = math.inf, seed: int = 0, max_input_len: int = 1024,
                    max_output_len: int = 1024, calibrate: bool = True) -> list[TraceRequest]:
  """Independent requests: lengths from `dataset`'s laws, Poisson arrivals, KJV prompts."""
  in_dist, out_dist = get_dataset(dataset)
  len_rng, arrival_rng, text_rng = _streams(seed)
  n_in = in_dist.sample(n_requests, len_rng, max_input_len, calibrate=calibrate)
  n_out = out_dist.sample(n_requests, len_rng, max_output_len, calibrate=calibrate)
  times = poisson_arrivals(n_requests, rate, arrival_rng)
  return _ordered([
      TraceRequest(i, float(times[i]), _random_tokens(encode, text_rng, int(n_in[i])),
                   int(n_out[i])) for i in range(n_requests)])


def shared_system_prompt(n_requests: int, system_tokens: int = 1000, dataset='sharegpt',
                         *, encode: Encode = byte_encode, rate: float = math.inf, seed: int = 0,
                         max_input_len: int = 1024, max_output_len: int = 1024,
                         calibrate: bool = True) -> list[TraceRequest]:
  """Every prompt is the same system prompt followed by its own user message.

  max_input_len bounds the user message; the prompt is system_tokens longer.
  """
  in_dist, out_dist = get_dataset(dataset)
  len_rng, arrival_rng, text_rng = _streams(seed)
  system = _random_tokens(encode, text_rng, system_tokens)
  n_in = in_dist.sample(n_requests, len_rng, max_input_len, calibrate=calibrate)
  n_out = out_dist.sample(n_requests, len_rng, max_output_len, calibrate=calibrate)
  times = poisson_arrivals(n_requests, rate, arrival_rng)
  return _ordered([
      TraceRequest(i, float(times[i]), system + _random_tokens(encode, text_rng, int(n_in[i])),
                   int(n_out[i]), shared_prefix_len=system_tokens) for i in range(n_requests)])


def system_prompt_switch(n_requests: int, system_tokens: int = 1000,
                         switch_time_s: float = 60.0, dataset='sharegpt', *,
                         encode: Encode = byte_encode, rate: float = 1.0, seed: int = 0,
                         max_input_len: int = 1024, max_output_len: int = 1024,
                         calibrate: bool = True) -> list[TraceRequest]:
  """A deployment mid-run: the shared system prompt changes version at switch_time_s.

  Requests arriving before switch_time_s start with system prompt v1, the others with v2 (another
  passage of the same length), then their own user message (`dataset`'s input law, at most
  max_input_len tokens). Arrivals are Poisson at `rate` requests/s, which must be finite (all at
  t=0 there would be no before and after). Each request's prefix is its version's system prompt
  (shared_prefix_len); the first request at or after switch_time_s names v2.
  """
  if math.isinf(rate) or not rate > 0:
    raise ValueError(f'rate={rate} is not allowed: a finite number of requests/s > 0 (a switch '
                     'needs arrivals before and after it)')
  if not 0 < switch_time_s < math.inf:
    raise ValueError(f'switch_time_s={switch_time_s} is not allowed: a finite number of '
                     'seconds > 0 (the first request arrives at 0)')
  if system_tokens < 1:
    raise ValueError(f'system_tokens={system_tokens} is not allowed: at least 1')
  in_dist, out_dist = get_dataset(dataset)
  len_rng, arrival_rng, text_rng = _streams(seed)
  v1 = _random_tokens(encode, text_rng, system_tokens)
  v2 = v1
  while v2 == v1:  # another passage (two equal draws are one chance in ~31,000 verses)
    v2 = _random_tokens(encode, text_rng, system_tokens)
  n_in = in_dist.sample(n_requests, len_rng, max_input_len, calibrate=calibrate)
  n_out = out_dist.sample(n_requests, len_rng, max_output_len, calibrate=calibrate)
  times = poisson_arrivals(n_requests, rate, arrival_rng)
  return _ordered([
      TraceRequest(i, float(times[i]), (v1 if times[i] < switch_time_s else v2) +
                   _random_tokens(encode, text_rng, int(n_in[i])), int(n_out[i]),
                   shared_prefix_len=system_tokens) for i in range(n_requests)])


def few_shot(n_requests: int, n_shots: int = 5, n_templates: int = 1, dataset='alpaca', *,
             encode: Encode = byte_encode, rate: float = math.inf, seed: int = 0,
             max_input_len: int = 1024, max_output_len: int = 1024,
             calibrate: bool = True) -> list[TraceRequest]:
  """Few-shot prompts: one of n_templates fixed templates (header + n_shots Q/A examples), then
  the request's own question. Example and question lengths follow `dataset`'s laws.
  """
  if n_shots < 0 or n_templates < 1:
    raise ValueError(f'need n_shots >= 0 and n_templates >= 1, got {n_shots}, {n_templates}')
  in_dist, out_dist = get_dataset(dataset)
  len_rng, arrival_rng, text_rng = _streams(seed)
  enc = lambda text: [int(t) for t in encode(text)]
  q_mark, a_mark, gap = enc('Q: '), enc('\nA: '), enc('\n\n')
  templates = []
  for _ in range(n_templates):
    t = enc('Answer the last question in the style of the examples.\n\n')
    shot_in = in_dist.sample(n_shots, len_rng, max_input_len, calibrate=calibrate)
    shot_out = out_dist.sample(n_shots, len_rng, max_output_len, calibrate=calibrate)
    for q_len, a_len in zip(shot_in, shot_out):
      t += q_mark + _random_tokens(encode, text_rng, int(q_len)) + a_mark
      t += _random_tokens(encode, text_rng, int(a_len)) + gap
    templates.append(t)
  which = len_rng.integers(n_templates, size=n_requests)
  n_in = in_dist.sample(n_requests, len_rng, max_input_len, calibrate=calibrate)
  n_out = out_dist.sample(n_requests, len_rng, max_output_len, calibrate=calibrate)
  times = poisson_arrivals(n_requests, rate, arrival_rng)
  requests = []
  for i in range(n_requests):
    t = templates[which[i]]
    question = q_mark + _random_tokens(encode, text_rng, int(n_in[i])) + enc('\nA:')
    requests.append(TraceRequest(i, float(times[i]), t + question, int(n_out[i]),
                                 shared_prefix_len=len(t)))
  return _ordered(requests)


def multi_turn_chat(n_conversations: int, turns: int = 4, dataset='sharegpt', *,
                    encode: Encode = byte_encode, rate: float = math.inf,
                    turn_gap_s: float = 10.0, system_tokens: int = 0, seed: int = 0,
                    max_input_len: int = 1024, max_output_len: int = 1024,
                    max_context: Optional[int] = None,
                    calibrate: bool = True) -> list[TraceRequest]:
  """Chats where every turn resends the whole history plus a new user message.

  prompt[t] = prompt[t-1] + reply[t-1] + user[t]. reply[t-1] is KJV text of length
  max_new_tokens[t-1], standing in for what the model said, so the trace is self-contained; an
  engine driver running closed-loop may substitute the real reply. Conversations start as a
  Poisson process at `rate`; turn t arrives turn_gap_s * t after its conversation starts (the
  trace does not wait for the previous turn to finish). A conversation ends early once
  prompt + max_new_tokens would pass max_context. system_tokens > 0 prepends one system prompt
  shared by all conversations.
  """
  if turns < 1 or turn_gap_s < 0:
    raise ValueError(f'need turns >= 1 and turn_gap_s >= 0, got {turns}, {turn_gap_s}')
  in_dist, out_dist = get_dataset(dataset)
  len_rng, arrival_rng, text_rng = _streams(seed)
  system = _random_tokens(encode, text_rng, system_tokens)
  starts = poisson_arrivals(n_conversations, rate, arrival_rng)
  requests = []
  for c in range(n_conversations):
    n_in = in_dist.sample(turns, len_rng, max_input_len, calibrate=calibrate)
    n_out = out_dist.sample(turns, len_rng, max_output_len, calibrate=calibrate)
    history, shared, prompt = list(system), system_tokens, None
    for t in range(turns):
      if prompt is not None:
        history = prompt + _random_tokens(encode, text_rng, int(n_out[t - 1]))
      prompt = history + _random_tokens(encode, text_rng, int(n_in[t]))
      if max_context is not None and len(prompt) + int(n_out[t]) > max_context:
        break
      requests.append(TraceRequest(c, float(starts[c] + t * turn_gap_s), prompt, int(n_out[t]),
                                   conversation_id=c, turn=t, shared_prefix_len=shared))
      shared = len(prompt)  # the next turn's prompt starts with this whole one
  return _ordered(requests)


# ---- block-hash traces (Mooncake) --------------------------------------------------------------

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
TRACE_FIELDS = ('timestamp', 'input_length', 'output_length', 'hash_ids')


class TraceFormatError(ValueError):
  """A malformed block-hash trace; the message names the file, the line and the field."""


@dataclasses.dataclass(frozen=True)
class BlockTraceRecord:
  """One request of a block-hash trace, as the file has it (lengths in trace tokens)."""
  index: int  # 0-based position in the file
  timestamp_ms: int
  input_length: int
  output_length: int
  hash_ids: tuple  # one id per TRACE_BLOCK_TOKENS-token block; the last one may be partial

  @property
  def full_blocks(self) -> int:
    """Blocks of the prompt that are whole (only those can be cached and reused)."""
    return self.input_length // TRACE_BLOCK_TOKENS

  @property
  def conversation(self) -> Optional[int]:
    """The conversation this request continues, inferred: the id of its second block, the first
    one after the root block every request shares (a later turn resends the history, so it keeps
    that block); None when that block is not full (a longer next turn fills it with other
    tokens, so it names no conversation)."""
    return self.hash_ids[1] if self.full_blocks >= 2 else None


def _record(path: str, number: int, line: str, index: int) -> BlockTraceRecord:
  where = f'{path} line {number}'
  try:
    row = json.loads(line)
  except json.JSONDecodeError as e:
    raise TraceFormatError(f'{where}: not a JSON object ({e.msg})') from None
  if not isinstance(row, dict):
    raise TraceFormatError(f'{where}: a JSON {type(row).__name__}, not an object with fields '
                           f'{", ".join(TRACE_FIELDS)}')
  for field in TRACE_FIELDS:
    if field not in row:
      raise TraceFormatError(f'{where}: field {field!r} is missing (each line needs '
                             f'{", ".join(TRACE_FIELDS)})')
  for field in ('timestamp', 'input_length', 'output_length'):
    value = row[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise TraceFormatError(f'{where}: field {field!r}={value!r} is not allowed: an integer '
                             '>= 0')
  hash_ids = row['hash_ids']
  if not isinstance(hash_ids, list) or not all(
      isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
    raise TraceFormatError(f'{where}: field \'hash_ids\' is not allowed: a list of integers >= 0 '
                           f'(got {str(hash_ids)[:60]})')
  want = -(-row['input_length'] // TRACE_BLOCK_TOKENS)
  if len(hash_ids) != want:
    raise TraceFormatError(f'{where}: field \'hash_ids\' has {len(hash_ids)} ids, not allowed '
                           f'for input_length={row["input_length"]}: ceil(input_length / '
                           f'{TRACE_BLOCK_TOKENS}) = {want}')
  return BlockTraceRecord(index, row['timestamp'], row['input_length'], row['output_length'],
                          tuple(hash_ids))


def read_block_trace(path: str, start: int = 0, limit: Optional[int] = None
                     ) -> Iterator[BlockTraceRecord]:
  """The records of a block-hash trace (JSON lines: timestamp in ms, input_length,
  output_length, hash_ids), checked and streamed one line at a time: requests start..start +
  limit - 1 (limit None: to the end). Every line up to the last one yielded is checked, those
  before `start` too (their timestamps order the rest); TraceFormatError names the first bad
  line and field. Blank lines are skipped."""
  if not isinstance(start, int) or start < 0:
    raise ValueError(f'start={start!r} is not allowed: an integer >= 0 (requests skipped)')
  if limit is not None and (not isinstance(limit, int) or limit < 0):
    raise ValueError(f'limit={limit!r} is not allowed: None (to the end) or an integer >= 0')
  end = math.inf if limit is None else start + limit
  index, last = 0, None
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      if index >= end:
        return
      if not line.strip():
        continue
      record = _record(path, number, line, index)
      if last is not None and record.timestamp_ms < last:
        raise TraceFormatError(f'{path} line {number}: field \'timestamp\'='
                               f'{record.timestamp_ms} is out of order: earlier than the line '
                               f'before ({last}); a trace is in arrival order')
      last = record.timestamp_ms
      if index >= start:
        yield record
      index += 1


def block_tokens(hash_id: int, n: int, vocab_size: int) -> list[int]:
  """The first n token ids of the block a trace names `hash_id`: a function of the id alone
  (SplitMix64 of the id and the position, reduced into 0..vocab_size-1), so equal ids give equal
  tokens and different ids, in practice, different ones."""
  if vocab_size < 2:
    raise ValueError(f'vocab_size={vocab_size} is not allowed: at least 2')
  with np.errstate(over='ignore'):
    x = np.uint64(hash_id) * np.uint64(0x9E3779B97F4A7C15) + np.arange(n, dtype=np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
  return (x % np.uint64(vocab_size)).astype(np.int64).tolist()


def scaled_lengths(record: BlockTraceRecord, length_scale: float) -> tuple:
  """(tokens per trace block, prompt tokens, output tokens) of a record at length_scale: a
  block becomes round(512 * length_scale) >= 1 tokens, the prompt keeps its blocks (a partial
  last one cut in proportion: at least one token, and still partial) and the output is scaled
  (at least one token)."""
  per_block = max(1, round(TRACE_BLOCK_TOKENS * length_scale))
  n = len(record.hash_ids)
  if not n:
    return per_block, 0, max(1, round(record.output_length * length_scale))
  tail = record.input_length - (n - 1) * TRACE_BLOCK_TOKENS
  if tail < TRACE_BLOCK_TOKENS:  # a partial block stays partial (unless a block is one token)
    tail = max(1, min(per_block - 1, round(tail * per_block / TRACE_BLOCK_TOKENS)))
  else:
    tail = per_block
  return per_block, (n - 1) * per_block + tail, max(1, round(record.output_length *
                                                             length_scale))


def block_trace_requests(path: str, vocab_size: int, *, start: int = 0,
                         limit: Optional[int] = None, time_scale: float = 1.0,
                         length_scale: float = 1.0) -> Iterator[TraceRequest]:
  """A block-hash trace as TraceRequests, streamed: each hash id becomes its block_tokens (inside
  vocab_size), the last block cut to the prompt's length; max_new_tokens is the output length;
  arrival_time is (timestamp - the first yielded request's) / 1000 * time_scale seconds.
  length_scale < 1 shrinks every block (512 * length_scale tokens) and output for CPU-sized
  runs, keeping the trace's reuse block for block. Requests are numbered from 0 in order;
  conversation_id and turn are inferred (BlockTraceRecord.conversation); shared_prefix_len is
  the tokens of the leading blocks an earlier yielded request already had."""
  if not (isinstance(time_scale, (int, float)) and 0 <= time_scale < math.inf):
    raise ValueError(f'time_scale={time_scale!r} is not allowed: a finite number >= 0')
  if not (isinstance(length_scale, (int, float)) and 0 < length_scale <= 1):
    raise ValueError(f'length_scale={length_scale!r} is not allowed: a number in (0, 1]')
  first, seen, turns = None, set(), {}
  for k, record in enumerate(read_block_trace(path, start, limit)):
    first = record.timestamp_ms if first is None else first
    per_block, prompt_len, output_len = scaled_lengths(record, length_scale)
    ids = []
    for h in record.hash_ids:
      ids += block_tokens(h, per_block, vocab_size)
    shared = 0
    for h in record.hash_ids[:record.full_blocks]:
      if h not in seen:
        break
      shared += 1
    seen.update(record.hash_ids[:record.full_blocks])
    conversation = record.conversation
    turn = turns.get(conversation, 0)
    turns[conversation] = turn + 1
    yield TraceRequest(k, (record.timestamp_ms - first) / 1000 * time_scale, ids[:prompt_len],
                       output_len, conversation_id=conversation, turn=turn,
                       shared_prefix_len=min(shared * per_block, prompt_len))


def summarize(requests: Sequence[TraceRequest], dataset=None) -> dict:
  """Realized figures of a trace (and the target means when the dataset is named)."""
  n_in = np.array([len(r.prompt_ids) for r in requests])
  n_out = np.array([r.max_new_tokens for r in requests])
  times = np.array([r.arrival_time for r in requests])
  span = float(times.max() - times.min()) if len(requests) else 0.0
  out = {
      'n_requests': len(requests),
      'mean_input_len': float(n_in.mean()) if len(requests) else 0.0,
      'mean_output_len': float(n_out.mean()) if len(requests) else 0.0,
      'max_input_len': int(n_in.max()) if len(requests) else 0,
      'max_output_len': int(n_out.max()) if len(requests) else 0,
      'prompt_tokens': int(n_in.sum()), 'output_tokens': int(n_out.sum()),
      'shared_prefix_tokens': int(sum(r.shared_prefix_len for r in requests)),
      'duration_s': span,
      # None when every request arrives at once (JSON has no infinity).
      'realized_rate': (len(requests) - 1) / span if span > 0 else None,
  }
  if dataset is not None:
    in_dist, out_dist = get_dataset(dataset)
    out.update(target_mean_input_len=in_dist.mean, target_mean_output_len=out_dist.mean)
  return out


def main(argv=None):
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(prog='python -m pagedjax.studies.workloads',
                               description='Realized figures of a byte-tokenized trace.')
  ap.add_argument('--dataset', default='sharegpt', choices=sorted(DATASETS))
  ap.add_argument('--n', type=int, default=2000, help='requests')
  ap.add_argument('--rate', type=float, default=math.inf, help='requests/s (inf: all at t=0)')
  ap.add_argument('--seed', type=int, default=0)
  ap.add_argument('--max-input-len', type=int, default=1024)
  ap.add_argument('--max-output-len', type=int, default=1024)
  a = ap.parse_args(argv)
  trace = synthetic_trace(a.n, a.dataset, rate=a.rate, seed=a.seed,
                          max_input_len=a.max_input_len, max_output_len=a.max_output_len)
  print(json.dumps(summarize(trace, a.dataset), indent=2))


if __name__ == '__main__':
  main()

# ---- config ---------------------------------------------------------------------------------

def validate_config(config):
  """pagedjax.config.validate_config (every typed section), then the trace section when the
  config has one; raises ConfigError naming the first bad field, else returns the ConfigDict."""
  typed = config_lib.Config.from_configdict(config_lib.validate_config(config))
  if 'trace' in config:
    validate_trace(config.trace, typed.engine.max_seq_len)
  return config


def validate_trace(t, max_seq_len: int):
  """config.trace: the synthetic workload a trace job replays (experiments/jobs.py builds it with synthetic_trace)."""
  if t.dataset not in DATASETS:
    config_lib._fail('trace.dataset', t.dataset, f'one of {tuple(DATASETS)}')
  for name in ('num_requests', 'max_input_len', 'max_output_len'):
    if not config_lib._is_int(t[name]) or t[name] < 1:
      config_lib._fail(f'trace.{name}', t[name], 'an integer >= 1')
  if not config_lib._is_int(t.seed):
    config_lib._fail('trace.seed', t.seed, 'an integer')
  if isinstance(t.rate, bool) or not isinstance(t.rate, (int, float)) or not t.rate > 0:
    config_lib._fail('trace.rate', t.rate, "requests/s > 0, or float('inf') for all at t=0")
  if not isinstance(t.calibrate, bool):
    config_lib._fail('trace.calibrate', t.calibrate, 'True (keep the dataset means under the length '
          'limits) or False (clip the plain laws)')
  if t.max_input_len >= max_seq_len:
    config_lib._fail('trace.max_input_len', t.max_input_len,
          f'less than engine.max_seq_len={max_seq_len}')
