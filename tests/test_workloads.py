"""Synthetic traces: determinism, length laws, arrivals, limits, and the prefix structure that
prefix-caching experiments rely on."""
import math
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedjax.studies import text_data
from pagedjax.studies import workloads
from pagedjax.host.scheduling.allocator import BlockAllocator
from pagedjax.host.scheduling.block_manager import BlockManager
from pagedjax.host.cache.prefix_cache import PrefixCache
from pagedjax.host.cache.radix_cache import RadixCache
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.requests.sequence import Sequence
from pagedjax.studies.workloads import LengthDist


def word_encode(text):
  """A second tokenizer (one id per word) to show traces do not assume bytes."""
  return [zlib.crc32(w.encode()) % 50000 for w in text.split()]


def test_kjv_text_offline_and_cached():
  verses = text_data.kjv_verses()
  assert len(verses) > 31000
  assert verses[0] == 'In the beginning God created the heaven and the earth.'
  assert verses[-1] == 'The grace of our Lord Jesus Christ be with you all. Amen.'
  assert text_data.kjv_text() is text_data.kjv_text()
  assert len(text_data.kjv_text()) > 4_000_000
  assert text_data.passage(0, 10) == 'In the beg'
  wrapped = text_data.passage(len(verses) - 1, len(verses[-1]) + 6)
  assert wrapped == verses[-1] + ' In th'


@pytest.mark.parametrize('dataset', ['sharegpt', 'alpaca'])
def test_realized_means_near_targets(dataset):
  trace = workloads.synthetic_trace(2000, dataset, seed=3)
  s = workloads.summarize(trace, dataset)
  assert s['mean_input_len'] == pytest.approx(s['target_mean_input_len'], rel=0.1)
  assert s['mean_output_len'] == pytest.approx(s['target_mean_output_len'], rel=0.1)


def test_length_law_is_long_tailed_and_calibrated():
  dist = LengthDist(337.99, 1.0)
  x = dist.sample(20000, np.random.default_rng(0), max_len=1024)
  assert x.mean() == pytest.approx(337.99, rel=0.03)
  assert np.median(x) < 0.75 * x.mean()  # right-skewed
  # Calibration solves the clipped mean exactly; plain clipping loses part of the tail.
  mu = dist.location(1, 1024)
  assert dist.clipped_mean(mu, 1, 1024) == pytest.approx(337.99, rel=1e-9)
  plain = dist.sample(20000, np.random.default_rng(0), max_len=1024, calibrate=False)
  assert plain.mean() < 0.97 * 337.99
  with pytest.raises(ValueError, match=r'target mean 337.99 is not reachable .* \[1, 300\]'):
    dist.sample(10, np.random.default_rng(0), max_len=300)


@settings(max_examples=40, deadline=None)
@given(mean=st.floats(2, 500), sigma=st.floats(0.1, 2.0), max_len=st.integers(1, 4096),
       seed=st.integers(0, 2**31))
def test_lengths_respect_limits(mean, sigma, max_len, seed):
  dist = LengthDist(mean, sigma)
  calibrate = 1 < mean < max_len
  x = dist.sample(200, np.random.default_rng(seed), max_len=max_len, calibrate=calibrate)
  assert x.dtype.kind == 'i' and x.min() >= 1 and x.max() <= max_len


def test_trace_limits_and_tokenizer_agnostic():
  # The output mean (338) cannot be kept under a 150 limit: plain clipping must be asked for.
  with pytest.raises(ValueError, match='not reachable'):
    workloads.synthetic_trace(10, 'sharegpt', max_input_len=200, max_output_len=150)
  trace = workloads.synthetic_trace(300, 'sharegpt', encode=word_encode, seed=1,
                                    max_input_len=200, max_output_len=150, calibrate=False)
  assert all(1 <= len(r.prompt_ids) <= 200 and 1 <= r.max_new_tokens <= 150 for r in trace)
  assert max(len(r.prompt_ids) for r in trace) == 200  # the long tail reaches the limit
  assert all(isinstance(t, int) for r in trace for t in r.prompt_ids)


def test_prompts_are_real_text():
  # Byte-level ids decode back to a verse-aligned run of the KJV.
  text = text_data.kjv_text()
  for r in workloads.synthetic_trace(20, 'sharegpt', seed=9):
    prompt = bytes(r.prompt_ids).decode('utf-8')
    assert len(prompt) == len(r.prompt_ids) and prompt in text


def test_seeded_determinism():
  a = workloads.synthetic_trace(50, 'alpaca', rate=2.0, seed=7)
  b = workloads.synthetic_trace(50, 'alpaca', rate=2.0, seed=7)
  c = workloads.synthetic_trace(50, 'alpaca', rate=2.0, seed=8)
  assert a == b
  assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]
  # Independent streams: the same seed at another rate replays the same requests.
  d = workloads.synthetic_trace(50, 'alpaca', rate=9.0, seed=7)
  assert [(r.prompt_ids, r.max_new_tokens) for r in a] == [
      (r.prompt_ids, r.max_new_tokens) for r in d]


