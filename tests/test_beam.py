"""Beam search (beam.py) through the engine: selection against brute force on the tiny model,
beam width 1 against greedy, and block bookkeeping while beams fork and drop. The sharing
study's beam part runs in tests/test_sharing.py (test_reproduce_sharing_tiny, `:tiny_beam`)."""
import numpy as np
import pytest

from pagedjax.host.requests import beam
from pagedjax.engine import RequestError
from pagedjax.host.requests.sampling_params import SamplingParams

from fakes import check_blocks
from tiny_models import VOCAB, dense_fn, make_engine, prompts, tiny


def _log_softmax(logits):
  """In numpy (float64): jax's would compile once per sequence length."""
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _logprobs(ids_batch):
  """Dense no-cache next-token log-probs after each row of ids_batch (same lengths)."""
  return _log_softmax(dense_fn('gqa')(np.asarray(ids_batch))[:, -1])


def _score(prompt, output_ids):
  """Summed log-prob of output_ids after prompt under the dense model (one call)."""
  logp = _log_softmax(dense_fn('gqa')(np.asarray([list(prompt) + list(output_ids)]))[0])
  start = len(prompt) - 1
  return float(sum(logp[start + i, t] for i, t in enumerate(output_ids)))


def _run(engine, prompt, params):
  rid = engine.submit(prompt, params)
  while engine.has_work():
    engine.step()
    check_blocks(engine)
  return engine.finished[rid]


# ---- host selection alone ------------------------------------------------------------------

def test_expand_ranks_over_all_beams_and_sets_eos_aside():
  ids = np.array([[5, 9, 2, 7], [9, 3, 5, 1]])
  lps = np.log(np.array([[.5, .3, .1, .05], [.6, .2, .1, .05]]))
  kept, ended = beam.expand([np.log(.5), np.log(.4)], ids, lps, width=2, eos_id=9, last=False)
  # Ranked: b0 5 (.25), b1 9 (.24), b0 9 (.15), b1 3 (.08): b1's EOS at rank 1 < width
  # finishes, b0's EOS at rank 2 does not, and b1 3 fills the second live beam.
  assert [(b, t) for b, t, _ in kept] == [(0, 5), (1, 3)]
  assert [(b, t) for b, t, _ in ended] == [(1, 9)]
  kept, ended = beam.expand([0.0, -1.0], ids, lps, width=3, eos_id=9, last=True)
  assert kept == [] and [(b, t) for b, t, _ in ended] == [(0, 5), (0, 9), (1, 9)]


def test_length_penalty_is_gnmt():
  assert beam.length_penalty(7, 0.0) == 1.0
  assert beam.length_penalty(7, 1.0) == pytest.approx(2.0)
  assert beam.topk_bucket(3, VOCAB) == 8 and beam.topk_bucket(64, VOCAB) == VOCAB


# ---- the tiny model ------------------------------------------------------------------------

@pytest.mark.parametrize('prompt_len', [37, 32])  # partly filled / full last block at the fork
def test_beam_width_one_is_greedy(prompt_len):
  prompt = prompts([prompt_len], seed=5)[0]
  greedy = make_engine().generate([prompt], SamplingParams(max_new_tokens=8))[0]
  one = _run(make_engine(), prompt, SamplingParams(max_new_tokens=8, beam_width=1))
  assert one.output_ids == greedy.output_ids
  assert one.score == pytest.approx(_score(prompt, greedy.output_ids), abs=1e-3)


def test_two_step_beams_match_brute_force():
  """Over two tokens, width-k beams are exactly the k best pairs (a, b) whose first token a is
  among the k best first tokens: enumerated here with the dense model over the whole vocab."""
  k, prompt = 3, prompts([37], seed=7)[0]
  out = _run(make_engine(), prompt, SamplingParams(max_new_tokens=2, beam_width=k))
  first = _logprobs([prompt])[0]
  second = _logprobs([prompt + [a] for a in range(VOCAB)])  # [a, b]
  pairs = first[:, None] + second
  allowed = np.argsort(-first)[:k]
  masked = np.full_like(pairs, -np.inf)
  masked[allowed] = pairs[allowed]
  order = np.argsort(-masked, axis=None)[:k]
  want = [list(np.unravel_index(i, pairs.shape)) for i in order]
  assert [ids for ids, _ in out.beams] == [[int(a), int(b)] for a, b in want]
  np.testing.assert_allclose([s for _, s in out.beams], masked.flat[order], atol=1e-3)
  # No pair beats the best beam by more than what pruning to k first tokens could lose, and
  # the best beam is at least as good as greedy's pair.
  greedy = make_engine().generate([prompt], SamplingParams(max_new_tokens=2))[0]
  assert out.score >= pairs[tuple(greedy.output_ids)] - 1e-4
  assert out.score <= pairs.max() + 1e-4


