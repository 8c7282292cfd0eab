"""pagedjax replicas on Ray Serve (pagedjax/cluster/serve.py), live on 127.0.0.1: a 2-replica
deployment of the tiny random model behind the precise router answers OpenAI-shaped
/v1/completions with the tokens a single engine gives, streamed or not; refused requests are
400s with the engine's message; a repeated prompt goes where its blocks are (the router reads
the replicas' KV events); a replica killed mid-request has its request finished on the other
with the same tokens, and the router forgets it. One deployment for the module, always shut
down (Ray included); every wait bounded."""
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
import uuid

import pytest

import ray  # requirements-serve.txt
from ray import serve
from ray.serve.config import RequestRouterConfig

from configs import serve as serve_config
from experiments import cpu_time
from experiments import serve as serve_study
from pagedjax import factory
from pagedjax.cluster import routers
from pagedjax.cluster import serve as serve_lib
from pagedjax.config import ConfigError
from pagedjax.host import kv_events

TIMEOUT_S = 60.0
STORE_SLOTS = 1024  # the shared store's slots (home slot: chain key mod slots)
BLOCK = 16  # the tiny config's block size
PREFIX = ('In the beginning God created the heaven and the earth. And the earth was without '
          'form, and void; and darkness was upon the face of the deep. ')


@pytest.fixture(scope='module')
def setup(request, tmp_path_factory):
  """The deployment: 2 replicas of the tiny config whose disk tiers are one shared store (a
  fresh directory, written through); the reference engine has no disk tier."""
  config = factory.typed(serve_config.get_config('tiny'))
  reference_config = config
  config = dataclasses.replace(config, tiers=dataclasses.replace(
      config.tiers, disk_blocks=STORE_SLOTS, disk_kvstore=str(tmp_path_factory.mktemp('store')),
      write_through=True, promotion='load'))
  tokenizer = serve_study.tokenizer_for(config)  # loaded once: the replicas get this one
  deployment = serve_lib.ServeDeployment(config, 2, ('precise', 'precise', {}),
                                         tokenizer=tokenizer, request_timeout_s=TIMEOUT_S,
                                         start_timeout_s=240, shared_store=True)
  request.addfinalizer(deployment.stop)  # Ray, and Serve with it, down whatever happens below
  deployment.start_ray()  # before jax runs here: Ray forks its processes first
  engine = factory.build_engine(reference_config, tokenizer)
  serve_lib.warm_up(engine)  # compiled here first: the replicas load it from the test run's cache
  deployment.start()
  return deployment, engine, tokenizer


def reference(engine, prompt, max_tokens):
  """A single engine's greedy tokens for the prompt, alone."""
  done = engine.generate([prompt], dict(max_new_tokens=max_tokens, temperature=0.0,
                                        stop_on_eos=False))
  return done[0].output_ids


def body(prompt, max_tokens=6, **extra):
  return {'prompt': prompt, 'max_tokens': max_tokens, 'temperature': 0.0, 'ignore_eos': True,
          **extra}


def test_completions_equal_a_single_engine(setup):
  deployment, engine, tokenizer = setup
  prompts = [PREFIX + 'And God said', PREFIX + 'Let there be light', list(range(5, 45))]
  for prompt in prompts:
    status, out = serve_lib.post(deployment.url, body(prompt), TIMEOUT_S)
    assert status == 200, out
    choice = out['choices'][0]
    want = reference(engine, prompt, 6)
    assert choice['token_ids'] == want
    assert choice['text'] == tokenizer.decode(want)
    assert out['usage']['completion_tokens'] == 6 and choice['finish_reason'] == 'length'
  status, events, first = serve_lib.post_stream(deployment.url, body(prompts[0]), TIMEOUT_S)
  assert status == 200 and first is not None
  streamed = [t for e in events for t in e['choices'][0]['token_ids']]
  assert streamed == reference(engine, prompts[0], 6)
  assert ''.join(e['choices'][0]['text'] for e in events) == tokenizer.decode(streamed)
  assert events[-1]['choices'][0]['finish_reason'] == 'length'
  # the first event carries the request's stamps along the path, in order (serve.STAGES)
  times = events[0]['pagedjax']['times']
  path = [end for _, _, end in serve_lib.STAGES][1:-1]  # the ingress's to the first item's
  assert [times[name] for name in path] == sorted(times[name] for name in path), times


