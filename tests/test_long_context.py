"""Contexts longer than the device pool, served by the engine with KV offload
(pagedjax/host/scheduling/offload.py, pagedjax/model/streamed_attention.py).

A tiny random model with a 4-block pool of 8 tokens (32 tokens) serves prompts of 4x and 16x
that pool: each long sequence keeps its newest 2 blocks on the device, older ones in host RAM,
streamed through attention 8 blocks per call (the last chunk padded), while the engine serves
ordinary requests in the same iterations; with parallel samples and beams, and with pools that
keep per-sequence lane state (KIVI key tails, recent-window rings). Everything must equal an
engine whose pool holds it all: greedy and seeded sampled tokens and beams identical, logits
and beam scores within float32 tolerance (atol 1e-4, as tests/test_paged_decode.py: only the
order of the same float32 sums differs); partial states within 1e-5 of a float64 dense oracle.
"""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.kernels import contract
from pagedjax.config import ConfigError, OffloadConfig
from pagedjax.device import pool as pool_lib
from pagedjax.device.kv_schemes import KVQuantConfig
from pagedjax.model import streamed_attention as sa
from pagedjax.cluster.index import KVIndex
from pagedjax.engine import Engine
from pagedjax.host import kv_events
from pagedjax.host.requests.intake import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.host.scheduling import offload_store
from pagedjax.host.scheduling.offload_store import OffloadStore
from pagedjax.host.scheduling.step_inputs import RowSpec, build_step_inputs
from pagedjax.long_context import LongContextDecoder, LongContextSettings
from pagedjax.model import llama
from pagedjax.model.step import CompiledStep
from tiny_models import engine_config, prompts, tiny

ATOL_LOGITS = 1e-4
BLOCK, POOL_BLOCKS = 8, 4  # the device pool: 32 tokens
POOL_TOKENS = BLOCK * POOL_BLOCKS
OFFLOAD = OffloadConfig(host_blocks=70, device_blocks=2, chunk_blocks=8)


def _engine(num_blocks, offload=None, **flat):
  cfg, params, step = tiny('gqa')
  flat = {'prefill_chunk': 16, 'decode_min_rows': 2, **flat}
  config, _ = engine_config(cfg, block_size=BLOCK, num_blocks=num_blocks, max_batch_size=4,
                            **flat)
  if offload is not None:
    config = dataclasses.replace(config, offload=offload)
  return Engine(cfg, params, config, step_fn=step, record_logits=True)


@pytest.fixture(scope='module')
def reference():
  """An engine whose pool holds every request here (64 blocks = 512 tokens)."""
  return _engine(65)


@pytest.fixture(scope='module')
def offloaded():
  return _engine(POOL_BLOCKS + 1, OFFLOAD)


def _solo(engine, prompt, params):
  return engine.generate([prompt], params)[0]


def _same(got, want):
  assert got.output_ids == want.output_ids
  np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), atol=ATOL_LOGITS,
                             rtol=0)


def test_16x_the_pool_beside_an_ordinary_sampled_request(offloaded, reference):
  # 500 + 12 = 512 tokens = 16x the pool, greedy; beside it a short top-k sampled request that
  # runs in the batched steps of the same iterations.
  long_prompt, short_prompt = prompts([500, 5], seed=3)
  long_params = SamplingParams(max_new_tokens=12)
  short_params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, seed=3)
  want = [_solo(reference, long_prompt, long_params), _solo(reference, short_prompt,
                                                            short_params)]
  before = dict(offloaded.stats)
  ids = [offloaded.submit(long_prompt, long_params), offloaded.submit(short_prompt, short_params)]
  offloaded.run()
  for i, w in zip(ids, want):
    _same(offloaded.finished[i], w)
  assert len(want[0].prompt_ids) + len(want[0].output_ids) == 16 * POOL_TOKENS
  delta = collections.Counter({k: offloaded.stats[k] - before.get(k, 0) for k in offloaded.stats})
  # 511 tokens cached = 64 blocks, the newest 2 on the device; the short one never streamed.
  assert offloaded.offload.counters['offloaded_blocks'] >= 62
  assert delta['streamed_tokens'] == 511 - 2 * BLOCK
  assert delta['prefill_steps'] + delta['decode_steps'] > 0 and delta['preemptions'] == 0
  # Every step streams every host block of every layer, padded to whole chunks of 8.
  chunk_bytes = 2 * 2 * OFFLOAD.chunk_blocks * tiny('gqa')[0].num_kv_heads * BLOCK * 12 * 4
  assert delta['streamed_bytes'] % chunk_bytes == 0
  # The host store holds nothing once they finish.
  assert offloaded.offload.allocator.num_used == 0 and offloaded.offload.available == 70


