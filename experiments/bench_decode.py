"""Decode speed next to HF transformers, with the matmul floor measured in the same run.

  python -m experiments.bench_decode --workdir=runs/bench_decode
  python -m experiments.bench_decode --config=configs/bench_decode.py:tiny --workdir=runs/tiny
  python -m experiments.bench_decode --workdir=runs/bench_decode --profile_dir=runs/prof

One process, one model (SmolLM2-135M float32 by default; configs/bench_decode.py). HF's
LlamaForCausalLM is built from the very params the engine runs (transposed kernels, HF's own
rotate-half RoPE layout, which pagedjax shares), so both sides see the same weights and the same
token ids. Per batch B:
  - engine: B prompts through Engine.generate, greedy, EOS ignored, output_len new tokens each;
  - hf: the same prompts through model.generate (greedy, no EOS);
  - floor: the decode step's matmuls alone at batch B, jitted (q/k/v/o, gate/up/down of every
    layer + the output head, per-layer weights passed as separate arrays: no slicing, no
    attention, no norms), timed like the step;
  - plain: the same decode step written as plain unrolled JAX (experiments/plain_step.py: no
    Flax, no paging, a dense contiguous KV cache) at batch B over prompt_len + output_len // 2
    cached tokens (the engine's median decode context), timed like the floor. plain / floor is
    what attention, norms and sampling cost when XLA compiles the step as simply as it can be
    written; step / plain is what the engine's structure (paging, Flax, padding batch 1 to 8
    rows unless engine.decode_min_rows says otherwise; this config says 1) adds on top.
Linear layers: `bench.linear_impls` (llama.LINEAR_IMPLS, resolved and deduplicated; default
('auto', 'xla'): on CPU the native linear kernel, kernels/linear_cpu.py, then XLA's dots). The
first is the engine everything above is measured with; each other one gets an engine of its own
(same params, same step options), run on the same prompts in the same interleaved rounds, and
every batch row gets its tokens/s, its decode step, the per-round ratio of the first engine's
decode step to its own (`decode_step_ratio_<impl>`: < 1 means the first is faster) and whether
its greedy tokens equal the first engine's (`token_agreement_<impl>`). The matmul floor is timed
for every impl too (`floor_s` is XLA's dots, as before; `floor_s_cpu` the kernel's).
The engine's attention path is config.attention.impl (`auto`: on CPU the native `cpu` kernel,
kernels/cpu.py, where it builds, else `xla`); summary.json's `attention_impl` names the one that
ran. The engine's decode calls run the layers as `bench.decode_layers` says (model/step.py:
'scan', or 'unrolled' over per-layer views of the weights; 'auto', the engine's default, unrolls
decode calls of 8 rows and more on one CPU device).
Everything is warmed up first in a round of `warmup_output_len` new tokens (the engine compiles
every shape it meets there; the timed rounds' compilations are reported and must be 0), then
`rounds` rounds each run engine, hf, floor and plain once for every batch, in that order rotated
per round.
Figures are medians over rounds. The engine's prefill tokens/s, decode step time and host
seconds per step come from its per-iteration metrics (host/metrics.py: device_s and host_s).

Then a `trace_requests` trace (prompt lengths spread around prompt_len, output_len each): the
engine against HF's continuous-batching `generate_batch`, same ids, timed once after a warm-up.

Writes WORKDIR/summary.json, results.csv (one row per batch, plus the trace row) and
bench_decode.png. --profile_dir writes a jax.profiler trace (TensorBoard / Perfetto:
plugins/profile/*/*.trace.json.gz) of a few warm decode steps at the largest batch.
"""
import math
import os
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import kernels
from pagedjax.kernels import linear_cpu
from experiments import cli
from experiments import plain_step
from pagedjax import factory
from pagedjax.studies import run_info
from pagedjax.studies import text_data
from pagedjax.config import Config, ConfigError
from pagedjax.model.llama import LINEAR_IMPLS, PROJECTIONS
from pagedjax.model.step import DECODE_LAYERS, CompiledStep
from pagedjax.host.requests.sampling_params import SamplingParams

_PROFILE_DIR = cli.profile_dir_flag()  # traces a few decode steps at the largest batch

