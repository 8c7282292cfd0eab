"""experiments/bench_vllm_cpu.py's interleaved step, without vLLM: its line protocol with the
vLLM process (bench_vllm_cpu_vllm.py --serve), pausing that process tree while the engine runs,
and the comparison of both sides' greedy tokens. vLLM itself is not installed here (it pins its
own torch); a stand-in speaking the same protocol plays its part."""
import os
import stat
import sys
import time

import pytest

from experiments import bench_vllm_cpu

FAKE_VLLM = '''\
import json, os, sys, time
print('INFO vLLM-style log line on stdout', flush=True)
if os.environ.get('FAKE_FAIL_AT_START'):
  sys.exit(3)
print('@@READY ' + json.dumps(dict(vllm_version='fake', env=dict(os.environ.get('MARK', '') and
      {'MARK': os.environ['MARK']}), cpu_count=1)), flush=True)
for line in sys.stdin:
  words = line.split()
  if not words or words[0] == 'quit':
    break
  if words[0] != 'run':
    print('@@ERROR ' + json.dumps('unknown command'), flush=True)
    continue
  b = int(words[1])
  print('another log line', flush=True)
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < 0.05:  # busy: some CPU time to count
    pass
  print('@@ROUND ' + json.dumps(dict(wall_s=0.05, output_ids=[[7, b]] * b)), flush=True)
'''


def _fake_python(tmp_path):
  """An executable that runs the stand-in whatever arguments it is given (the script path,
  the workdir, --serve), as the vLLM venv's python runs bench_vllm_cpu_vllm.py."""
  server = tmp_path / 'fake_vllm.py'
  server.write_text(FAKE_VLLM)
  exe = tmp_path / 'python'
  exe.write_text(f'#!/bin/sh\nexec {sys.executable} {server}\n')
  exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
  return str(exe)


def test_the_vllm_process_answers_rounds_and_its_logs_go_to_a_file(tmp_path):
  proc = bench_vllm_cpu.VllmProcess(_fake_python(tmp_path), str(tmp_path), {'MARK': 'tuned'})
  try:
    assert proc.info['vllm_version'] == 'fake' and proc.info['env'] == {'MARK': 'tuned'}
    wall, ids = proc.run(3)
    assert wall == 0.05 and ids == [[7, 3]] * 3
    assert proc.cpu_s() > 0.02  # the stand-in's busy wait, counted from /proc
    proc.pause(True)  # stopped: no CPU while the engine would run
    before = proc.cpu_s()
    time.sleep(0.2)
    assert proc.cpu_s() == before
    proc.pause(False)
    assert proc.run(1)[1] == [[7, 1]]
  finally:
    proc.close()
  assert proc.proc.returncode == 0
  log = (tmp_path / 'vllm.log').read_text()
  assert 'vLLM-style log line' in log and 'another log line' in log


def test_a_vllm_process_that_dies_says_so_and_where_its_log_is(tmp_path, monkeypatch):
  monkeypatch.setenv('FAKE_FAIL_AT_START', '1')
  with pytest.raises(RuntimeError, match=r'exited \(code 3\) before @@READY; see .*vllm.log'):
    bench_vllm_cpu.VllmProcess(_fake_python(tmp_path), str(tmp_path), {})


def test_a_missing_vllm_python_is_a_clear_error(tmp_path):
  with pytest.raises(Exception, match='does not exist: make the vLLM venv first'):
    bench_vllm_cpu.VllmProcess(str(tmp_path / 'nope' / 'python'), str(tmp_path), {})


def test_outputs_compare_position_by_position():
  assert bench_vllm_cpu.compare_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == (1.0, 2, None)
  share, identical, first = bench_vllm_cpu.compare_outputs([[1, 2, 3], [4, 5]],
                                                           [[1, 2, 3], [4, 6]])
  assert share == pytest.approx(4 / 5) and identical == 1 and first == 'prompt 1, token 1'


def test_the_tuned_environment_binds_every_core_and_reserves_none():
  env = bench_vllm_cpu.tuned_vllm_env('/nowhere/bin/python')
  assert env['VLLM_CPU_OMP_THREADS_BIND'] == f'0-{os.cpu_count() - 1}'
  assert env['VLLM_CPU_NUM_OF_RESERVED_CPU'] == '0'
  assert all(os.path.exists(p) for p in env.get('LD_PRELOAD', '').split(':') if p)
  assert '/nowhere' not in env.get('LD_PRELOAD', '')