def test_stage_seconds_add_up_to_the_span_they_cover():
  """Without Ray: a missing end stamp leaves its stage out; a missing start (Ray's routers
  stamp nothing) starts the stage at the last stamp before it."""
  names = [end for _, _, end in serve_lib.STAGES]
  times = {'arrival': 10.0, **{name: 11.0 + i for i, name in enumerate(names)}}
  stages = serve_lib.stage_seconds(times)
  assert all(s == 1.0 for s in stages.values())
  del times['route_start'], times['pulled'], times['routed']
  stages = serve_lib.stage_seconds(times)
  assert stages['to_router'] is stages['pull'] is stages['policy'] is None
  assert stages['to_replica'] == times['replica'] - times['handle'] == 4.0
  assert sum(s for s in stages.values() if s is not None) == times['first_event'] - 10.0


def test_warm_shapes_leave_nothing_to_compile(setup):
  """After warm_shapes(engine, n) on a fresh engine, a batch of requests whose contexts stay
  within n tokens compiles nothing, and gets the tokens each request gets alone (the warm-up
  wrote KV where no request reads). An engine that holds blocks is refused: the warm-up's
  calls write into every block, cached ones too."""
  _, engine, tokenizer = setup
  prompts = [list(range(10 + i, 50 + 5 * i)) for i in range(2)]
  alone = [reference(engine, p, 4) for p in prompts]
  with pytest.raises(ValueError, match='blocks are held or cached'):
    serve_lib.warm_shapes(engine, 256)  # (its cache holds these prompts' blocks)
  config = engine.config  # at most 2 rows a call: fewer shapes to compile
  fresh = factory.build_engine(dataclasses.replace(config, engine=dataclasses.replace(
      config.engine, max_batch_size=2)), tokenizer)
  assert serve_lib.warm_shapes(fresh, 256) > 0
  done = fresh.generate(prompts, dict(max_new_tokens=4, temperature=0.0, stop_on_eos=False))
  assert fresh.num_compilations == 0
  assert [c.output_ids for c in done] == alone


@pytest.mark.parametrize('fields, says', [
    ({'max_tokens': 0}, 'max_tokens=0 is not allowed'),
    ({'prompt': list(range(2000))}, 'max_seq_len'),
    ({'prompt': [1, -3]}, 'out of vocabulary'),
    ({'temperature': 'hot'}, 'temperature='),
    ({'best_of': 2}, "field 'best_of' is not allowed"),
    ({'stream': True, 'prompt': list(range(2000))}, 'max_seq_len'),
    ({'request_id': ''}, 'request_id='),
])
def test_refused_requests_are_400_with_the_engine_message(setup, fields, says):
  deployment, _, _ = setup
  status, out = serve_lib.post(deployment.url, {**body('Hello'), **fields}, TIMEOUT_S)
  assert status == 400, out
  assert says in out['error']['message'] and out['error']['type'] == 'invalid_request_error'


def test_a_repeated_prompt_goes_where_its_blocks_are(setup):
  """...and its engine is handed the chain keys the router computed (not hashing it again)."""
  deployment, _, _ = setup
  prompt = list(range(100, 180))  # 5 full blocks of 16
  last = routers.RouteRequest(0, prompt).keys(BLOCK)[-1]
  replicas = set()
  before = received(deployment)
  for _ in range(3):
    status, out = serve_lib.post(deployment.url, body(prompt, 2), TIMEOUT_S)
    assert status == 200, out
    replicas.add(out['pagedjax']['replica'])
    # the replica's events reach the bus asynchronously: the next request is routed once they
    # have (a request that came first would be routed by load, racing the announcement)
    wait_for(lambda: last in announced(deployment, out['pagedjax']['replica'],
                                       kv_events.MEDIUM_GPU),
             "the replica's BlockStored(GPU) events for the prompt on the bus")
  assert len(replicas) == 1
  (replica,) = replicas
  wait_for(lambda: figures(deployment, replica).get('keys_handed', 0) >= 3,
           'the engine was handed the keys of the 3 requests')
  # the replicas' running counts of requests received (what the router's InTransit reads)
  wait_for(lambda: received(deployment) == before + 3, 'the 3 requests counted as received')