@pytest.mark.parametrize('width', [2, 4])
def test_beam_beats_greedy_and_frees_blocks(width):
  """Three beam requests next to a greedy one, forking and dropping beams: ref counts equal
  holders after every iteration, every block is free at the end, sharing saved memory, and
  each request's best beam scores at least greedy's under the dense model."""
  ps = prompts([37, 33, 20], seed=11)
  engine = make_engine(max_batch_size=8)  # the roomy engine of test_beams_survive_preemption
  greedy_engine = make_engine()  # one prompt at a time: the programs the tests above compiled
  greedy = [greedy_engine.generate([p], SamplingParams(max_new_tokens=5))[0] for p in ps]
  ids = [engine.submit(p, SamplingParams(max_new_tokens=5, beam_width=width)) for p in ps]
  other = engine.submit(ps[0], SamplingParams(max_new_tokens=7))
  while engine.has_work():
    engine.step()
    check_blocks(engine)
  assert engine.allocator.num_free == engine.allocator.num_blocks - 1
  assert engine.finished[other].output_ids[:5] == greedy[0].output_ids
  for rid, p, g in zip(ids, ps, greedy):
    out = engine.finished[rid]
    assert len(out.beams) == width and out.output_ids == out.beams[0][0]
    assert [s for _, s in out.beams] == sorted((s for _, s in out.beams), reverse=True)
    assert out.score == pytest.approx(_score(p, out.output_ids), abs=1e-3)
    assert out.score >= _score(p, g.output_ids) - 1e-3
  s = engine.summary()
  assert s['forks'] > 0 and s['cow_copies'] > 0 and s['kv_sharing_saved_fraction'] > 0


def test_beams_stop_on_eos_with_length_penalty():
  """With an EOS the beams meet, finished hypotheses end in it and are ranked by the GNMT
  length-penalized score; blocks are all free afterwards, the prefix cache's aside."""
  prompt = prompts([37], seed=3)[0]
  engine = make_engine(eos_id=37, prefix_caching=True)
  out = _run(engine, prompt, SamplingParams(max_new_tokens=8, beam_width=3,
                                            length_penalty=0.6))
  assert any(ids[-1] == 37 for ids, _ in out.beams)
  for ids, score in out.beams:
    assert 37 not in ids[:-1]
    assert score == pytest.approx(_score(prompt, ids) / beam.length_penalty(len(ids), 0.6),
                                  abs=1e-3)
  held = set(range(1, engine.allocator.num_blocks)) - set(engine.allocator.free_blocks())
  assert held == set(engine.prefix_cache.evictable_blocks())


def test_default_step_is_untouched_by_beams():
  """The top-K output is a separate program: greedy runs never build it."""
  _, _, step = tiny('gqa')
  before = step.num_topk_compilations
  make_engine().generate(prompts([20], seed=1), SamplingParams(max_new_tokens=3))
  assert step.num_topk_compilations == before
  assert step.return_topk == 0


def test_beam_requests_rejected():
  engine = make_engine(max_batch_size=4)
  with pytest.raises(RequestError, match='beam_width=5'):
    engine.submit([1, 2, 3], SamplingParams(beam_width=5))
  with pytest.raises(RequestError, match='temperature'):
    engine.submit([1, 2, 3], SamplingParams(beam_width=2, temperature=1.0))
  with pytest.raises(RequestError, match='beam_width=-1'):
    engine.submit([1, 2, 3], SamplingParams(beam_width=-1))


@pytest.mark.parametrize('preemption', ['recompute', 'swap'])
def test_beams_survive_preemption(preemption):
  """A pool too small for all beams at once preempts some (a group waits for its preempted
  beams to come back and decode before it expands): same beams as with room, and the
  bookkeeping holds after every iteration."""
  ps = prompts([13, 30, 25], seed=2)
  runs = []
  for num_blocks in (14, 64):  # 14: room for the 4-beam group alone (12 blocks), not for all
    engine = make_engine(num_blocks=num_blocks, max_batch_size=8, preemption=preemption)
    ids = [engine.submit(ps[0], SamplingParams(max_new_tokens=30, beam_width=4)),
           engine.submit(ps[1], SamplingParams(max_new_tokens=30)),
           engine.submit(ps[2], SamplingParams(max_new_tokens=30, beam_width=2))]
    for _ in range(400):
      if not engine.has_work():
        break
      engine.step()
      check_blocks(engine)
    assert not engine.has_work()
    assert engine.allocator.num_free == engine.allocator.num_blocks - 1
    runs.append((engine.stats['preemptions'], [engine.finished[i] for i in ids]))
  (tight_preempted, tight), (_, roomy) = runs
  assert tight_preempted > 0
  for a, b in zip(tight, roomy):
    assert a.output_ids == b.output_ids
    if a.beams:
      assert [ids for ids, _ in a.beams] == [ids for ids, _ in b.beams]
      np.testing.assert_allclose([s for _, s in a.beams], [s for _, s in b.beams], atol=1e-3)
