"""Contexts longer than the device window (pagedjax/long_context.py).

A tiny random model decodes a context 4x its device window (newest blocks on the device, older
ones in host RAM, streamed back in chunks every step) and must give the same greedy tokens as the
normal engine with a pool big enough for everything. Tolerance: float32, atol 1e-4 on logits
(as tests/test_paged_decode.py: only the order of the same float32 sums differs) and 1e-5 on
attention outputs against a float64 dense oracle.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import contract
from pagedjax.device import streamed_attention as sa
from pagedjax.host.intake import RequestError
from pagedjax.host.sampling_params import SamplingParams
from pagedjax.long_context import LongContextDecoder, LongContextSettings
from tiny_models import VOCAB, make_engine, prompts, tiny

ATOL_LOGITS = 1e-4
# 4 blocks of 8 tokens on the device; 117 prompt + 11 new tokens = 128 = 4x the window. The
# prompt ends mid-chunk (padded prompt chunk); decode starts with 11 host blocks in chunks of 3
# (the last one padded) and ends with 12.
SETTINGS = LongContextSettings(block_size=8, window_blocks=4, chunk_blocks=3, prefill_chunk=16)
PROMPT_LEN, NEW_TOKENS = 117, 11


@pytest.fixture(scope='module')
def decoder():
  cfg, params, _ = tiny('gqa')
  return LongContextDecoder(cfg, params, SETTINGS)


@pytest.fixture(scope='module')
def runs(decoder):
  prompt = prompts([PROMPT_LEN], seed=3)[0]
  engine = make_engine('gqa', num_blocks=24)  # 23 blocks of 16: the whole context fits
  want = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS))[0]
  got = decoder.generate(prompt, NEW_TOKENS, record_logits=True)
  return want, got


def test_greedy_tokens_match_the_engine_with_a_big_pool(runs):
  want, got = runs
  window_tokens = SETTINGS.window_blocks * SETTINGS.block_size
  assert len(got.prompt_ids) + len(got.output_ids) == 4 * window_tokens
  assert got.output_ids == want.output_ids
  np.testing.assert_allclose(np.stack(got.logits), np.stack(want.logits), atol=ATOL_LOGITS,
                             rtol=0)
  # 127 tokens cached = 16 blocks, the newest 4 on the device.
  assert got.host_blocks == 12


def test_each_step_streams_every_host_block_of_every_layer(runs, decoder):
  _, got = runs
  cfg = decoder.cfg
  chunk = 2 * cfg.num_layers * decoder.block_bytes * SETTINGS.chunk_blocks  # K and V
  # Decode step i writes position 117 + i into block (117 + i) // 8, the window's newest: the
  # host then holds the blocks before the window's 4, padded up to whole chunks of 3.
  host = [(PROMPT_LEN + i) // SETTINGS.block_size + 1 - SETTINGS.window_blocks
          for i in range(NEW_TOKENS - 1)]
  assert got.step_bytes_streamed == [-(-h // SETTINGS.chunk_blocks) * chunk for h in host]


def test_a_warm_decoder_compiles_nothing(runs, decoder):
  del runs  # the decoder has served one request
  again = decoder.generate(prompts([40], seed=4)[0], 3)  # evicts, streams, pads: all shapes
  assert again.compilations == 0
  # 5 programs x 2 query lengths (a prompt chunk, one token), and the eviction.
  assert decoder.programs.num_compilations == 11


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
  # a window ring of 3 slots holding blocks 8, 7 and 9 (36 partly filled) in shuffled slots.
  pos = np.arange(48)
  chunks = [span(3, pos[0:12]), span(3, pos[12:24]), span(3, np.r_[pos[24:28], [-1] * 8])]
  window = span(3, np.r_[pos[32:36], pos[28:32], [36, -1, -1, -1]])
  @jax.jit  # one compilation for the whole check
  def three_ways(spans):
    states = [sa.partial_state(q, q_pos, *s) for s in spans]
    forwards, backwards = states[0], states[-1]
    for s in states[1:]:  # the decoder's order: window first, then the chunks
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


@pytest.mark.parametrize('changes,message', [
    (dict(window_blocks=0), 'window_blocks=0 is not allowed: an integer >= 1'),
    (dict(chunk_blocks=-2), 'chunk_blocks=-2 is not allowed'),
    (dict(chunk_blocks=True), 'chunk_blocks=True is not allowed'),
    (dict(block_size=2.5), 'block_size=2.5 is not allowed'),
    (dict(prefill_chunk=12), 'prefill_chunk=12 is not allowed: a multiple of block_size=8'),
    (dict(window_blocks=1), 'window_blocks=1 is not allowed .* at least 2'),
])
def test_bad_settings_are_refused(changes, message):
  fields = {**dict(block_size=8, window_blocks=4, chunk_blocks=3, prefill_chunk=16), **changes}
  with pytest.raises(ValueError, match=message):
    LongContextSettings(**fields).validate()


@pytest.mark.parametrize('prompt,new,message', [
    ([], 3, 'empty prompt'),
    ([1, VOCAB], 3, rf'token ids \[{VOCAB}\] out of vocabulary'),
    ([1, 2], 0, 'max_new_tokens=0 is not allowed'),
    ([1] * 500, 13, "exceed the model's max_seq_len=512"),
])
def test_bad_requests_are_refused(decoder, prompt, new, message):
  with pytest.raises(RequestError, match=message):
    decoder.generate(prompt, new)
