"""experiments/bench_decode.py end to end on its `:tiny` config: a tiny random Llama on both sides
(HF's LlamaForCausalLM built from the same params), the files it writes, and greedy tokens equal
to HF generate's. No wall-clock thresholds: timings on a shared CPU are only reported.

Also the two decode programs the benchmark compares, on a tiny model: the engine's step with its
layers unrolled over per-layer views of the weights (model/step.py decode_layers) against the
scan, and the plain unrolled JAX step (experiments/plain_step.py) against the engine."""
import csv
import json

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import kernels
from experiments import plain_step
from pagedjax.model.step import AUTO_UNROLLED_MIN_ROWS, CompiledStep
from pagedjax.host.requests.sampling_params import SamplingParams
from tiny_models import make_engine, prompts, run_experiment, tiny



class ShapeRecordingStep(CompiledStep):
  """A CompiledStep that notes every input shape signature it is called with."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.signatures = set()

  def __call__(self, params, pool, inputs):
    self.signatures.add(tuple(x.shape for x in inputs))
    return super().__call__(params, pool, inputs)


def test_unrolled_decode_and_plain_step_match_the_engine():
  """Unrolled decode layers give the scan's logits bit for bit and compile once per input shape
  (each shape in one of the step's two programs); the plain step, fed the same ids one at a time
  (two rows at different positions), gives the engine's logits within float32 summation-order
  tolerance and the same greedy tokens."""
  cfg, params, _ = tiny('gqa')
  ps, new = prompts([5, 17], seed=7), 4
  sampling = SamplingParams(max_new_tokens=new)
  want = make_engine('gqa').generate(ps, sampling)  # the shared step: scan
  unrolled = ShapeRecordingStep(cfg, return_logits=True, decode_layers='unrolled')
  got = make_engine('gqa', step_fn=unrolled).generate(ps, sampling)
  assert unrolled.decode_layers == 'unrolled' and any(s[0][1] == 1 for s in unrolled.signatures)
  assert unrolled.num_compilations == len(unrolled.signatures)
  # The default unrolls decode calls from AUTO_UNROLLED_MIN_ROWS rows on this one CPU device.
  assert CompiledStep(cfg).unrolled_min_rows == AUTO_UNROLLED_MIN_ROWS
  assert CompiledStep(cfg, decode_layers='scan').unrolled_min_rows is None
  with pytest.raises(ValueError, match=r"decode_layers='loop' is not allowed: one of"):
    CompiledStep(cfg, decode_layers='loop')
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.stack(g.logits), np.stack(w.logits))
    assert g.output_ids == w.output_ids

  ids = [c.prompt_ids + c.output_ids for c in want]
  length = max(map(len, ids))
  step = plain_step.jitted_decode_step(cfg, return_logits=True)
  weights = plain_step.split_weights(cfg, params)
  cache = plain_step.init_cache(cfg, len(ids), length)
  logits = [[] for _ in ids]
  for t in range(length - 1):
    # A row past its own end feeds its last token again at the same position (same K/V).
    pos = [min(t, len(x) - 2) for x in ids]
    cache, _, out = step(weights, cache, jnp.asarray([x[p] for x, p in zip(ids, pos)]),
                         jnp.asarray(pos, jnp.int32))
    for r, c in enumerate(want):
      if len(c.prompt_ids) - 1 <= t <= pos[r]:
        logits[r].append(np.asarray(out[r]))
  for r, c in enumerate(want):
    np.testing.assert_allclose(np.stack(logits[r]), np.stack(c.logits), atol=1e-4, rtol=0)
    assert np.argmax(np.stack(logits[r]), -1).tolist() == c.output_ids


@pytest.mark.slow
def test_bench_decode_tiny(tmp_path):
  pytest.importorskip('torch', reason='bench_decode compares against HF (test extra)')
  pytest.importorskip('transformers', reason='bench_decode compares against HF (test extra)')
  profile = tmp_path / 'profile'
  run = run_experiment('experiments.bench_decode', '--config=configs/bench_decode.py:tiny',
                       f'--workdir={tmp_path}', f'--profile_dir={profile}')
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads((tmp_path / 'summary.json').read_text())
  batches = [r for r in summary['rows'] if r['kind'] == 'batch']
  assert [r['batch'] for r in batches] == summary['batches'] == [2]
  for r in batches:
    assert r['token_agreement'] == 1.0, r
    assert r['engine_tokens_per_s'] > 0 and r['hf_tokens_per_s'] > 0 and r['floor_s'] > 0
    assert r['decode_step_s'] > 0 and r['host_s_per_step'] >= 0
    assert r['step_over_floor'] == pytest.approx(r['decode_step_s'] / r['floor_s'])
    # The bound: HF's time over the engine's if every decode step took the floor's time.
    prefill_s = r['batch'] * summary['prompt_len'] / r['prefill_tokens_per_s']
    assert r['engine_over_hf_if_step_at_floor'] == pytest.approx(
        r['hf_s'] / (prefill_s + (summary['output_len'] - 1) * r['floor_s']))
    assert [x['wall_s'] for x in summary['rounds_detail'][f"engine B={r['batch']}"]] == [
        r['engine_s']]  # one timed round: its figure is the median
  trace = [r for r in summary['rows'] if r['kind'] == 'trace']
  assert len(trace) == 1 and trace[0]['requests'] == 2
  assert summary['num_compilations_after_warmup'] == 0  # the timed rounds compile nothing
  # bench.linear_impls ('auto', 'xla'): the native linear kernel's engine against XLA's dots'.
  assert summary['linear_impls'] == ['cpu_packed', 'xla']
  for r in batches:
    assert r['token_agreement_xla'] == 1.0 and r['floor_s_cpu_packed'] > 0, r
    assert r['decode_step_ratio_xla'] > 0 and r['engine_tokens_per_s_xla'] > 0
  assert '| batch | impl |' in summary['markdown_table']
  # config.attention.impl is 'auto': the engine ran what the dispatcher picks on this backend.
  assert summary['config']['attention']['impl'] == 'auto'
  assert summary['attention_impl'] == kernels.best_impl()
  assert '| batch |' in summary['markdown_table']
  with open(tmp_path / 'results.csv') as f:
    assert len(list(csv.DictReader(f))) == len(summary['rows'])
  assert (tmp_path / 'bench_decode.png').read_bytes()[:4] == b'\x89PNG'
  assert list(profile.glob('plugins/profile/*/*.xplane.pb'))
