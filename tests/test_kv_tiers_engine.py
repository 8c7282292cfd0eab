"""KV tiers with a real (tiny, random) model: greedy outputs token-identical to an all-device run
with a pool big enough for everything, for every tier combination and movement policy, both
prefix-cache designs, float32 and int8 pools, under forced evictions at every tier; disk faults
between and during runs, warm restart, fingerprints, an unwritable disk. Engines share one
compiled step per pool dtype (tiny_models.tiny)."""
import contextlib
import dataclasses
import functools
import os
import pathlib
import subprocess
import uuid

import jax.numpy as jnp
import pytest

from pagedjax.config import TiersConfig
from pagedjax.engine import Engine
from pagedjax.host.tiers.disk_store import DiskStore
from pagedjax.host.tiers.kv_tiers import KVTiers
from pagedjax.host.requests.sampling_params import SamplingParams
from pagedjax.model.llama import init_params

from fakes import check_blocks
from tiny_models import engine_config, prompts, tiny

# Eight documents of 4-5 blocks asked about twice, two at a time: 36 distinct prefix blocks, so a
# 15-block pool evicts every document before it comes back.
DOCS = prompts([64 + 3 * i for i in range(8)], seed=3)
QUESTIONS = prompts([5, 9, 7], seed=4)
PARAMS = SamplingParams(max_new_tokens=5)


def make(num_blocks, tiers=None, params=None, model_cfg=None, **flat):
  cfg, tiny_params, step = tiny('gqa')
  flat = {'block_size': 16, 'max_batch_size': 4, 'prefill_chunk': 16, 'prefix_caching': True,
          **flat}
  config, rest = engine_config(cfg, num_blocks=num_blocks, **flat)
  if tiers is not None:
    config = dataclasses.replace(config, tiers=tiers)
  return Engine(model_cfg or cfg, tiny_params if params is None else params, config,
                step_fn=step, **rest)


def serve(engine, rounds=(0, 1)):
  """Round 0 asks about documents 0..7, two at a time; round 1 in reverse order, so documents
  come back after every reuse distance: the last ones still on the device, the middle ones in
  host RAM, the first ones on disk (or gone)."""
  outputs = []
  for r in rounds:
    for d in range(0, len(DOCS), 2)[::-1 if r % 2 else 1]:
      done = engine.generate([DOCS[d] + QUESTIONS[r], DOCS[d + 1] + QUESTIONS[r + 1]], PARAMS)
      outputs += [c.output_ids for c in done]
      check_blocks(engine)
      if engine.tiers is not None:
        engine.tiers.check()
  return outputs


@functools.lru_cache(maxsize=None)
def all_device(kv_dtype='auto', rounds=(0, 1)):
  """Outputs with a pool that never evicts, and the prompt tokens it computed."""
  engine = make(128, kv_dtype=kv_dtype)
  out = serve(engine, rounds)
  assert engine.summary()['prefix_cache_evictions'] == 0
  return out, engine.summary()['prompt_tokens_computed']


def memory_store():
  return f'memory://{uuid.uuid4().hex}/'


@functools.lru_cache(maxsize=None)
def no_tiers(kv_dtype='auto'):
  """Prompt tokens computed by the tiered runs' 15-block pool without tiers."""
  engine = make(15, kv_dtype=kv_dtype)
  assert serve(engine) == all_device(kv_dtype)[0]
  return engine.summary()['prompt_tokens_computed']


CASES = {  # name: (TiersConfig fields, design, kv_dtype, tiers that evict)
    'host': (dict(host_blocks=64), 'hash', 'auto', {1}),
    'host+disk': (dict(host_blocks=8, disk_blocks=24), 'hash', 'auto', {1, 2, 3}),
    'disk radix': (dict(disk_blocks=64), 'radix', 'auto', {1}),
    'write-through radix': (dict(host_blocks=8, disk_blocks=24, write_through=True), 'radix',
                            'auto', {1, 2, 3}),
    'host+disk int8': (dict(host_blocks=8, disk_blocks=24), 'hash', 'int8', {1, 2, 3}),
}