def test_decode_every_spreads_the_streamed_rows_over_the_neighbours_steps(offloaded, reference):
  # offload.decode_every=3: while the short request runs, the long one streams on one iteration
  # in three; alone, on every one. Tokens and logits are the all-device engine's.
  long_prompt, short_prompt = prompts([100, 4], seed=8)
  long_params, short_params = SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=9)
  want = [_solo(reference, long_prompt, long_params), _solo(reference, short_prompt,
                                                            short_params)]
  offloaded.offload.decode_every = 3
  try:
    ids = [offloaded.submit(long_prompt, long_params)]
    while offloaded.stats['streamed_steps'] == 0 or not any(
        s.output_ids for s in offloaded.running):
      offloaded.step()  # the long request to its first token
    ids.append(offloaded.submit(short_prompt, short_params))
    steps = []  # per iteration: (its number, the long one streamed, the short one ran)
    while offloaded.has_work():
      before = dict(offloaded.stats)
      offloaded.step()
      ran = {k: offloaded.stats[k] - before.get(k, 0) for k in
             ('streamed_steps', 'decode_steps', 'prefill_steps', 'joined_decode_rows')}
      # the short request's decode rows join the long one's streamed call when both decode
      steps.append((offloaded.scheduler.iterations, ran['streamed_steps'] > 0,
                    ran['decode_steps'] + ran['prefill_steps'] + ran['joined_decode_rows'] > 0))
  finally:
    offloaded.offload.decode_every = 1
  for i, w in zip(ids, want):
    _same(offloaded.finished[i], w)
  # Beside the short request's 9 iterations (its prompt, then 8 decodes) the long one streams
  # on those numbered 0 mod 3 only; alone, on every iteration.
  assert sum(batched for _, _, batched in steps) == 9
  assert all(streamed == (not batched or n % 3 == 0) for n, streamed, batched in steps)
  assert sum(streamed for _, streamed, _ in steps) == len(offloaded.finished[ids[0]].output_ids) - 1


@pytest.mark.parametrize('impl', ['reference', 'cpu'])
def test_ordinary_decodes_join_the_streamed_decode_batch(impl):
  # Two ordinary requests (one top-k sampled) submitted once a 200-token request (6x the pool)
  # decodes: their decode rows go through the streamed programs with it (offload.join_decodes,
  # one pass over the weights), with the XLA fold and with the native CPU kernel, whose host
  # span is then empty for them. With join_decodes off they run in the batched decode step.
  # Tokens and logits as the all-device engine's either way.
  reference = _engine(65, attention_impl=impl)
  engine = _engine(POOL_BLOCKS + 1, OFFLOAD, attention_impl=impl)
  long_prompt, sampled_prompt, greedy_prompt = prompts([200, 5, 9], seed=3)
  greedy = SamplingParams(max_new_tokens=12)
  sampled = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, seed=3)
  work = [(long_prompt, greedy), (sampled_prompt, sampled), (greedy_prompt, greedy)]
  want = [_solo(reference, p, s) for p, s in work]
  for join in (True, False):
    engine.offload.join_decodes = join
    before = dict(engine.stats)
    ids = [engine.submit(*work[0])]
    while not any(s.output_ids for s in engine.running):
      engine.step()
    ids += [engine.submit(*w) for w in work[1:]]
    engine.run()
    for i, w in zip(ids, want):
      _same(engine.finished[i], w)
    joined = engine.stats['joined_decode_rows'] - before.get('joined_decode_rows', 0)
    assert (joined > 0) == join
  assert engine.executor.streamed.native == (impl == 'cpu')


def test_4x_the_pool_with_parallel_samples_sharing_its_prefix(offloaded, reference):
  # 120 + 8 = 128 tokens = 4x the pool; n=2 top-p samples fork from one offloaded prefill.
  prompt = prompts([120], seed=5)[0]
  params = SamplingParams(max_new_tokens=8, n=2, temperature=0.9, top_p=0.9, seed=11)
  want = reference.generate([prompt], params)
  streamed = offloaded.stats['streamed_tokens']
  got = offloaded.generate([prompt], params)
  for g, w in zip(got, want):
    _same(g, w)
  assert got[0].output_ids != got[1].output_ids  # two samples, not one twice
  # The prompt was streamed once (by the leader), then each sample decoded its own tokens.
  assert offloaded.stats['streamed_tokens'] - streamed == 120 - 2 * BLOCK + 2 * 8 - 1


def test_4x_the_pool_with_beams_preempted_beside_another_long_request(offloaded, reference):
  # 100 + 28 = 128 tokens = 4x the pool, beam_width=2, submitted after a 70-token greedy
  # request (2.2x the pool). The beams fork from one streamed prefill sharing its host blocks,
  # decode in streamed batches, and move the blocks they share out of their windows each on its
  # own; the pool cannot hold both requests' windows, so the group is preempted (recomputed:
  # its beams come back sharing nothing) while the older request runs on.
  first, long_prompt = prompts([60], seed=22)[0], prompts([100], seed=21)[0]
  params = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=28, beam_width=2)]
  want = [_solo(reference, p, s) for p, s in zip((first, long_prompt), params)]
  before = dict(offloaded.stats)
  ids = [offloaded.submit(p, s) for p, s in zip((first, long_prompt), params)]
  offloaded.run()
  plain, beams = (offloaded.finished[i] for i in ids)
  _same(plain, want[0])
  assert [ids for ids, _ in beams.beams] == [ids for ids, _ in want[1].beams]
  np.testing.assert_allclose([score for _, score in beams.beams],
                             [score for _, score in want[1].beams], atol=ATOL_LOGITS, rtol=0)
  assert beams.beams[0][0] != beams.beams[1][0] and beams.num_preemptions >= 1
  assert offloaded.stats['forks'] > before.get('forks', 0)
  assert offloaded.offload.allocator.num_used == 0 and offloaded.offload.available == 70