def test_poisson_arrivals():
  rate = 5.0
  trace = workloads.synthetic_trace(4000, 'alpaca', rate=rate, seed=2)
  times = np.array([r.arrival_time for r in trace])
  gaps = np.diff(times)
  assert times[0] == 0.0 and (gaps >= 0).all()
  assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
  assert gaps.std() == pytest.approx(1 / rate, rel=0.08)  # exponential: std == mean
  assert [r.request_id for r in trace] == list(range(4000))
  assert all(r.arrival_time == 0.0 for r in workloads.synthetic_trace(20, rate=math.inf))
  for bad in (0.0, -1.0, float('nan')):
    with pytest.raises(ValueError, match='rate must be > 0'):
      workloads.synthetic_trace(5, rate=bad)


def test_bad_dataset_lists_allowed():
  with pytest.raises(ValueError, match="unknown dataset 'lmsys'; allowed: sharegpt, alpaca or an"):
    workloads.synthetic_trace(5, 'lmsys')


def test_shared_system_prompt_identical_prefix():
  trace = workloads.shared_system_prompt(40, system_tokens=1000, rate=3.0, seed=4)
  system = trace[0].prompt_ids[:1000]
  assert len(system) == 1000
  for r in trace:
    assert r.prompt_ids[:1000] == system and r.shared_prefix_len == 1000
    assert len(r.prompt_ids) > 1000
  # The user messages differ.
  assert len({tuple(r.prompt_ids[1000:]) for r in trace}) == 40


def test_few_shot_templates_shared():
  trace = workloads.few_shot(60, n_shots=3, n_templates=2, seed=5, encode=word_encode)
  templates = {tuple(r.prompt_ids[:r.shared_prefix_len]) for r in trace}
  assert len(templates) == 2
  for r in trace:
    assert r.shared_prefix_len > 0 and len(r.prompt_ids) > r.shared_prefix_len
  by_template = {}
  for r in trace:
    by_template.setdefault(tuple(r.prompt_ids[:r.shared_prefix_len]), []).append(r)
  assert all(len(group) > 1 for group in by_template.values())


def test_multi_turn_histories_are_prefixes():
  trace = workloads.multi_turn_chat(6, turns=4, dataset='alpaca', rate=1.0, turn_gap_s=5.0,
                                    system_tokens=32, seed=6, max_input_len=64, max_output_len=64)
  assert [r.request_id for r in trace] == list(range(len(trace)))
  assert all(a.arrival_time <= b.arrival_time for a, b in zip(trace, trace[1:]))
  system = trace[0].prompt_ids[:32]
  for c in range(6):
    convo = sorted((r for r in trace if r.conversation_id == c), key=lambda r: r.turn)
    assert [r.turn for r in convo] == list(range(4))
    for prev, nxt in zip(convo, convo[1:]):
      n = len(prev.prompt_ids)
      assert nxt.prompt_ids[:n] == prev.prompt_ids
      # History = previous prompt + a reply of the previous max_new_tokens + a new message.
      assert len(nxt.prompt_ids) > n + prev.max_new_tokens
      assert nxt.shared_prefix_len == n
      assert nxt.arrival_time == pytest.approx(prev.arrival_time + 5.0)
    assert convo[0].prompt_ids[:32] == system and convo[0].shared_prefix_len == 32


def test_multi_turn_stops_at_max_context():
  small = (LengthDist(40, 1.0), LengthDist(30, 1.0))  # a custom pair instead of a name
  trace = workloads.multi_turn_chat(5, turns=10, dataset=small, seed=1, max_input_len=64,
                                    max_output_len=64, max_context=300)
  assert trace and all(len(r.prompt_ids) + r.max_new_tokens <= 300 for r in trace)
  assert max(r.turn for r in trace) < 9


# ---- block-hash traces (Mooncake) -----------------------------------------------------------

MOONCAKE = '/work/shared/traces/mooncake_conversation.jsonl'
GOOD = ['{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}',
        '{"timestamp": 0, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]}',
        '{"timestamp": 2500, "input_length": 1600, "output_length": 9, "hash_ids": [0, 1, 3, 4]}']


def _trace_file(tmp_path, lines):
  path = tmp_path / 'trace.jsonl'
  path.write_text('\n'.join(lines) + '\n')
  return str(path)