@pytest.mark.parametrize('case', list(CASES))
def test_outputs_identical_to_an_all_device_run(case):
  fields, design, kv_dtype, evicting = CASES[case]
  want, computed_all_device = all_device(kv_dtype)
  tiers = TiersConfig(disk_kvstore=memory_store(), promotion='load', **fields)
  engine = make(15, tiers, prefix_cache_design=design, kv_dtype=kv_dtype)
  assert serve(engine) == want
  s = engine.summary()
  for tier in (2, 3):  # every lower tier present serves hits
    assert (s[f'tiers_tier{tier}_hit_blocks'] > 0) == (f'{"host" if tier == 2 else "disk"}'
                                                       '_blocks' in fields), tier
  for tier in (1, 2, 3):
    assert (s[f'tiers_tier{tier}_evictions'] > 0) == (tier in evicting), tier
  computed = s['prompt_tokens_computed']
  if evicting == {1}:  # tiers big enough for everything: every prefix the device lost is found
    assert computed == computed_all_device
  else:  # what the full tiers dropped is recomputed, but less than with no tiers at all
    assert computed_all_device < computed < no_tiers(kv_dtype)
  assert s['tiers_promoted_bytes'] == s['tiers_promoted_blocks'] * s['tier_block_bytes']
  assert s['tiers_prefetch_taken_blocks'] <= s['tiers_prefetched_blocks']


def test_disk_reads_of_waiting_prompts_are_issued_ahead_of_admission():
  """Round 1's eight prompts at once on a 4-row batch (in serve's order): the four waiting ones' documents are
  read from disk while the first four decode, and admission takes those reads."""
  engine = make(15, TiersConfig(disk_blocks=64, disk_kvstore=memory_store(), promotion='load'))
  serve(engine, rounds=(0,))
  engine.tiers.flush()  # every demotion's write has landed: the lookups below are certain
  before = dict(engine.summary())
  order = [d + i for d in range(0, len(DOCS), 2)[::-1] for i in (0, 1)]  # as serve's round 1
  prompts_1 = [DOCS[d] + QUESTIONS[1 + d % 2] for d in order]
  done = engine.generate(prompts_1, PARAMS)
  want = all_device()[0][len(DOCS):]
  assert [c.output_ids for c in done] == want
  s = engine.summary()
  taken = s['tiers_prefetch_taken_blocks'] - before['tiers_prefetch_taken_blocks']
  assert 0 < taken <= s['tiers_prefetched_blocks']


def test_the_equality_test_catches_wrong_kv(monkeypatch):
  """Control: blocks promoted with another block's K/V change the greedy outputs."""
  load = KVTiers.load
  monkeypatch.setattr(KVTiers, 'load', lambda self, promotions: {
      name: array[:, ::-1] for name, array in load(self, promotions).items()})
  engine = make(15, TiersConfig(host_blocks=64, promotion='load'))
  assert serve(engine) != all_device()[0]


def _chunks(store: pathlib.Path, array: str):
  return sorted(store.glob(f'*/{array}/c/*/0'))


def _damage(path: pathlib.Path, how: str) -> None:
  if how == 'corrupt':
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
  elif how == 'truncate':
    path.write_bytes(path.read_bytes()[:7])
  else:
    path.unlink()


@pytest.mark.parametrize('how', ['corrupt', 'truncate', 'delete'])
def test_damaged_disk_entries_are_misses_never_wrong_kv(tmp_path, how):
  """A first engine writes every block through to a local disk store; half of the record chunks
  are damaged before a second engine on the same store runs the same requests. Every damaged
  entry is a miss (recomputed), the others hit; outputs stay identical."""
  tiers = TiersConfig(disk_blocks=64, disk_kvstore=str(tmp_path), write_through=True,
                      promotion='load')
  want = all_device(rounds=(0,))[0]
  first = make(15, tiers)
  assert serve(first, rounds=(0,)) == want
  first.tiers.flush()
  chunks = _chunks(tmp_path, 'blocks')
  assert len(chunks) == first.summary()['tiers_tier3_demoted_blocks'] > 0
  for path in chunks[::2]:
    _damage(path, how)
  second = make(15, tiers)
  assert second.summary()['tier3_restored_blocks'] == len(chunks)
  assert serve(second, rounds=(0,)) == want
  s = second.summary()
  assert s['tiers_tier3_failed_blocks'] > 0 and s['tiers_tier3_hit_blocks'] > 0