def test_a_follow_up_turn_over_a_long_document_hits_its_offloaded_blocks(reference):
  # prefix_cache.enabled: a 110-token document (3.4x the pool) and its greedy answer; the
  # blocks it moved out of its window, and at its end the full ones its window held, stay in
  # the offload store, indexed. The follow-up turn (document, answer, a new question: 125
  # tokens) takes all 14 of them and computes only its last 13 tokens; its two top-k samples
  # fork from there. A second long document then needs the store's room: the idle blocks are
  # evicted (LRU), and the first document's follow-up, asked again, finds only what is left.
  # Every output equals the all-device engine without a cache.
  engine = _engine(POOL_BLOCKS + 1, dataclasses.replace(OFFLOAD, host_blocks=40),
                   prefix_caching=True)
  log = engine.prefix_cache.events.subscribe(kv_events.EventLog())  # the index's entries too
  doc, other = prompts([110, 230], seed=4)
  greedy = SamplingParams(max_new_tokens=6)
  first = _solo(engine, doc, greedy)
  _same(first, _solo(reference, doc, greedy))
  figures = engine.offload.figures()
  assert figures['offload_cached_blocks'] == figures['offload_idle_blocks'] == 115 // BLOCK
  assert engine.offload.allocator.num_used == 14 and engine.offload.available == 40
  index = KVIndex()
  index.apply(0, log.drain(0.0))
  assert index.num_blocks(0, kv_events.MEDIUM_CPU) == 14

  follow_up = doc + first.output_ids + prompts([9], seed=5)[0]
  sampled = SamplingParams(max_new_tokens=5, n=2, temperature=0.9, top_k=20, seed=2)
  before = dict(engine.stats)
  got = engine.generate([follow_up], sampled)
  for g, w in zip(got, reference.generate([follow_up], sampled)):
    _same(g, w)
  assert got[0].output_ids != got[1].output_ids
  # 112 tokens hit: the leader prefills 12, each sample feeds the last prompt token itself
  assert engine.stats['prompt_tokens_computed'] - before['prompt_tokens_computed'] == 12 + 2
  assert engine.offload.figures()['offload_prefix_hit_blocks'] == 14

  _same(_solo(engine, other, greedy), _solo(reference, other, greedy))  # 29 blocks moved out
  figures = engine.offload.figures()
  assert figures['offload_prefix_evictions'] > 0 and figures['offload_cached_blocks'] <= 40
  assert engine.offload.allocator.num_used == figures['offload_cached_blocks']
  index.apply(0, log.drain(1.0))  # evictions are BlockRemoved: the index follows the store
  assert index.num_blocks(0, kv_events.MEDIUM_CPU) == figures['offload_cached_blocks']
  before = dict(engine.stats)
  _same(_solo(engine, follow_up, greedy), _solo(reference, follow_up, greedy))
  computed = engine.stats['prompt_tokens_computed'] - before['prompt_tokens_computed']
  assert 13 < computed < 125 or figures['offload_cached_blocks'] == 29  # partly evicted


def test_a_recomputed_offloaded_sequence_takes_back_its_own_blocks(reference):
  # A short request (10 + 12 tokens, 3 blocks at its end), then a long one (70 + 12) in a
  # window of 2: together they fill the pool, so when the short one needs its third block the
  # newer, long one is preempted (recompute). With prefix caching its offloaded blocks stay
  # indexed, so on readmission it takes them back and prefills only what its window held.
  # Tokens and logits as the all-device engine's.
  engine = _engine(POOL_BLOCKS + 1, OFFLOAD, prefix_caching=True)
  ps = prompts([10, 70], seed=31)
  params = SamplingParams(max_new_tokens=12)
  got = engine.generate(ps, params)
  for g, p in zip(got, ps):
    _same(g, _solo(reference, p, params))
  assert got[1].num_preemptions >= 1 and engine.stats['preemptions'] >= 1
  # Recomputed: at most what its window of 2 blocks held (without the index: all 72 tokens).
  assert engine.offload.figures()['offload_prefix_hit_blocks'] > 0
  assert 0 < engine.stats['recomputed_tokens'] <= 2 * BLOCK


@pytest.mark.parametrize('design', ['hash', 'radix'])
def test_offloaded_prefix_hits_for_a_quantized_pool_with_kivi_keys(design):
  # int4 with KIVI keys (a partial block's keys in a per-lane tail): the follow-up starts at a
  # block boundary on blocks taken from the store; greedy tokens as the same offloaded engine's
  # without a cache, which gives the all-device tokens
  # (test_kivi_keys_and_a_recent_window_give_the_all_device_tokens; tests/test_scheme_identity.py:
  # tokens do not depend on the write path). One pool shape: the programs compile once.
  spec = KVQuantConfig('int4', 6, key_per_channel=True)
  doc, question = prompts([100], seed=41)[0], prompts([7], seed=42)[0]
  greedy = SamplingParams(max_new_tokens=5)
  reference = _engine(POOL_BLOCKS + 1, OFFLOAD, kv_quant=spec)
  engine = _engine(POOL_BLOCKS + 1, OFFLOAD, kv_quant=spec, prefix_caching=True,
                   prefix_cache_design=design)
  first = _solo(engine, doc, greedy)
  assert first.output_ids == _solo(reference, doc, greedy).output_ids
  follow_up = doc + first.output_ids + question
  assert (_solo(engine, follow_up, greedy).output_ids ==
          _solo(reference, follow_up, greedy).output_ids)
  assert engine.offload.figures()['offload_prefix_hit_blocks'] == 104 // BLOCK