def test_block_trace_reads_records_and_derives_tokens_from_ids_alone(tmp_path):
  path = _trace_file(tmp_path, GOOD)
  records = list(workloads.read_block_trace(path))
  assert [r.hash_ids for r in records] == [(0, 1, 2), (0, 1), (0, 1, 3, 4)]
  assert [r.full_blocks for r in records] == [2, 2, 3]
  assert [r.conversation for r in records] == [1, 1, 1]
  requests = list(workloads.block_trace_requests(path, 1000, time_scale=2.0))
  assert [len(r.prompt_ids) for r in requests] == [1100, 1024, 1600]
  assert [r.max_new_tokens for r in requests] == [5, 7, 9]
  assert [r.arrival_time for r in requests] == [0.0, 0.0, 5.0]
  assert [r.turn for r in requests] == [0, 1, 2]
  assert [r.shared_prefix_len for r in requests] == [0, 1024, 1024]
  a, b, c = (r.prompt_ids for r in requests)
  assert a[:1024] == b == c[:1024] and a[1024:1100] != c[1024:1100]  # equal ids, equal tokens
  assert max(a + b + c) < 1000 and min(a + b + c) >= 0
  assert workloads.block_tokens(3, 512, 1000) == c[1024:1536]  # the id alone decides
  small = list(workloads.block_trace_requests(path, 1000, start=1, limit=1, length_scale=1 / 32))
  assert len(small) == 1 and len(small[0].prompt_ids) == 32 and small[0].arrival_time == 0.0
  assert small[0].prompt_ids == workloads.block_tokens(0, 16, 1000) + workloads.block_tokens(
      1, 16, 1000)


@pytest.mark.parametrize('line, message', [
    ('{"timestamp": 5, "input_length": 10, "output_length": 1}', "line 2: field 'hash_ids' is "
     'missing'),
    ('{"timestamp": 5, "input_length": -3, "output_length": 1, "hash_ids": []}',
     r"line 2: field 'input_length'=-3 is not allowed: an integer >= 0"),
    ('{"timestamp": 5, "input_length": 10.5, "output_length": 1, "hash_ids": [0]}',
     r"line 2: field 'input_length'=10.5 is not allowed"),
    ('{"timestamp": 5, "input_length": 10, "output_length": "2", "hash_ids": [0]}',
     "line 2: field 'output_length'='2' is not allowed"),
    ('{"timestamp": 5, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]}',
     r"line 2: field 'hash_ids' has 2 ids, not allowed for input_length=1100: ceil"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [0.5]}',
     "line 2: field 'hash_ids' is not allowed: a list of integers"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}',
     "line 2: field 'timestamp'=-1 is not allowed"),
    ('{"timestamp": 5, "input_length": 10', 'line 2: not a JSON object'),
    ('[1, 2]', 'line 2: a JSON list, not an object'),
])
def test_a_malformed_block_trace_names_the_line_and_field(tmp_path, line, message):
  path = _trace_file(tmp_path, [GOOD[2], line])
  with pytest.raises(workloads.TraceFormatError, match=message):
    list(workloads.read_block_trace(path))


def test_block_trace_refuses_timestamps_out_of_order_and_streams(tmp_path):
  path = _trace_file(tmp_path, [GOOD[2], GOOD[0]])
  reader = workloads.read_block_trace(path)
  assert next(reader).timestamp_ms == 2500  # read before the bad line is reached
  with pytest.raises(workloads.TraceFormatError, match=r"line 2: field 'timestamp'=0 is out of "
                     'order'):
    next(reader)
  assert len(list(workloads.read_block_trace(path, limit=1))) == 1  # never reads line 2


@pytest.mark.parametrize('design, block_size', [('hash', 16), ('radix', 16), ('hash', 8)])
def test_a_token_cache_sees_exactly_the_traces_reuse(design, block_size):
  """The first requests of Mooncake's trace as tokens (16 per trace block), served one at a
  time through the real BlockManager and prefix cache with room for everything: the hit tokens
  are the trace's reuse, counted from the hash ids, block for block."""
  n, scale = 120, 1 / 32
  records = list(workloads.read_block_trace(MOONCAKE, limit=n))
  cache = {'hash': PrefixCache, 'radix': RadixCache}[design](block_size)
  blocks = BlockManager(BlockAllocator(60000, cache=cache), block_size, 'paged', 10**6)
  for i, r in enumerate(workloads.block_trace_requests(MOONCAKE, 49152, limit=n,
                                                       length_scale=scale)):
    seq = Sequence(i, r.prompt_ids, SamplingParams(max_new_tokens=1))
    blocks.allocate_waiting(seq)
    seq.num_cached = seq.num_tokens
    blocks.offer_full_blocks(seq)
    blocks.deallocate(seq)
  seen, reused = set(), 0
  for r in records:
    full = r.hash_ids[:r.full_blocks]
    # a prompt that ends on a block boundary keeps its last block back (its last token runs)
    k = next((j for j, h in enumerate(full) if h not in seen), len(full))
    reused += min(k, r.full_blocks - (r.input_length % 512 == 0))
    seen.update(full)
  assert reused > 0 and cache.hit_tokens == reused * 16