SHIPPED_ROUTER = """
import pickle, sys, types
from ray import cloudpickle
from pagedjax.cluster import routers, serve as serve_lib
from pagedjax.cluster.index import prompt_keys
shipped = cloudpickle.loads(sys.stdin.buffer.read())  # as Serve loads it in the ingress
router = object.__new__(shipped)
router.initialize_state(router='precise')
routed = serve_lib.parse_completion({'prompt': list(range(40)), 'max_tokens': 2})
router.on_request_routed(types.SimpleNamespace(args=[routed], kwargs={}),
                         types.SimpleNamespace(unique_id='replica-a'), None)
assert routed.route is not None, 'the router did not keep its route on the request'
router.policy.route(routed.route, [routers.ReplicaState(0), routers.ReplicaState(1)])  # keys
sent = pickle.loads(pickle.dumps(routed))  # as Ray sends it to a replica
assert sent.route._keys == {16: prompt_keys(routed.prompt_ids, 16)}, sent.route._keys
"""


def test_the_router_serve_ships_keeps_the_keys_on_the_request():
  """Without Ray: Serve pickles the router class by value (its module registered with
  cloudpickle.register_pickle_by_value) and loads it in the ingress's process, where its code
  runs against a copy of serve.py's globals. That copy must still recognise the request the
  ingress made and keep the route, with its chain keys, on it, for the replica to receive.
  (In another process: in this one cloudpickle hands back the classes it pickled.)"""
  shipped = RequestRouterConfig(
      request_router_class=serve_lib.PagedjaxRequestRouter).get_serialized_request_router_cls()
  done = subprocess.run([sys.executable, '-c', SHIPPED_ROUTER], input=shipped,
                        capture_output=True, timeout=TIMEOUT_S, check=False)
  assert done.returncode == 0, done.stderr.decode()[-2000:]


def wait_for(check, what: str):
  """check()'s first true value, polled for at most TIMEOUT_S."""
  deadline = time.monotonic() + TIMEOUT_S
  while time.monotonic() < deadline:
    value = check()
    if value:
      return value
    time.sleep(0.05)
  raise AssertionError(f'not within {TIMEOUT_S} s: {what}')


def announced(deployment, replica: str, medium: str) -> set:
  """The chain keys a replica announced as stored in `medium` (its BlockStored events)."""
  _, batches, _, _ = ray.get(deployment.bus.since.remote(0), timeout=TIMEOUT_S)
  return {key for uid, wire in batches if uid == replica
          for e in kv_events.batch_from_wire(wire).events
          if isinstance(e, kv_events.BlockStored) and (e.medium or kv_events.MEDIUM_GPU) == medium
          for key in e.block_hashes}


def received(deployment) -> int:
  """The requests the replicas say they received, summed (their published `received`)."""
  _, _, states, _ = ray.get(deployment.bus.since.remote(0), timeout=TIMEOUT_S)
  return sum(state['received'] for state in states.values())


def on_disk(deployment, replica: str) -> set:
  """The chain keys a replica announced as stored on disk (its BlockStored(DISK) events)."""
  return announced(deployment, replica, kv_events.MEDIUM_DISK)


def figures(deployment, replica: str) -> dict:
  """A replica's engine figures as it last published them (when it last went idle)."""
  return deployment.replica_summaries().get(replica, {})


@contextlib.contextmanager
def busy(deployment, prompt, replica: str):
  """A 100-token request on `replica` (whose device cache holds the prompt's prefix) for the
  block: the router then sends a prompt both replicas can serve to the idle one."""
  rid, result = f'busy-{uuid.uuid4().hex}', {}
  worker = threading.Thread(target=lambda: result.update(
      out=serve_lib.post(deployment.url, body(prompt, 100, request_id=rid), TIMEOUT_S)))
  worker.start()
  serving = wait_for(lambda: ray.get(deployment.bus.serving.remote(rid), timeout=TIMEOUT_S),
                     'the long request is in flight')
  assert serving == [replica], (serving, replica)
  try:
    yield
  finally:
    worker.join(TIMEOUT_S)
  assert result['out'][0] == 200, result