def test_a_warm_engine_compiles_nothing_more(offloaded):
  offloaded.generate(prompts([45], seed=6), SamplingParams(max_new_tokens=3))  # warm already
  before = offloaded.num_compilations
  offloaded.generate(prompts([70], seed=9), SamplingParams(max_new_tokens=5, temperature=1.0))
  assert offloaded.num_compilations == before


def test_two_long_requests_batched_in_one_streamed_call(offloaded, reference):
  # 72 + 6 and 84 + 6 tokens (2.4x and 2.8x the pool), greedy, submitted together: their prompt
  # chunks, then their decode tokens, go through the streamed path as batches of two rows (the
  # shorter one's missing second chunk padded), with the tokens of each alone.
  ps = prompts([72, 84], seed=12)
  params = SamplingParams(max_new_tokens=6)
  want = [_solo(reference, p, params) for p in ps]
  alone = [_solo(offloaded, p, params) for p in ps]
  counters = offloaded.executor.streamed.counters
  pairs = counters['batches_of_2_rows']
  got = offloaded.generate(ps, params)
  for g, a, w in zip(got, alone, want):
    _same(g, w)
    assert g.output_ids == a.output_ids
  assert counters['batches_of_2_rows'] - pairs >= params.max_new_tokens - 1  # the decodes, at least
  # Warm now for one and two rows, and for their fold-step buckets (the decodes' 1 and 2
  # chunks are bucket 2, the prompt chunks' bucket 1): another pair of other lengths with the
  # same buckets compiles nothing.
  before = offloaded.num_compilations
  offloaded.generate(prompts([76, 80], seed=13), SamplingParams(max_new_tokens=3))
  assert offloaded.num_compilations == before


def test_layer_groups_stream_every_layer_as_the_dense_model():
  # A 7-layer model in streamed programs of 3 layers (groups of 3, 3 and 1: two program
  # shapes), at 3.2x the pool. The groups' host reads go into two alternating sets of buffers,
  # so the third group's refill the first's: greedy tokens and logits as the dense no-cache
  # forward over the same tokens (the reference here: one program, not an engine's several).
  cfg = dataclasses.replace(tiny('gqa')[0], num_layers=7)
  params = llama.init_params(cfg, seed=1)
  config, _ = engine_config(cfg, block_size=BLOCK, num_blocks=POOL_BLOCKS + 1, max_batch_size=4,
                            prefill_chunk=16, decode_min_rows=2)
  offload = dataclasses.replace(OFFLOAD, layers_per_call=3)
  engine = Engine(cfg, params, dataclasses.replace(config, offload=offload),
                  step_fn=CompiledStep(cfg, return_logits=True), record_logits=True)
  prompt = prompts([100], seed=3)[0]
  got = _solo(engine, prompt, SamplingParams(max_new_tokens=3))
  forward = jax.jit(llama.forward_dense, static_argnums=0)  # one compile, not one per op
  dense = np.asarray(forward(cfg, params, np.array([prompt + got.output_ids])))[0]
  want = dense[len(prompt) - 1:-1]  # the logits each new token was sampled from
  assert got.output_ids == list(np.argmax(want, axis=-1))
  np.testing.assert_allclose(np.stack(got.logits), want, atol=ATOL_LOGITS, rtol=0)
  counters = engine.executor.streamed.counters
  assert counters['layer_calls'] == 3 * counters['batches'] and counters['fold_steps'] > 0