def test_damage_during_a_run_and_torn_headers(tmp_path):
  """Chunks damaged while an engine runs, and headers that name another record (a write torn
  between its two chunks), are misses too."""
  tiers = TiersConfig(disk_blocks=64, disk_kvstore=str(tmp_path), write_through=True,
                      promotion='load')
  want = all_device(rounds=(0,))[0]
  first = make(15, tiers)
  serve(first, rounds=(0,))
  first.tiers.flush()
  headers = _chunks(tmp_path, 'headers')
  for a, b in zip(headers[0::4], headers[1::4]):  # swap headers pairwise: each names the
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()  # other slot's record
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)
  second = make(15, tiers)
  outputs = []
  for d in range(0, len(DOCS), 2):
    if d == 4:
      for path in _chunks(tmp_path, 'blocks'):
        _damage(path, 'corrupt')
    done = second.generate([DOCS[d] + QUESTIONS[0], DOCS[d + 1] + QUESTIONS[1]], PARAMS)
    outputs += [c.output_ids for c in done]
  assert outputs == want
  s = second.summary()
  assert s['tiers_tier3_failed_blocks'] > 0 and s['tiers_tier3_hit_blocks'] > 0


def one_weight_changed(params):
  """params with one embedding value changed, at index 1: a value the old fingerprint's strided
  sample (every 2nd value of this 97 x 48 table) skipped."""
  inner = params['params']
  table = inner['embed']['embedding']
  changed = table.at[0, 1].add(1.0)
  return {'params': {**inner, 'embed': {**inner['embed'], 'embedding': changed}}}


def test_warm_restart_hits_and_another_model_or_kv_scheme_never_does(tmp_path):
  """No K/V is served to a model, scheme or block size other than the one that wrote it: a
  restart of the same engine finds the blocks it wrote; one weight value, one model config
  field, the KV scheme or the block size changed, and it finds none."""
  tiers = TiersConfig(host_blocks=4, disk_blocks=64, disk_kvstore=str(tmp_path),
                      promotion='load')
  want, computed = all_device(rounds=(0,))
  first = make(15, tiers)
  assert serve(first, rounds=(0,)) == want
  first.tiers.flush()
  written = first.summary()['tiers_tier3_demoted_blocks']
  assert written > 0
  restarted = make(15, tiers)  # write-back: only what was demoted to disk is there
  assert restarted.summary()['tier3_restored_blocks'] == written
  assert serve(restarted, rounds=(0,)) == want
  s = restarted.summary()
  assert s['tiers_tier3_hit_blocks'] > 0 and s['prompt_tokens_computed'] < computed
  cfg, params, _ = tiny('gqa')
  for other in (dict(params=one_weight_changed(params)), dict(kv_dtype='int8')):
    engine = make(15, tiers, **other)
    s = engine.summary()
    assert s['tier3_restored_blocks'] == 0
    serve(engine, rounds=(0,))
    assert engine.summary()['tiers_tier3_hit_blocks'] == 0
  # An empty index cannot hit: built, not served (these would compile other shapes).
  for other in (dict(params=init_params(cfg, seed=2)),
                dict(model_cfg=dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 2)),
                dict(block_size=8)):
    assert make(15, tiers, **other).summary()['tier3_restored_blocks'] == 0
  assert len(list(tmp_path.iterdir())) == 6  # one directory per fingerprint


def test_unwritable_disk_turns_the_tier_off_once_and_the_engine_goes_on(tmp_path,
                                                                        monkeypatch):
  blocker = tmp_path / 'file'
  blocker.write_text('x')
  with pytest.warns(RuntimeWarning, match='switched off') as caught:
    engine = make(15, TiersConfig(host_blocks=4, disk_blocks=16,
                                  disk_kvstore=str(blocker / 'kv'), promotion='load'))
    assert serve(engine, rounds=(0,)) == all_device(rounds=(0,))[0]
  assert len(caught) == 1 and engine.summary()['tier3_enabled'] is False
  # A store that fails on write, mid-run (a full disk): off after the first failure.
  engine = make(15, TiersConfig(disk_blocks=16, disk_kvstore=memory_store(), promotion='load'))
  disk = engine.tiers.disk

  class Full:
    def __getitem__(self, slot):
      raise OSError('No space left on device')

  monkeypatch.setattr(disk, '_blocks', Full())
  with pytest.warns(RuntimeWarning, match='read-only from now on.*No space left') as caught:
    assert serve(engine, rounds=(0,)) == all_device(rounds=(0,))[0]
  assert len(caught) == 1 and disk.enabled and not disk.writable
  assert engine.summary()['tier3_read_only'] is True