def test_a_prompt_one_replica_computed_is_a_disk_hit_on_the_other(setup):
  """The replicas share one disk store: replica A computes a prompt and writes its blocks
  through to the store (its BlockStored(DISK) events); while A is busy, the router sends the
  prompt to B, which finds them there as tier-3 hits (adopted from their home slots, announced
  as its own BlockStored(DISK)) and answers with the single engine's greedy tokens."""
  deployment, engine, _ = setup
  prompt = list(range(600, 680))  # 5 full blocks
  keys = routers.RouteRequest(0, prompt).keys(BLOCK)
  matchable = (len(prompt) - 1) // BLOCK  # a lookup never takes the last token
  status, out = serve_lib.post(deployment.url, body(prompt, 2), TIMEOUT_S)
  assert status == 200, out
  a = out['pagedjax']['replica']
  wait_for(lambda: set(keys) <= on_disk(deployment, a), 'A announced its blocks on disk')
  before = {}
  with busy(deployment, prompt + list(range(700, 720)), a):
    other = [uid for uid in ray.get(deployment.bus.since.remote(0), timeout=TIMEOUT_S)[2]
             if uid != a]
    before = {uid: figures(deployment, uid) for uid in other}
    status, out = serve_lib.post(deployment.url, body(prompt, 6), TIMEOUT_S)
  assert status == 200, out
  b = out['pagedjax']['replica']
  assert b != a and b in before
  assert out['choices'][0]['token_ids'] == reference(engine, prompt, 6)
  count = lambda s, name: s.get(name) or 0
  after = wait_for(lambda: (lambda s: s if count(s, 'tiers_tier3_hit_blocks') - count(
      before[b], 'tiers_tier3_hit_blocks') >= matchable else None)(figures(deployment, b)),
                   "B's tier-3 hits in its figures")
  assert after['tier3_shared']
  assert count(after, 'tier3_adopted_blocks') - count(before[b], 'tier3_adopted_blocks') >= (
      matchable)
  assert set(keys[:matchable]) <= on_disk(deployment, b)


def test_a_killed_replica_request_finishes_elsewhere_with_the_same_tokens(setup):
  deployment, engine, _ = setup
  prompt, n, rid = list(range(300, 340)), 300, f'kill-test-{uuid.uuid4().hex}'
  result = {}
  worker = threading.Thread(target=lambda: result.update(
      out=serve_lib.post(deployment.url, body(prompt, n, request_id=rid), TIMEOUT_S)))
  worker.start()
  victim, deadline = None, time.monotonic() + TIMEOUT_S
  while victim is None and time.monotonic() < deadline and worker.is_alive():
    # the replica that has THIS request in flight, as it published after its last iteration
    serving = ray.get(deployment.bus.serving.remote(rid), timeout=TIMEOUT_S)
    victim = serving[0] if serving else None
    time.sleep(0.005)
  assert victim is not None, 'the request finished before a replica could be killed'
  ray.kill(deployment.replica_actors()[victim], no_restart=True)
  worker.join(TIMEOUT_S)
  status, out = result['out']
  assert status == 200, out
  assert out['id'] == rid
  assert out['pagedjax']['attempts'] == 2 and out['pagedjax']['replica'] != victim
  assert out['choices'][0]['token_ids'] == reference(engine, prompt, n)
  _, _, states, _ = ray.get(deployment.bus.since.remote(0), timeout=TIMEOUT_S)
  assert victim not in states  # the router told the bus to forget it (and cleared its blocks)
  # Serve starts a replica in place of the victim: it opens the shared store, restores what
  # the others wrote, and serves the prompt from it (while the survivor is busy)
  survivor = out['pagedjax']['replica']
  fresh = wait_for(lambda: [uid for uid in ray.get(deployment.bus.since.remote(0),
                                                   timeout=TIMEOUT_S)[2]
                            if uid not in (victim, survivor)], 'a replica in place of the dead')
  wait_for(lambda: serve.status().applications[serve_lib.APP_NAME].deployments[
      'EngineReplica'].replica_states.get('RUNNING') == 2, 'Serve lists it running')
  time.sleep(0.5)  # the ingress's router learns of it by long poll
  with busy(deployment, prompt + list(range(720, 740)), survivor):
    status, out = serve_lib.post(deployment.url, body(prompt, 6), TIMEOUT_S)
  assert status == 200, out
  assert out['pagedjax']['replica'] == fresh[0]
  assert out['choices'][0]['token_ids'] == reference(engine, prompt, 6)
  restarted = wait_for(lambda: figures(deployment, fresh[0]), 'its figures')
  assert restarted['tier3_restored_blocks'] > 0
  assert restarted['tiers_tier3_hit_blocks'] >= (len(prompt) - 1) // BLOCK


def test_a_shared_store_deployment_needs_a_disk_tier_and_its_router_shares_the_disk(tmp_path):
  """Without Ray: the wiring a deployment on one shared store gets (its replicas' disk tiers
  share blocks as tests/test_shared_store.py shows for engines)."""
  config = factory.typed(serve_config.get_config('tiny'))
  with pytest.raises(ValueError, match='shared_store=True needs a disk tier'):
    serve_lib.ServeDeployment(config, 2, shared_store=True)
  kwargs = serve_lib.router_config(('precise', 'precise', {}), 'bus',
                                   shared_store=True).request_router_kwargs
  router = object.__new__(serve_lib.PagedjaxRequestRouter)  # its state alone, no Serve
  router.initialize_state(**kwargs)
  assert router.kv_index.shared_media == {'DISK'} and router.policy.index is router.kv_index
  router.kv_index.apply(0, [kv_events.BlockStored((7,), None, (), 16, None, 'DISK')])
  assert router.kv_index.match([7], [0, 1]) == {0: [3], 1: [3]}