def test_fold_steps_pad_rows_and_steps_with_block_0_unseen():
  # Rows of 5 and 1 host blocks (and two padding rows) in chunks of 2 blocks of 2 tokens: 3
  # steps, padded to 4; step-major ids, the store's read order.
  steps = sa.fold_steps([[7, 8, 9, 10, 11], [3]], 4, 2, 2)
  assert steps.num_steps == 3 and steps.positions.shape == (4, 4, 2, 2)
  ids = steps.ids.reshape(4, 4, 2)
  assert ids[:, 0].tolist() == [[7, 8], [9, 10], [11, 0], [0, 0]]
  assert ids[:, 1].tolist() == [[3, 0], [0, 0], [0, 0], [0, 0]] and not ids[:, 2:].any()
  assert steps.positions[2, 0].tolist() == [[8, 9], [-1, -1]]
  assert steps.positions[0, 1].tolist() == [[0, 1], [-1, -1]]
  assert (steps.positions[3] == -1).all() and (steps.positions[:, 2:] == -1).all()
  assert [sa.step_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_disk_placement_gives_the_all_device_tokens(reference, tmp_path):
  # Blocks leaving the window go to the disk tier first (6 blocks there), then host RAM: the
  # 4x-the-pool request holds blocks on both, and chunks mix them. Tokens as all-device.
  offload = dataclasses.replace(OFFLOAD, host_blocks=20, disk_blocks=6,
                                disk_kvstore=str(tmp_path), placement='disk')
  engine = _engine(POOL_BLOCKS + 1, offload)
  prompt = prompts([120], seed=14)[0]
  params = SamplingParams(max_new_tokens=8)
  _same(_solo(engine, prompt, params), _solo(reference, prompt, params))
  figures = engine.offload.figures()
  assert figures['offload_disk_bytes_read'] > 0 and figures['offload_host_bytes_read'] > 0
  assert figures['offload_disk_blocks_used'] == figures['offload_host_blocks_used'] == 0
  with pytest.raises(RequestError, match=r'needs up to 27 host blocks .* offload.host_blocks '
                                         r'\+ offload.disk_blocks is 20 \+ 6 = 26 \(host RAM '
                                         r'and the disk tier\): it can never fit'):
    engine.submit(prompts([220], seed=3)[0], SamplingParams(max_new_tokens=12))
  assert [p.name for p in tmp_path.iterdir()][0].startswith('offload-')
  engine.offload.store.close()  # its directory goes with it
  assert not list(tmp_path.iterdir())


def test_offload_store_keeps_every_dtype_bit_for_bit_on_both_tiers(tmp_path):
  # A quantized pool's fields (int8 codes, bfloat16 and float32 scales) through host RAM (ids
  # 1..3) and the disk tier (4..8), read one layer at a time with padding and a repeated id.
  shapes = {'k': ((2, 9, 2, 4, 8), np.int8), 'k_scale': ((2, 9, 2, 4), jnp.bfloat16),
            'v_scale': ((2, 9, 2), np.float32)}
  store = OffloadStore(shapes, host_blocks=3, disk_blocks=5, disk_kvstore=str(tmp_path),
                       placement='host')
  ids = store.allocator.allocate(7)
  assert ids == [1, 2, 3, 4, 5, 6, 7]  # host RAM first, then the disk tier
  rng = np.random.default_rng(0)
  data = {name: (rng.integers(-128, 128, (2, 7) + shape[2:]) if dtype == np.int8 else
                 rng.normal(size=(2, 7) + shape[2:])).astype(dtype)
          for name, (shape, dtype) in shapes.items()}
  store.store(ids, data)
  read = [0, 6, 2, 6, 4]  # padding, disk, host, disk again, disk
  got = store.start_read(1, read)()
  for name, want in data.items():
    expect = np.stack([np.zeros_like(want[1, 0]) if i == 0 else want[1, i - 1] for i in read])
    assert got[name].dtype == want.dtype
    assert got[name].tobytes() == expect.tobytes()
  assert store.bytes_read['disk'] == 3 * store.layer_block_bytes  # padding is not counted
  store.close()
  assert not list(tmp_path.iterdir())


def test_kivi_keys_and_a_recent_window_give_the_all_device_tokens():
  # The pools with per-sequence lane state: int4 with KIVI keys (a partial block's keys in a
  # bfloat16 tail per lane) and a recent window of 12 tokens (bfloat16 rings per lane, longer
  # than the window's newest full block, so some ring tokens are in host blocks). 120 + 8 =
  # 128 tokens, 4x the pool.
  spec = KVQuantConfig('int4', 6, key_per_channel=True, recent_window=12)
  prompt, params = prompts([120], seed=5)[0], SamplingParams(max_new_tokens=8)
  # The reference feeds the prompt token by token (one compiled step): what a query reads does
  # not depend on how its tokens arrived (tests/test_scheme_identity.py).
  reference = _engine(17, kv_quant=spec, preemption='recompute', prefill_chunk=1,
                      decode_min_rows=1)
  offloaded = _engine(POOL_BLOCKS + 1, OFFLOAD, kv_quant=spec, preemption='recompute')
  # Beside it an ordinary request, submitted once the long one decodes: its decode rows join
  # the streamed programs (offload.join_decodes) with their own lane's tail and rings.
  short = prompts([6], seed=6)[0]
  want = [_solo(reference, prompt, params), _solo(reference, short, params)]
  ids = [offloaded.submit(prompt, params)]
  while not any(s.output_ids for s in offloaded.running):
    offloaded.step()
  ids.append(offloaded.submit(short, params))
  offloaded.run()
  for i, w in zip(ids, want):
    _same(offloaded.finished[i], w)
  assert offloaded.stats['streamed_tokens'] == 120 - 2 * BLOCK + 8 - 1
  assert offloaded.stats['joined_decode_rows'] > 0


def test_offload_instead_of_preempting(reference):
  # Both fit the pool alone, not together: the one holding more blocks shrinks to its window.
  engine = _engine(POOL_BLOCKS + 1, dataclasses.replace(OFFLOAD, instead_of_preempting=True))
  ps = prompts([10, 6], seed=7)
  params = [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=10)]
  want = [_solo(reference, p, s) for p, s in zip(ps, params)]
  ids = [engine.submit(p, s) for p, s in zip(ps, params)]
  engine.run()
  for i, w in zip(ids, want):
    _same(engine.finished[i], w)
  assert engine.stats['preemptions'] == 0
  assert engine.offload.counters['offloaded_under_pressure'] >= 1