PROFILE_STEPS = 5
ITERATION = 'decode_iteration'  # the trace annotation of each traced engine step


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------
def make_prompts(tokenizer, n: int, lengths, vocab_size: int, seed: int):
  """n prompts of real text (King James passages, distinct per prompt), lengths[i] tokens each.
  Real text, not random ids: greedy argmaxes over random ids sit on near-ties more often, and
  two float32 implementations may then legitimately pick different tokens."""
  rng = np.random.default_rng(seed)
  prompts = []
  for i in range(n):
    want = int(lengths[i])
    ids = []
    start = int(rng.integers(0, 20000))
    while len(ids) < want:
      ids = tokenizer.encode(text_data.passage(start, 8 * want + 64))
      start += 7
    prompts.append([int(t) % vocab_size for t in ids[:want]])
  return prompts


# ------------------------------------------------------------------------------------------------
# HF side
# ------------------------------------------------------------------------------------------------
def hf_model_from_params(model_cfg, params):
  """transformers' LlamaForCausalLM holding exactly `params` (float32, eval mode)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  if model_cfg.qkv_bias:
    raise ConfigError('config.model: bench_decode builds a Llama on the HF side; this model has '
                      'q/k/v biases (Qwen2-style), which it does not map')
  hf_cfg = transformers.LlamaConfig(
      vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.d_model,
      intermediate_size=model_cfg.ffn_dim, num_hidden_layers=model_cfg.num_layers,
      num_attention_heads=model_cfg.num_heads, num_key_value_heads=model_cfg.num_kv_heads,
      head_dim=model_cfg.head_dim, max_position_embeddings=model_cfg.max_seq_len,
      rope_theta=model_cfg.rope_theta, rms_norm_eps=model_cfg.norm_eps,
      tie_word_embeddings=model_cfg.tie_embeddings)
  transformers.logging.set_verbosity_error()  # quiet: its notes on eos_token_id=None etc.
  model = transformers.LlamaForCausalLM(hf_cfg).float().eval()
  p = jax.tree.map(np.asarray, params['params'])
  t = lambda x: torch.from_numpy(np.array(x, np.float32, copy=True))
  state = {'model.embed_tokens.weight': t(p['embed']['embedding']),
           'model.norm.weight': t(p['final_norm']['scale'])}
  if not model_cfg.tie_embeddings:
    state['lm_head.weight'] = t(p['lm_head']['kernel'].T)
  lay = p['layers']
  names = {'self_attn.q_proj': lay['attn']['q_proj'], 'self_attn.k_proj': lay['attn']['k_proj'],
           'self_attn.v_proj': lay['attn']['v_proj'], 'self_attn.o_proj': lay['attn']['o_proj'],
           'mlp.gate_proj': lay['mlp']['gate_proj'], 'mlp.up_proj': lay['mlp']['up_proj'],
           'mlp.down_proj': lay['mlp']['down_proj']}
  for i in range(model_cfg.num_layers):
    for name, sub in names.items():
      state[f'model.layers.{i}.{name}.weight'] = t(sub['kernel'][i].T)
    state[f'model.layers.{i}.input_layernorm.weight'] = t(lay['attn_norm']['scale'][i])
    state[f'model.layers.{i}.post_attention_layernorm.weight'] = t(lay['mlp_norm']['scale'][i])
  missing, unexpected = model.load_state_dict(state, strict=False)
  missing = [m for m in missing if not (m == 'lm_head.weight' and model_cfg.tie_embeddings)]
  if missing or unexpected:
    raise RuntimeError(f'HF state dict mismatch: missing {missing}, unexpected {unexpected}')
  if model_cfg.tie_embeddings:
    model.tie_weights()
  model.generation_config.eos_token_id = None  # EOS ignored: always output_len tokens
  return model


def hf_generation_config(output_len: int):
  import transformers  # pylint: disable=g-import-not-at-top
  return transformers.GenerationConfig(max_new_tokens=output_len, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)


def hf_generate(model, prompts, output_len: int):
  """Greedy HF generate over equal-length prompts -> [B, output_len] token ids."""
  import torch  # pylint: disable=g-import-not-at-top
  ids = torch.as_tensor(np.asarray(prompts, np.int64))
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                         generation_config=hf_generation_config(output_len))
  return out[:, ids.shape[1]:].numpy()


def has_generate_batch(model) -> bool:
  return callable(getattr(model, 'generate_batch', None))


def hf_generate_batch(model, prompts, output_len: int):
  """HF continuous batching (transformers >= 4.56) -> list of output id lists, prompt order."""
  import logging  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  # Quiet: it warns that eos_token_id=None means "never stop", which is what is asked.
  logging.getLogger('ContinuousBatchingLogger').setLevel(logging.ERROR)
  with torch.no_grad():
    out = model.generate_batch(prompts, generation_config=hf_generation_config(output_len),
                               progress_bar=False)
  by_prompt = {}
  for o in out.values():  # request ids are req_<index>
    by_prompt[int(str(o.request_id).rsplit('_', 1)[-1])] = list(o.generated_tokens)
  return [by_prompt[i][:output_len] for i in range(len(prompts))]


# ------------------------------------------------------------------------------------------------
# Engine side and the floor
# ------------------------------------------------------------------------------------------------
def engine_run(engine, prompts, output_len: int):
  """All prompts at once through the engine -> (wall s, outputs [n][output_len], step figures)."""
  first_step = len(engine.metrics.steps['device_s'])
  params = SamplingParams(max_new_tokens=output_len, temperature=0.0, stop_on_eos=False)
  t0 = time.perf_counter()
  completions = engine.generate(prompts, params)
  wall = time.perf_counter() - t0
  steps = {k: list(v)[first_step:] for k, v in engine.metrics.steps.items()}
  return wall, [list(c.output_ids) for c in completions], step_figures(steps)


def step_figures(steps) -> dict:
  """Prefill tokens/s, decode step seconds and host seconds per decode step, from the engine's
  per-iteration metrics; iterations that compiled are left out."""
  pre_s = pre_tok = 0.0
  dec_s, dec_host = [], []
  for pf, dc, dev, host, comp in zip(steps['prefill_tokens'], steps['decode_tokens'],
                                     steps['device_s'], steps['host_s'], steps['compile_s']):
    if comp:
      continue
    if pf:
      pre_s += dev + host
      pre_tok += pf
    elif dc:
      dec_s.append(dev + host)
      dec_host.append(host)
  return {'prefill_tokens_per_s': pre_tok / pre_s if pre_s else None,
          'decode_step_s': float(np.median(dec_s)) if dec_s else None,
          'host_s_per_step': float(np.median(dec_host)) if dec_host else None,
          'decode_steps': len(dec_s)}


def matmul_floor_fn(model_cfg, params, batch: int, linear_impl: str = 'xla'):
  """The decode step's matmuls alone at `batch` rows, jitted -> zero-arg callable; linear_impl
  'cpu' runs them through the native kernel (kernels/linear_cpu.py), which reads a tied head's
  [V, D] embedding in place.

  Per-layer weights are separate arrays (sliced out once, here), so the floor pays for no
  slicing; the layers are a Python loop (unrolled), each dot fed by the previous one so nothing
  is dead code. Elementwise work is one add per layer; no attention, norms or sampling. A tied
  output head is transposed once, here, to [D, V]: given the [V, D] embedding, XLA:CPU copies
  it transposed (113 MB for SmolLM2) inside every 1-row call before its matrix-vector product
  (measured: 51 ms per 1-row floor call against 26 ms for the whole plain step)."""
  p = params['params']
  lay = p['layers']
  per_layer = [[jnp.array(lay[a][n]['kernel'][i]) for a, n in PROJECTIONS]
               for i in range(model_cfg.num_layers)]
  kernel = linear_cpu.resolve(linear_impl) in linear_cpu.KERNEL_IMPLS
  mm = (lambda a, w: linear_cpu.linear(a, w)) if kernel else jnp.dot
  if model_cfg.tie_embeddings and kernel:
    head = jnp.array(p['embed']['embedding'])  # [V, D], read in place by the kernel
    head_mm = lambda a, e: linear_cpu.linear(a, e, transposed=True)
  else:
    head = jnp.array(p['embed']['embedding'].T if model_cfg.tie_embeddings
                     else p['lm_head']['kernel'])  # [D, V]
    head_mm = mm

  @jax.jit
  def floor(per_layer, head, x):
    for q_w, k_w, v_w, o_w, g_w, u_w, d_w in per_layer:
      q, k, v = mm(x, q_w), mm(x, k_w), mm(x, v_w)
      a = mm(q, o_w)  # attention output projection (the attention itself is not a matmul here)
      h = mm(a, g_w) + mm(a, u_w)
      x = x + mm(h, d_w) + (k[:, :1] + v[:, :1])
    return head_mm(x, head)

  x = jnp.ones((batch, model_cfg.d_model), jnp.float32)
  return lambda: floor(per_layer, head, x)


def time_calls(fn, n: int) -> float:
  """Median seconds of n blocking calls."""
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def agreement(a, b) -> float:
  """Share of positions where two [n][len] token id lists agree."""
  total = same = 0
  for x, y in zip(a, b):
    x, y = list(map(int, x)), list(map(int, y))
    total += max(len(x), len(y))
    same += sum(i == j for i, j in zip(x, y))
  return same / total if total else 1.0


def start_decoding(engine, prompts, params) -> None:
  """Submits the prompts and steps the engine until every one is running and prefilled: the
  next step is a decode step of them all."""
  for prompt in prompts:
    engine.submit(prompt, params)
  while engine.has_work() and (len(engine.running) < len(prompts) or any(
      s.num_cached < len(s.prompt_ids) for s in engine.running)):
    engine.step()


def profile_decode(engine, prompts, profile_dir: str, steps: int = PROFILE_STEPS) -> str:
  """Runs prompts to their first decode steps, then traces `steps` warm decode iterations."""
  start_decoding(engine, prompts,
                 SamplingParams(max_new_tokens=steps + 4, temperature=0.0, stop_on_eos=False))
  engine.step()
  os.makedirs(profile_dir, exist_ok=True)
  jax.profiler.start_trace(profile_dir)
  for _ in range(steps):
    with jax.profiler.TraceAnnotation(ITERATION):
      engine.step()
  jax.profiler.stop_trace()
  engine.run()
  return profile_dir


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------
def plot(path: str, rows) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in rows if r['kind'] == 'batch']
  b = [r['batch'] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  ax = axes[0]
  ax.plot(b, [r['engine_tokens_per_s'] for r in rows], marker='o', label='pagedjax engine')
  if any(r.get('hf_tokens_per_s') for r in rows):
    ax.plot(b, [r.get('hf_tokens_per_s') for r in rows], marker='s', label='HF generate')
  ax.set_xscale('log', base=2)
  ax.set_xlabel('batch')
  ax.set_title('end-to-end tokens/s')
  ax.legend()
  ax.grid(alpha=0.3)
  ax = axes[1]
  ax.plot(b, [1e3 * (r['decode_step_s'] or math.nan) for r in rows], marker='o',
          label='engine decode step')
  ax.plot(b, [1e3 * r['plain_s'] for r in rows], marker='s', label='plain unrolled JAX step')
  ax.plot(b, [1e3 * r['floor_s'] for r in rows], marker='^', label='matmul floor')
  ax.set_xscale('log', base=2)
  ax.set_xlabel('batch')
  ax.set_title('ms per decode step')
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  with run_info.atomic_write(path, 'wb') as f:
    fig.savefig(f, format='png', dpi=120)
  plt.close(fig)


def markdown_table(rows, impls=('xla',)) -> str:
  """The table docs/decode_speed.md quotes; with more than one linear impl, a second table of
  their engines side by side (impls[0] is the rows' own)."""
  f = lambda x, spec: '-' if x is None else format(x, spec)
  lines = ['| batch | engine tok/s | HF generate tok/s | engine / HF | prefill tok/s | '
           'decode step ms | plain step ms | matmul floor ms | step / floor | plain / floor | '
           'step / plain | host ms/step | agreement |',
           '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    if r['kind'] != 'batch':
      continue
    step = r['decode_step_s']
    lines.append(
        f"| {r['batch']} | {r['engine_tokens_per_s']:.1f} | {f(r.get('hf_tokens_per_s'), '.1f')}"
        f" | {f(r.get('engine_over_hf'), '.2f')}x | {f(r['prefill_tokens_per_s'], '.0f')} | "
        f"{f(step and 1e3 * step, '.1f')} | {1e3 * r['plain_s']:.1f} | {1e3 * r['floor_s']:.1f} | "
        f"{f(r['step_over_floor'], '.2f')} | {r['plain_over_floor']:.2f} | "
        f"{f(r['step_over_plain'], '.2f')} | "
        f"{f(r['host_s_per_step'] and 1e3 * r['host_s_per_step'], '.2f')}"
        f" | {f(r.get('token_agreement'), '.3f')} |")
  lines += linear_table(rows, impls)
  bounds = [r for r in rows if r.get('engine_over_hf_if_step_at_floor')]
  if bounds:
    lines.append('')
    lines.append('engine / HF if the decode step ran at the matmul floor (at the plain step): ' +
                 ', '.join(f"batch {r['batch']} {r['engine_over_hf_if_step_at_floor']:.2f}x "
                           f"({r['engine_over_hf_if_step_at_plain']:.2f}x)" for r in bounds))
  for r in rows:
    if r['kind'] == 'trace':
      lines.append('')
      lines.append(f"Trace of {r['requests']} requests: engine {r['engine_tokens_per_s']:.1f} "
                   f"tok/s, HF generate_batch {f(r.get('hf_tokens_per_s'), '.1f')} tok/s "
                   f"({f(r.get('engine_over_hf'), '.2f')}x), agreement "
                   f"{f(r.get('token_agreement'), '.3f')}"
                   + (f" ({r['hf_note']})" if r.get('hf_note') else ''))
  return '\n'.join(lines)


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def main(argv):
  del argv
  config = flags.FLAGS.config
  typed = Config.from_configdict(config)
  cli.check_model_path(typed)
  bench = config.get('bench')
  if bench is None:
    raise ConfigError('config.bench is missing: use configs/bench_decode.py')
  batches = sorted(int(b) for b in bench.batches)
  if not batches or batches[0] < 1 or batches[-1] > typed.engine.max_batch_size:
    raise ConfigError(f'config.bench.batches={list(bench.batches)} is not allowed: batch sizes '
                      f'in [1, engine.max_batch_size={typed.engine.max_batch_size}]')
  if bench.prompt_len + bench.output_len > typed.engine.max_seq_len:
    raise ConfigError(f'config.bench.prompt_len + output_len = '
                      f'{bench.prompt_len + bench.output_len} is not allowed: at most '
                      f'engine.max_seq_len={typed.engine.max_seq_len}')
  if bench.decode_layers not in DECODE_LAYERS:
    raise ConfigError(f'config.bench.decode_layers={bench.decode_layers!r} is not allowed: one '
                      f'of {DECODE_LAYERS}')
  if typed.mesh.model > 1:
    raise ConfigError(f'config.mesh.model={typed.mesh.model} is not allowed: bench_decode runs '
                      'on one device (1)')
  impls = linear_impls(bench.linear_impls)
  workdir = cli.prepare_workdir(flags.FLAGS.workdir)
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  model_cfg, params, tokenizer = factory.load_model_and_tokenizer(config)
  # One engine per linear impl, the first the one every other figure is measured with.
  steps = {impl: CompiledStep(model_cfg, typed.attention.impl, decode_layers=bench.decode_layers,
                              linear_impl=impl) for impl in impls}
  engines = {impl: factory.make_engine(config, model_cfg, params, tokenizer, step_fn=steps[impl])
             for impl in impls}
  step, engine = steps[impls[0]], engines[impls[0]]
  others = impls[1:]
  use_hf = bool(bench.hf)
  hf = hf_model_from_params(model_cfg, params) if use_hf else None
  out_len = int(bench.output_len)
  prompts = make_prompts(tokenizer, batches[-1], [bench.prompt_len] * batches[-1],
                         model_cfg.vocab_size, bench.seed)
  floor_impls = ['xla'] + [i for i in impls if i != 'xla']  # 'floor' stays XLA's dots
  floors = {(i, b): matmul_floor_fn(model_cfg, params, b, i) for i in floor_impls for b in batches}
  plain_context = int(bench.prompt_len) + out_len // 2  # the engine's median decode context
  plains = {b: plain_step.timed_step_fn(model_cfg, params, b, plain_context) for b in batches}
  rounds = int(bench.rounds)

  jobs = []  # (name, batch, fn)
  # The warm-up round generates fewer tokens: it meets the same shapes (decode contexts stay in
  # the first block-table bucket, >= 256 tokens) and halves the run; the timed rounds' count of
  # compilations (0, reported) checks that.
  warm_len = min(out_len, int(bench.warmup_output_len))
  lens = lambda r: warm_len if r == 0 else out_len
  floor_name = lambda i: 'floor' if i == 'xla' else f'floor_{i}'
  for b in batches:
    jobs.append(('engine', b, lambda r, b=b: engine_run(engine, prompts[:b], lens(r))))
    for impl in others:
      jobs.append((f'engine_{impl}', b,
                   lambda r, b=b, impl=impl: engine_run(engines[impl], prompts[:b], lens(r))))
    if use_hf:
      jobs.append(('hf', b, lambda r, b=b: hf_generate(hf, prompts[:b], lens(r))))
    for impl in floor_impls:
      jobs.append((floor_name(impl), b, lambda r, b=b, impl=impl: time_calls(
          floors[(impl, b)], int(bench.floor_rounds))))
    jobs.append(('plain', b, lambda r, b=b: time_calls(plains[b], int(bench.floor_rounds))))

  results = {(name, b): [] for name, b, _ in jobs}
  outputs = {}
  bar = tqdm(total=len(jobs) * (rounds + 1), desc='bench_decode', leave=False)
  for r in range(rounds + 1):  # round 0 is the warm-up (the engine compiles there)
    shift = r % len(jobs)
    for name, b, fn in jobs[shift:] + jobs[:shift]:
      bar.set_postfix_str(f'{"warm-up" if r == 0 else f"round {r}"}: {name} B={b}')
      t0 = time.perf_counter()
      out = fn(r)
      wall = time.perf_counter() - t0
      if name.startswith('engine'):
        wall, ids, figs = out
        outputs[(name, b)] = ids
        if r:
          results[(name, b)].append({'wall_s': wall, **figs})
      elif name == 'hf':
        outputs[('hf', b)] = out
        if r:
          results[(name, b)].append({'wall_s': wall})
      elif r:
        results[(name, b)].append({f'{name}_s': out})
      bar.update()
    if r == 0:
      compilations_warm = sum(e.num_compilations for e in engines.values())
  compilations_timed = sum(e.num_compilations for e in engines.values()) - compilations_warm
  bar.close()

  med = lambda rs, k: (float(np.median([x[k] for x in rs if x[k] is not None]))
                       if any(x[k] is not None for x in rs) else None)
  rows = []
  for b in batches:
    er = results[('engine', b)]
    tokens = b * out_len
    row = {'kind': 'batch', 'batch': b, 'requests': b, 'prompt_len': int(bench.prompt_len),
           'output_len': out_len,
           'engine_s': med(er, 'wall_s'), 'engine_tokens_per_s': tokens / med(er, 'wall_s'),
           'prefill_tokens_per_s': med(er, 'prefill_tokens_per_s'),
           'decode_step_s': med(er, 'decode_step_s'),
           'host_s_per_step': med(er, 'host_s_per_step'),
           'floor_s': med(results[('floor', b)], 'floor_s'),
           'plain_s': med(results[('plain', b)], 'plain_s')}
    for impl in floor_impls[1:]:
      row[f'floor_s_{impl}'] = med(results[(floor_name(impl), b)], f'floor_{impl}_s')
    for impl in others:
      row.update(linear_rows(er, results[(f'engine_{impl}', b)], impl, tokens))
      row[f'token_agreement_{impl}'] = agreement(outputs[('engine', b)],
                                                 outputs[(f'engine_{impl}', b)])
    row['step_over_floor'] = (row['decode_step_s'] / row['floor_s']
                              if row['decode_step_s'] else None)
    row['plain_over_floor'] = row['plain_s'] / row['floor_s']
    row['step_over_plain'] = (row['decode_step_s'] / row['plain_s']
                              if row['decode_step_s'] else None)
    row['host_share_of_step'] = (row['host_s_per_step'] / row['decode_step_s']
                                 if row['decode_step_s'] else None)
    if use_hf:
      hs = med(results[('hf', b)], 'wall_s')
      row.update(hf_s=hs, hf_tokens_per_s=tokens / hs,
                 engine_over_hf=row['engine_tokens_per_s'] / (tokens / hs),
                 token_agreement=agreement(outputs[('engine', b)], outputs[('hf', b)]))
      # Bounds: engine / HF if each decode step took the floor's (or the plain step's) time,
      # the prefill as measured. Where even the floor's bound is under a goal, no decode-step
      # work meets it on this machine.
      prefill_s = b * int(bench.prompt_len) / row['prefill_tokens_per_s']
      for name in ('floor', 'plain'):
        row[f'engine_over_hf_if_step_at_{name}'] = hs / (
            prefill_s + (out_len - 1) * row[f'{name}_s'])
    rows.append(row)

  trace = None
  n_trace = int(bench.trace_requests)
  if n_trace:
    trace = run_trace(engine, hf, tokenizer, model_cfg, bench, n_trace, out_len)
    rows.append(trace)

  profile = None
  if _PROFILE_DIR.value:
    profile = profile_decode(engine, prompts[:batches[-1]],
                             os.path.abspath(_PROFILE_DIR.value))

  summary = {
      'model': config.model.source if config.model.source != 'random' else 'random-tiny',
      'model_config': model_cfg.__dict__,
      'batches': batches, 'prompt_len': int(bench.prompt_len), 'output_len': out_len,
      'rounds': rounds, 'plain_context': plain_context,
      'decode_layers': step.decode_layers, 'unrolled_min_rows': step.unrolled_min_rows,
      # The engines' linear layers: bench.linear_impls resolved on this backend; rows are the
      # first's, the others' figures are the rows' *_<impl> fields.
      'linear_impls': impls, 'linear_kernel_avx2': linear_cpu.uses_avx2(),
      # The attention path the engine ran: config.attention.impl, 'auto' resolved as the model
      # resolves it on this backend (on CPU: the native `cpu` kernel where it builds, else xla).
      'attention_impl': attention_impl(typed.attention.impl),
      'rows': rows,
      # Every timed round's figures (rows hold their medians): how far rounds disagree.
      'rounds_detail': {f'{name} B={b}': figures for (name, b), figures in results.items()},
      'num_compilations': engine.num_compilations,
      'num_compilations_after_warmup': compilations_timed,  # in the timed rounds: must be 0
      'profile_dir': profile,
      'load_average_1m': os.getloadavg()[0],
      'hf_generate_batch_available': bool(hf is not None and has_generate_batch(hf)),
      'markdown_table': markdown_table(rows, impls),
      'config': config.to_dict(),
      **run_info.environment(),
  }
  run_info.write_json(os.path.join(workdir, 'summary.json'), summary)
  run_info.write_csv(os.path.join(workdir, 'results.csv'), rows)
  plot(os.path.join(workdir, 'bench_decode.png'), rows)
  print(summary['markdown_table'])
  print(f'attention: {summary["attention_impl"]} (config.attention.impl='
        f'{typed.attention.impl!r}); linear layers: {" vs ".join(impls)} '
        f'(config.bench.linear_impls={tuple(bench.linear_impls)!r})')
  print(f'\nwrote {workdir}/summary.json, results.csv, bench_decode.png '
        f'(load average {summary["load_average_1m"]:.1f} on {os.cpu_count()} cores)')


def linear_table(rows, impls) -> list:
  """Lines of the linear-impl comparison (none with one impl)."""
  if len(impls) < 2:
    return []
  f = lambda x, spec: '-' if x is None else format(x, spec)
  first = impls[0]
  lines = ['', f'Linear layers, `{first}` against each other impl (same prompts, same rounds; '
           f'ratio = {first} decode step / the other\'s, per round, median):', '',
           f'| batch | impl | engine tok/s | {first} engine tok/s | decode step ms | '
           f'{first} decode step ms | step ratio {first} / impl | tokens same as {first} |',
           '|---|---|---|---|---|---|---|---|']
  for r in rows:
    if r['kind'] != 'batch':
      continue
    for impl in impls[1:]:
      step = r.get(f'decode_step_s_{impl}')
      lines.append(
          f"| {r['batch']} | {impl} | {f(r.get(f'engine_tokens_per_s_{impl}'), '.1f')} | "
          f"{r['engine_tokens_per_s']:.1f} | {f(step and 1e3 * step, '.1f')} | "
          f"{f(r['decode_step_s'] and 1e3 * r['decode_step_s'], '.1f')} | "
          f"{f(r.get(f'decode_step_ratio_{impl}'), '.3f')} | "
          f"{f(r.get(f'token_agreement_{impl}'), '.3f')} |")
  floors = [k[len('floor_s_'):] for k in rows[0] if k.startswith('floor_s_')] if rows else []
  for impl in floors:
    lines.append('')
    lines.append(f'Matmul floor ms, XLA dots / {impl}: ' + ', '.join(
        f"batch {r['batch']} {1e3 * r['floor_s']:.1f} / {1e3 * r[f'floor_s_{impl}']:.1f}"
        for r in rows if r['kind'] == 'batch'))
  return lines


def attention_impl(impl: str) -> str:
  return kernels.best_impl() if impl == 'auto' else impl


def linear_impls(names) -> list:
  """config.bench.linear_impls resolved on this backend ('auto' -> 'cpu' or 'xla'), in order,
  each once."""
  names = [names] if isinstance(names, str) else list(names)
  if not names or any(n not in LINEAR_IMPLS for n in names):
    raise ConfigError(f'config.bench.linear_impls={names!r} is not allowed: a non-empty tuple '
                      f'of {LINEAR_IMPLS}')
  resolved = []
  for name in names:
    try:
      impl = linear_cpu.resolve(name)
    except RuntimeError as e:
      raise ConfigError(f'config.bench.linear_impls: {e}') from None
    if impl not in resolved:
      resolved.append(impl)
  return resolved


def linear_rows(first, other, impl: str, tokens: int) -> dict:
  """Another linear impl's engine figures for a batch row: its tokens/s and decode step (medians
  over rounds) and the per-round ratio of the first engine's decode step to its own, medianed
  (rounds run both back to back, so a round's ratio sees one machine state)."""
  steps = [(a['decode_step_s'], o['decode_step_s']) for a, o in zip(first, other)
           if a['decode_step_s'] and o['decode_step_s']]
  walls = [o['wall_s'] for o in other]
  return {f'engine_tokens_per_s_{impl}': tokens / float(np.median(walls)) if walls else None,
          f'decode_step_s_{impl}': (float(np.median([o for _, o in steps])) if steps else None),
          f'decode_step_ratio_{impl}': (float(np.median([a / o for a, o in steps]))
                                        if steps else None)}


def run_trace(engine, hf, tokenizer, model_cfg, bench, n: int, out_len: int) -> dict:
  """n requests of mixed prompt lengths at once: engine vs HF generate_batch (warm, timed once)."""
  rng = np.random.default_rng(bench.seed + 1)
  p = int(bench.prompt_len)
  lengths = rng.integers(max(1, p // 2), p + p // 2 + 1, n)
  prompts = make_prompts(tokenizer, n, lengths, model_cfg.vocab_size, bench.seed + 2)
  engine_run(engine, prompts, out_len)  # warm-up: the trace's shapes compile here
  wall, ids, figs = engine_run(engine, prompts, out_len)
  tokens = n * out_len
  row = {'kind': 'trace', 'batch': None, 'requests': n, 'prompt_len': float(lengths.mean()),
         'output_len': out_len, 'engine_s': wall, 'engine_tokens_per_s': tokens / wall,
         'prefill_tokens_per_s': figs['prefill_tokens_per_s'],
         'decode_step_s': figs['decode_step_s'], 'host_s_per_step': figs['host_s_per_step']}
  if hf is None or not bench.generate_batch:
    row['hf_note'] = 'generate_batch not run (config.bench.generate_batch or hf off)'
  elif not has_generate_batch(hf):
    import transformers  # pylint: disable=g-import-not-at-top
    row['hf_note'] = f'transformers {transformers.__version__} has no generate_batch'
  else:
    hf_generate_batch(hf, prompts[:2], 2)  # warm-up
    t0 = time.perf_counter()
    hf_ids = hf_generate_batch(hf, prompts, out_len)
    hs = time.perf_counter() - t0
    row.update(hf_s=hs, hf_tokens_per_s=tokens / hs, engine_over_hf=(tokens / wall) / (tokens / hs),
               token_agreement=agreement(ids, hf_ids), hf_note='HF generate_batch')
  return row


if __name__ == '__main__':
  cli.define_flags('configs/bench_decode.py', 'Benchmark config.')
  cli.run(main)
