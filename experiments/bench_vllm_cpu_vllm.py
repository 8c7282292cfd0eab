"""The vLLM side of experiments/bench_vllm_cpu.py, run in vLLM's own venv (it imports nothing of
pagedjax, whose dependencies it does not have):

  VENV/bin/python experiments/bench_vllm_cpu_vllm.py WORKDIR          # its own rounds
  VENV/bin/python experiments/bench_vllm_cpu_vllm.py WORKDIR --serve  # the caller's (serve())

Reads WORKDIR/prompts.json and the HF folder WORKDIR/hf_model that `--step=pagedjax` wrote, runs
vLLM's offline `LLM` on the same token ids (float32, greedy, EOS ignored, prefix caching off, no
tokenizer: ids in, ids out), one warm-up round and `rounds` timed rounds per batch, every prompt
of a batch submitted in one generate call, and writes WORKDIR/vllm.json (per batch: wall times,
median tokens/s, the generated ids). Environment knobs are vLLM's own and recorded in the file:
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache; default here 4), VLLM_CPU_OMP_THREADS_BIND (default
vLLM's: one thread per core).
"""
import json
import os
import statistics
import sys
import time


def build(workdir):
  """(vllm module, run(batch) -> (wall s, [n][output_len] ids), setup) on WORKDIR's files."""
  os.environ.setdefault('VLLM_CPU_KVCACHE_SPACE', '4')
  import vllm  # pylint: disable=import-outside-toplevel
  from vllm import LLM, SamplingParams  # pylint: disable=import-outside-toplevel
  from vllm.inputs import TokensPrompt  # pylint: disable=import-outside-toplevel

  with open(os.path.join(workdir, 'prompts.json')) as f:
    setup = json.load(f)
  prompts, output_len = setup['prompts'], int(setup['output_len'])
  llm = LLM(model=os.path.join(workdir, 'hf_model'), dtype='float32', skip_tokenizer_init=True,
            max_model_len=int(setup['max_model_len']), max_num_seqs=max(setup['batches']),
            enable_prefix_caching=False, generation_config='vllm', seed=0)
  params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                          detokenize=False)

  def run(batch):
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts[:batch]]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, [list(o.outputs[0].token_ids) for o in outs]
  return vllm, run, setup


def info(vllm):
  return dict(vllm_version=vllm.__version__,
              env={k: v for k, v in os.environ.items()
                   if k.startswith('VLLM_') or k == 'LD_PRELOAD'},
              cpu_count=os.cpu_count())


def main(workdir):
  vllm, run, setup = build(workdir)
  output_len = int(setup['output_len'])
  results = {}
  for batch in setup['batches']:
    run(batch)  # warm-up
    walls, ids = [], None
    for _ in range(int(setup['rounds'])):
      wall, ids = run(batch)
      walls.append(wall)
    wall = statistics.median(walls)
    results[str(batch)] = dict(walls_s=walls, wall_s=wall,
                               tokens_per_s=batch * output_len / wall, output_ids=ids)
    print(f'vllm B={batch}: {results[str(batch)]["tokens_per_s"]:.1f} tokens/s', flush=True)
  out = dict(batches=results, load_average_1m=os.getloadavg()[0], **info(vllm))
  tmp = os.path.join(workdir, 'vllm.json.tmp')
  with open(tmp, 'w') as f:
    json.dump(out, f, indent=2)
  os.replace(tmp, os.path.join(workdir, 'vllm.json'))


def serve(workdir):
  """--serve: the rounds are the caller's (experiments/bench_vllm_cpu.py --step=interleaved,
  which alternates them with the engine's). Prints `@@READY {info}` once the model is loaded,
  then per stdin line `run BATCH` one generate call and `@@ROUND {"wall_s", "output_ids"}`;
  `quit` (or the end of stdin) ends it. Lines without the @@ prefix are vLLM's own logs."""
  vllm, run, _ = build(workdir)
  print('@@READY ' + json.dumps(info(vllm)), flush=True)
  for line in sys.stdin:
    words = line.split()
    if not words or words[0] == 'quit':
      break
    if words[0] != 'run' or len(words) != 2 or not words[1].isdigit():
      print('@@ERROR ' + json.dumps(f'unknown command {line.strip()!r}: run BATCH or quit'),
            flush=True)
      continue
    wall, ids = run(int(words[1]))
    print('@@ROUND ' + json.dumps(dict(wall_s=wall, output_ids=ids)), flush=True)


if __name__ == '__main__':
  args = [a for a in sys.argv[1:] if a != '--serve']
  if len(args) != 1:
    sys.exit('usage: python experiments/bench_vllm_cpu_vllm.py WORKDIR [--serve]')
  # vLLM inspects model classes in a `python -m` subprocess, whose sys.path starts with the
  # current directory: run from the repo root, transformers' probe for a `kernels` package
  # would import this repo's kernels/ (which needs jax) and vLLM would refuse the model. The
  # workdir holds only our files.
  target = os.path.abspath(args[0])
  os.chdir(target)
  (serve if '--serve' in sys.argv[1:] else main)(target)