def _tree(path: pathlib.Path) -> dict:
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob('*'))
          if p.is_file()}


@contextlib.contextmanager
def unwritable(path: pathlib.Path, monkeypatch):
  """Makes the store under `path` refuse writes; yields how. For real where the machine
  allows: `chmod -R a-w` for a normal user, and as root (which chmod does not stop) the
  immutable attribute, `chattr -R +i`. Where neither takes (a probe file can still be
  created), it is simulated at the tensorstore layer instead: every write to the store's
  arrays fails as a read-only file system's write does (ValueError PERMISSION_DENIED)."""
  how = None
  undo = None
  if os.geteuid() != 0:
    how, undo = 'chmod', ['chmod', '-R', 'u+w', str(path)]
    subprocess.run(['chmod', '-R', 'a-w', str(path)], check=True)
  elif subprocess.run(['chattr', '-R', '+i', str(path)], capture_output=True).returncode == 0:
    how, undo = 'chattr', ['chattr', '-R', '-i', str(path)]
  try:
    try:
      (path / 'probe').write_text('x')
      (path / 'probe').unlink()
      if undo:
        subprocess.run(undo, check=True)
        undo = None
      how = 'simulated'
    except OSError:
      pass
    if how == 'simulated':
      monkeypatch.setattr(DiskStore, '_open', lambda self, *a, **k: _ReadOnlyArray(
          _open(self, *a, **k)))
    yield how
  finally:
    if undo:
      subprocess.run(undo, check=True)


_open = DiskStore._open  # pylint: disable=protected-access


class _ReadOnlyArray:
  """A tensorstore array whose writes fail as on a read-only file system; reads pass."""

  def __init__(self, array):
    self._array = array
    self.kvstore = array.kvstore

  def __getitem__(self, index):
    return _ReadOnlyArray(self._array[index])

  def read(self):
    return self._array.read()

  def write(self, _):
    raise ValueError('PERMISSION_DENIED: Error writing local file: Read-only file system '
                     '(simulated)')


def test_a_read_only_store_is_served_and_never_written(tmp_path, monkeypatch):
  """A store made unwritable after a first engine filled it: a second engine with the default
  promotion='auto' builds (calibration reads the store's own records and writes nothing), warns
  once that the tier is read-only when its first write (a new prompt's blocks) is refused, then
  serves the store's blocks (recomputing is made dear so the cost model loads them), and leaves
  every byte of the store as it was. Outputs are those of an all-device run."""
  want = all_device(rounds=(0,))[0]
  first = make(15, TiersConfig(disk_blocks=64, disk_kvstore=str(tmp_path), write_through=True,
                               promotion='load'))
  assert serve(first, rounds=(0,)) == want
  first.tiers.flush()
  before = _tree(tmp_path)
  with unwritable(tmp_path, monkeypatch) as how:
    with pytest.warns(RuntimeWarning, match='read-only from now on') as caught:
      second = make(15, TiersConfig(disk_blocks=64, disk_kvstore=str(tmp_path),
                                    write_through=True, prefill_s_per_token=1.0))
      assert second.summary()['tier3_calibrated_on'] == '8 records of the store'
      second.generate(prompts([40], seed=9), PARAMS)
      second.tiers.flush()
      assert second.summary()['tier3_read_only']
      assert serve(second, rounds=(0,)) == want
      second.tiers.flush()
  assert len(caught) == 1, how
  s = second.summary()
  assert s['tier3_enabled'] and s['tier3_read_only'] and s['tiers_tier3_hit_blocks'] > 0
  assert _tree(tmp_path) == before, how


def test_calibration_writes_nothing_into_the_store(tmp_path):
  engine = make(15, TiersConfig(disk_blocks=64, disk_kvstore=str(tmp_path)))
  figures = engine.summary()
  assert 0 < figures['cost_tier3_bytes_per_s'] < float('inf')
  assert figures['tier3_calibrated_on'] == '8 scratch records in a temporary local directory'
  (store,) = tmp_path.iterdir()  # the fingerprint's directory, holding the two arrays only
  assert sorted(str(p.relative_to(store)) for p in store.rglob('*')) == [
      'blocks', 'blocks/zarr.json', 'headers', 'headers/zarr.json']