def test_study_config_errors_are_named_and_requests_share_prefixes():
  config = serve_config.get_config('tiny')
  serve_study.check(config)
  for field, value, says in (('serve.replicas', 0, 'config.serve.replicas=0'),
                             ('workload.kind', 'sharegpt', "one of ('mooncake'"),
                             ('serve.routers', (('x', 'no_such_router', {}),), 'no_such_router'),
                             ('serve.sim_hardware', 'tpu-v9', "serve.sim_hardware='tpu-v9'"),
                             ('serve.sim_machine_share', -1.0,
                              'config.serve.sim_machine_share=-1.0 is not allowed'),
                             ('serve.sim_share_band', 1.5,
                              'config.serve.sim_share_band=1.5 is not allowed: a fraction'),
                             ('serve.sim_share_from', 'live',
                              "config.serve.sim_share_from='live' is not allowed: one of")):
    bad = serve_config.get_config('tiny')
    section, name = field.split('.')
    bad[section][name] = value
    with pytest.raises(ConfigError, match=re.escape(says)):
      serve_study.check(bad)
  requests, dropped = serve_study.make_requests(config, 97)
  w = config.workload
  assert len(requests) == w.requests and dropped == 0
  prefixes = {tuple(r.prompt_ids[:w.prefix_tokens]) for r in requests}
  assert 1 < len(prefixes) <= w.tenants
  assert all(len(r.prompt_ids) == w.prefix_tokens + w.question_tokens for r in requests)


def test_a_replay_reruns_the_simulated_half_against_an_earlier_runs_live_figures(tmp_path):
  """serve.replay_from: no Ray, no live run; the live figures come from the earlier run's
  summary.json, the device from its hardware_profile.json; the simulated figures are computed
  again (the stale ones are not kept). Another workload, or a row the run has no live figures
  for, is refused by name."""
  import copy
  import json
  from pagedjax.sim import hardware
  config = serve_config.get_config('tiny')
  config.serve.routers = (('precise', 'precise', {}),)
  saved = tmp_path / 'run'
  saved.mkdir()
  hardware.save_profile(str(saved / 'hardware_profile.json'), hardware.get_hardware('h100-sxm'))
  live = {'router': 'precise', 'prefix_hit_rate_tokens': 0.5, 'ttft_p50_s': 0.1,
          'idle_ttft_s': 0.02, 'path_p50_s': 0.03, 'sim_prefix_hit_rate_tokens': 9.9}
  (saved / 'summary.json').write_text(json.dumps(
      {'routers': [live], 'config': json.loads(json.dumps(config.to_dict(), default=str))}))
  config.serve.replay_from = str(saved)
  serve_study.check(config)
  out = serve_study.study(config, str(tmp_path / 'replay'))
  (row,) = out['routers']
  assert row['router'] == 'precise' and row['prefix_hit_rate_tokens'] == 0.5
  assert 0 <= row['sim_prefix_hit_rate_tokens'] <= 1
  assert row['sim_hit_rate_minus_live'] == pytest.approx(row['sim_prefix_hit_rate_tokens'] - 0.5)
  assert row['sim_plus_path_ttft_p50_s'] == pytest.approx(row['sim_ttft_p50_s'] + 0.03)
  assert {p.name for p in (tmp_path / 'replay').iterdir()} >= {'routers.csv', 'table.md',
                                                              'summary.json'}
  other = copy.deepcopy(config)
  other.workload.requests = 13
  with pytest.raises(ConfigError, match='config.workload differs from the run in'):
    serve_study.study(other, str(tmp_path / 'other'))
  other = copy.deepcopy(config)
  other.serve.routers = (('tier_cost', 'tier_cost', {}),)
  with pytest.raises(ConfigError, match="row 'tier_cost' has no live figures"):
    serve_study.study(other, str(tmp_path / 'other'))
  other = copy.deepcopy(config)
  other.serve.replay_from = str(tmp_path / 'nowhere')
  with pytest.raises(ConfigError, match='config.serve.replay_from=.* the workdir of an earlier'):
    serve_study.check(other)