def test_the_thin_decoder_reports_each_step():
  cfg, params, step = tiny('gqa')
  base, _ = engine_config(cfg, max_batch_size=4, decode_min_rows=2)  # shapes as above
  decoder = LongContextDecoder(cfg, params, LongContextSettings(
      block_size=BLOCK, pool_blocks=POOL_BLOCKS, window_blocks=2, chunk_blocks=4,
      prefill_chunk=16), base=base, step_fn=step)
  result = decoder.generate(prompts([60], seed=8)[0], SamplingParams(max_new_tokens=4))
  assert len(result.output_ids) == 4 and len(result.step_seconds) == 3
  # 60..62 cached in decode steps: blocks 0..5 on the host, then 0..5 again (63 is in block 7).
  assert result.step_host_blocks == [6, 6, 6]
  assert result.step_bytes_streamed == [2 * result.chunk_bytes * cfg.num_layers] * 3


def test_refused_beyond_host_ram_and_for_beams(offloaded):
  long_prompt = prompts([500], seed=3)[0]
  with pytest.raises(RequestError, match=r'needs up to 71 host blocks .* for n=4 samples .* '
                                         r'offload.host_blocks is 70: it can never fit'):
    offloaded.submit(long_prompt, SamplingParams(max_new_tokens=12, n=4))
  # Beams: the leader's 61 host blocks and, back from a recompute, a second copy of them.
  with pytest.raises(RequestError, match=r'needs up to 122 host blocks .* for beam_width=2 '
                                         r'beams .* offload.host_blocks is 70'):
    offloaded.submit(long_prompt, SamplingParams(max_new_tokens=4, beam_width=2))
  with pytest.raises(RequestError, match=r'beam_width=3: a beam group decodes together, each '
                                         r'beam holding up to offload.device_blocks=2 device '
                                         r"blocks, but 3 x 2 is more than the pool's 4"):
    offloaded.submit(prompts([100], seed=3)[0], SamplingParams(max_new_tokens=4, beam_width=3))
  plain = _engine(POOL_BLOCKS + 1)
  with pytest.raises(RequestError, match=r'it can never fit \(offload.host_blocks > 0'):
    plain.submit(long_prompt, SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize('changes,message', [
    (dict(device_blocks=5), r'offload.device_blocks=5 is not allowed: at most pool.num_blocks'),
    (dict(chunk_blocks=0), r'offload.chunk_blocks=0 is not allowed: an integer >= 1'),
    (dict(host_blocks=-1), r'offload.host_blocks=-1 is not allowed'),
    (dict(instead_of_preempting=1), r'offload.instead_of_preempting=1 is not allowed'),
    (dict(cache_blocks='yes'), r"offload.cache_blocks='yes' is not allowed: True or False"),
    (dict(placement='nvme'), r"offload.placement='nvme' is not allowed: 'host' or 'disk'"),
    (dict(disk_blocks=4), r"offload.disk_kvstore='' is not allowed: a directory or"),
    (dict(placement='disk'), r"offload.placement='disk' is not allowed: 'host' when "
                             r'offload.disk_blocks is 0'),
])
def test_bad_offload_config_is_refused(changes, message):
  cfg = tiny('gqa')[0]
  config, _ = engine_config(cfg, block_size=BLOCK, num_blocks=POOL_BLOCKS + 1, max_batch_size=4)
  with pytest.raises(ConfigError, match=message):
    dataclasses.replace(config, offload=dataclasses.replace(OFFLOAD, **changes)).validate()


def _stream_one_layer(cfg, lp, pool, x, start, count, host_blocks, window_blocks, chunk_blocks,
                      lane, native=False):
  """Layer 0's attention for one row of x [1, T, D] (count tokens at start.., the rest
  padding) through the streamed path: its window's state, then its host blocks (physical
  blocks of the same pool here) folded in chunks; native: both through the native CPU kernel
  (sa.native_layer_attention) instead. -> (attention output [T, Hq, Dh], pool)."""
  bs = pool.block_size
  streamed = sa.StreamedAttention(cfg, bs, len(window_blocks), chunk_blocks, [x.shape[1]])
  row = sa.StreamedRow([0] * count, start, host_blocks, window_blocks, 0.0, 0, 1.0, 0, 0, lane)
  inputs = sa.RowInputs(*streamed.row_inputs([row], 1, x.shape[1]))
  steps = sa.fold_steps([host_blocks], 1, chunk_blocks, bs)
  chunks = {name: np.asarray(a)[0][steps.ids].reshape((len(steps.positions), -1) + a.shape[2:])
            for name, a in pool.block_arrays().items()}  # as the offload store holds them (host)

  @jax.jit
  def attend(pool, x, chunks):
    q, k, v = llama.layer_qkv(cfg, lp, x, inputs.positions)
    if native:
      return sa.native_layer_attention(pool, np.int32(0), q, k, v, inputs, chunks)
    return sa.layer_attention(pool, np.int32(0), q, k, v, inputs, chunks, steps.positions,
                              steps.num_steps)

  pool, out = attend(pool, x, chunks)
  if native:
    return out[0], pool
  return sa.normalise(jax.tree_util.tree_map(lambda a: a[0], out), cfg.num_heads), pool


@pytest.mark.parametrize('kv_dtype', ['float32', 'int8'])
def test_the_native_kernel_reads_the_window_and_the_host_blocks_as_the_all_device_step(
    kv_dtype):
  """Where the engine's attention is the native CPU kernel, a pool it reads natively streams
  through it too (sa.native_layer_attention: the window read in place, every host block in one
  call, the two merged by their log-sum-exp), not through the fold: one layer, a prompt chunk
  (a padded query among them) and then a decode over 5 host blocks and a window of 3, against
  the all-device step on the same kernel (within 1e-5) and leaving the pool as it does, bit
  for bit. The engine takes this path on a CPU (the long_context study's `:tiny` run checks its
  tokens end to end, tests/test_study_smoke.py); the fold is what every other backend runs."""
  from pagedjax.kernels import cpu  # pylint: disable=import-outside-toplevel
  if not cpu.available():
    pytest.skip(f'the native CPU kernel is unavailable: {cpu.unavailable_reason()}')
  cfg, params, _ = tiny('gqa')
  lp = llama.per_layer_params(params)['params']['layer_0']
  bs, num_tokens, table = 8, 16, list(range(1, 11))
  spec = KVQuantConfig(kv_dtype)
  pool = pool_lib.init_pool(cfg.num_layers, 12, cfg.num_kv_heads, bs, cfg.head_dim,
                            kv_quant=spec)
  assert pool.scheme.kernel_native
  rng = np.random.default_rng(1)
  inputs = lambda start, count: build_step_inputs([RowSpec([0] * count, start, table)], bs, [1],
                                                  [num_tokens], [len(table)])

  @jax.jit
  def all_device(pool, x, batch):
    q, k, v = llama.layer_qkv(cfg, lp, x, batch.positions)
    return pool_lib.write_and_attend(pool, 0, q, k, v, batch.positions, batch, 'cpu')

  x_of = lambda: rng.normal(size=(1, num_tokens, cfg.d_model)).astype(np.float32)
  for start in (0, 16, 32):  # the history, 48 tokens
    pool = all_device(pool, x_of(), inputs(start, 16))[1]
  for start, count in ((48, 13), (61, 1)):  # blocks 0..4 on the host, the window 5..7
    x = x_of()
    x[:, count:] = 0.0
    want, want_pool = all_device(pool, x, inputs(start, count))
    got, got_pool = _stream_one_layer(cfg, lp, pool, x, start, count, table[:5], table[5:8],
                                      2, 0, native=True)
    np.testing.assert_allclose(np.asarray(got)[:count], np.asarray(want)[0, :count],
                               atol=1e-5, rtol=1e-5)
    for name, a in want_pool.block_arrays().items():
      assert np.asarray(getattr(got_pool, name))[:, 1:].tobytes() == np.asarray(a)[:, 1:].tobytes()
    pool = want_pool


def test_a_recent_window_over_host_blocks_reads_what_the_all_device_step_reads():
  # One layer of an int8 pool with a recent window of 20 tokens, longer than the device
  # window's newest full blocks: a sequence's history written by the all-device step's own
  # path (pool.write_and_attend over its whole block table), then a prompt chunk and a decode
  # read both ways. The streamed path's output is within 1e-5 of the all-device step's, and it
  # leaves every block and ring as that step does, bit for bit. (The engine test above covers
  # a recent window over KIVI keys; this covers one over a format read whole, int8.)
  spec = KVQuantConfig('int8', recent_window=20)
  cfg, params, _ = tiny('gqa')
  lp = llama.per_layer_params(params)['params']['layer_0']
  bs, lane, num_tokens = 8, 1, 16
  table = list(range(1, 11))  # logical block i in physical block i + 1: 80 tokens
  pool = pool_lib.init_pool(cfg.num_layers, 12, cfg.num_kv_heads, bs, cfg.head_dim,
                            kv_quant=spec, max_sequences=2)
  rng = np.random.default_rng(0)

  def inputs(start, count):
    return build_step_inputs([RowSpec([0] * count, start, table, lane=lane)], bs, [1],
                             [num_tokens], [len(table)])

  @jax.jit  # one program for every step here (all of one shape)
  def all_device(pool, x, batch):
    q, k, v = llama.layer_qkv(cfg, lp, x, batch.positions)
    return pool_lib.write_and_attend(pool, 0, q, k, v, batch.positions, batch, 'reference')

  x_of = lambda: rng.normal(size=(1, num_tokens, cfg.d_model)).astype(np.float32)
  for start, count in ((0, 16), (16, 16), (32, 16), (48, 13)):  # the history, 61 tokens
    pool = all_device(pool, x_of(), inputs(start, count))[1]
  # A chunk of 11 (61..71: blocks 7 and 8 fill) with logical blocks 0..5 (0..47) on the
  # host, the window 6..8; then a decode starting block 9, the window 7..9. A recent window
  # of 20 reaches back to 42 (query 61) and 53 (query 72): into host blocks too.
  for start, count, on_host in ((61, 11, 6), (72, 1, 7)):
    x = x_of()
    x[:, count:] = 0.0
    want, want_pool = all_device(pool, x, inputs(start, count))
    got, got_pool = _stream_one_layer(cfg, lp, pool, x, start, count, table[:on_host],
                                      table[on_host:on_host + 3], 4, lane)
    np.testing.assert_allclose(np.asarray(got)[:count], np.asarray(want)[0, :count],
                               atol=1e-5, rtol=1e-5)
    for name in ('k', 'v', 'k_scale', 'v_scale', 'recent_k', 'recent_v'):
      # Block 0 (the null block) and lane 0 (the null lane) take padding: not compared.
      a, b = (np.asarray(getattr(p, name))[:, 1:] for p in (got_pool, want_pool))
      assert a.tobytes() == b.tobytes(), name
    pool = want_pool


@pytest.mark.parametrize('pool', [
    dict(kv_dtype='int4', kv_group_size=6, kv_key_per_channel=True),
    dict(kv_dtype='int8', kv_recent_window=12)])
def test_pools_with_lane_state_are_offloaded(pool):
  # KIVI key tails and recent-window rings stay on the device with the window (their blocks
  # stream as stored): validation accepts offload with them.
  config, _ = engine_config(tiny('gqa')[0], block_size=BLOCK, num_blocks=POOL_BLOCKS + 1,
                            max_batch_size=4)
  config = dataclasses.replace(config, offload=OFFLOAD,
                               pool=dataclasses.replace(config.pool, **pool))
  assert config.validate().offload.enabled


def _dense_attention(q, q_pos, k, v, kv_pos):
  """float64 oracle: q [T, Hq, D]; k, v [S, Hkv, D]; query t sees 0 <= kv_pos <= q_pos[t]."""
  num_heads, group = q.shape[1], q.shape[1] // k.shape[1]
  out = np.zeros(q.shape)
  for t in range(q.shape[0]):
    seen = (kv_pos >= 0) & (kv_pos <= q_pos[t])
    for h in range(num_heads):
      if seen.any():
        s = k[seen, h // group].astype(np.float64) @ q[t, h] / np.sqrt(q.shape[-1])
        p = np.exp(s - s.max())
        out[t, h] = p / p.sum() @ v[seen, h // group]
  return out


def test_streamed_attention_matches_dense_attention():
  rng = np.random.default_rng(0)
  heads, kv_heads, dim, bs = 6, 2, 8, 4
  context = 37  # the queries' own tokens included: positions 34, 35, 36
  k = rng.normal(size=(context, kv_heads, dim)).astype(np.float32)
  v = rng.normal(size=(context, kv_heads, dim)).astype(np.float32)
  q = (3 * rng.normal(size=(4, heads, dim))).astype(np.float32)  # peaked softmax rows too
  q_pos = np.array([34, 35, 36, -1], np.int32)  # the last query is padding

  def span(blocks, positions):
    """Blocks [N, Hkv, bs, D] holding `positions` (-1: empty slot, filled with garbage)."""
    positions = np.asarray(positions, np.int32).reshape(blocks, bs)
    kb = rng.normal(size=(blocks, kv_heads, bs, dim)).astype(np.float32) * 1e3
    vb = kb.copy()
    real = positions >= 0
    kb.transpose(0, 2, 1, 3)[real] = k[positions[real]]
    vb.transpose(0, 2, 1, 3)[real] = v[positions[real]]
    return kb, vb, positions

  # Host blocks 0..6 (28 tokens) in chunks of 3 blocks, the last padded with two empty blocks;
  # a window of 3 slots holding blocks 8, 7 and 9 (36 partly filled) in shuffled slots.
  pos = np.arange(48)
  chunks = [span(3, pos[0:12]), span(3, pos[12:24]), span(3, np.r_[pos[24:28], [-1] * 8])]
  window = span(3, np.r_[pos[32:36], pos[28:32], [36, -1, -1, -1]])
  @jax.jit  # one compilation for the whole check
  def three_ways(spans):
    states = [sa.partial_state(q, q_pos, *s) for s in spans]
    forwards, backwards = states[0], states[-1]
    for s in states[1:]:  # the engine's order: window first, then the chunks
      forwards = sa.combine(forwards, s)
    for s in states[-2::-1]:
      backwards = sa.combine(backwards, s)
    m, l, acc = (jnp.stack(x, axis=1) for x in zip(*states))  # [Hkv, S, R(, D)]
    merged = contract.merge_split_states(acc, m, l)  # the kernels' split merge, all at once
    return (sa.normalise(forwards, heads), sa.normalise(backwards, heads),
            contract.ungroup_rows(merged[None], len(q_pos), heads)[0])

  want = _dense_attention(q, q_pos, k, v, np.arange(context))
  for got in three_ways([window] + chunks):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.asarray(got)[3].any()  # the padded query sees nothing: zeros



def test_read_buffers_are_aligned_so_the_cpu_device_takes_them_in_place():
  """The streamed path's host buffers and the offload store's host RAM
  (offload_store.aligned_array) start on a 64-byte boundary, whatever numpy's allocator gives
  (16 bytes for large arrays), and on a CPU device a transfer of one aliases it rather than
  copying it: what keeps a streamed decode step off a copy of every host block it reads."""
  for shape, dtype in (((64, 3, 16, 64), np.float32), ((7, 2, 8, 12), np.int8),
                       ((5, 2, 8), np.float16)):
    for zeros in (False, True):
      a = offload_store.aligned_array(shape, dtype, zeros=zeros)
      assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous
      assert a.ctypes.data % offload_store.RAM_ALIGN == 0 and (not zeros or not a.any())
  if jax.default_backend() == 'cpu':
    a = offload_store.aligned_array((64, 3, 16, 64), np.float32)
    assert jax.device_put(a).unsafe_buffer_pointer() == a.ctypes.data