def test_the_measured_machine_share_is_what_the_serving_processes_left():
  """serve.sim_share_from='cpu': the simulated replicas get (cores - serving_cores) / cores of
  the machine, serving_cores being the machine's busy CPU less the replicas' own over the
  replay; 'fixed', and unmeasured rows, keep serve.sim_machine_share."""
  before = {'machine': 10.0, 'replicas': {11: 1.0, 12: 2.0}}
  after = {'machine': 16.0, 'replicas': {11: 2.5, 12: 3.0}}
  assert serve_study.serving_cores(before, after, 2.0) == pytest.approx(1.75)  # (6 - 2.5) / 2
  assert serve_study.serving_cores(before, {**after, 'replicas': {11: 2.5}}, 2.0) is None
  assert serve_study.serving_cores({**before, 'machine': None}, after, 2.0) is None
  config = serve_config.get_config('tiny')
  config.serve.sim_share_from = 'cpu'
  cores = os.cpu_count()
  assert serve_study.machine_share(config, {'serving_cores': cores / 4}) == pytest.approx(0.75)
  assert serve_study.machine_share(config, {'serving_cores': 10.0 * cores}) == 0.1
  assert serve_study.machine_share(config, {'serving_cores': None}) == 1.0
  config.serve.sim_share_from = 'fixed'
  config.serve.sim_machine_share = 0.5
  assert serve_study.machine_share(config, {'serving_cores': cores / 4}) == 0.5
  busy = cpu_time.machine_busy_s()
  assert busy is None or busy > 0
  assert cpu_time.process_cpu_s(os.getpid()) > 0


def test_the_step_matched_share_gives_the_live_replicas_iteration_seconds(tmp_path):
  """serve.sim_share_from='steps' (the default): the share at which the simulated replicas
  spend the live replicas' iteration seconds, by bisection; the live seconds are the replay's
  (replica_busy_s), or a saved run's whole replica summaries. On the simulated cluster itself:
  the share found gives the live seconds back, and a slower live machine gets a smaller one."""
  config = serve_config.get_config('tiny')
  assert config.serve.sim_share_from == 'steps'
  lo, hi = serve_study.SHARE_RANGE
  # a stand-in: seconds falling as the share grows
  assert serve_study.machine_share(config, {'replica_busy_s': 8.0}, lambda s: 4.0 / s) == (
      pytest.approx(0.5, rel=0.02))
  assert serve_study.machine_share(config, {'replica_busy_s': 1e-9}, lambda s: 4.0 / s) == (
      pytest.approx(hi, rel=0.02))  # past the range: its end
  assert serve_study.machine_share(config, {}, lambda s: 4.0 / s) == 1.0  # not measured
  summaries = {'a': {'iterations': 10, 'host_s_per_step': 0.001, 'device_s_per_step': 0.009},
               'b': {'iterations': 5, 'host_s_per_step': 0.0, 'device_s_per_step': 0.02}}
  assert serve_study.live_busy_s({'replica_summaries': summaries}) == pytest.approx(0.2)
  assert serve_study.live_busy_s({'replica_busy_s': 0.1, 'replica_summaries': summaries}) == 0.1
  config.serve.replicas = 2
  config.model.source = 'random'
  from pagedjax.sim import hardware
  typed = factory.typed(config)
  engine = factory.build_engine(typed, serve_study.tokenizer_for(typed))
  device = serve_study.SimDevice(hardware.get_hardware('h100-sxm'),
                                 *serve_study.own_model(config, engine))
  requests, _ = serve_study.make_requests(config, typed.model.random.vocab_size)
  row = ('precise', 'precise', {})
  at = lambda share: serve_study.cluster_busy_s(serve_study.simulated_cluster(
      config, row, requests, device, share))
  live = {'replica_busy_s': at(0.25)}
  out = serve_study.simulated_router(config, row, requests, device, live)
  assert out['sim_share_from'] == 'steps'
  assert out['sim_busy_s'] == pytest.approx(live['replica_busy_s'], rel=0.1)
  assert out['sim_hit_rate_lo'] <= out['sim_prefix_hit_rate_tokens'] <= out['sim_hit_rate_hi']
  assert out['live_in_sim_band'] is None  # no live hit rate given
  slower = serve_study.simulated_router(config, row, requests, device,
                                        {'replica_busy_s': 2 * live['replica_busy_s']})
  assert slower['sim_machine_share'] < out['sim_machine_share']
