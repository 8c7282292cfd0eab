"""Default decode experiment: SmolLM2-135M-Instruct (shipped GGUF) on CPU, paged KV pool.

  python -m experiments.decode --config=configs/default.py --workdir=runs/default
  python -m experiments.decode --config=configs/default.py:tiny --workdir=runs/tiny

`:tiny` swaps in a small random Llama (same tokenizer): a smoke run of the same job. Any field can be
overridden on the command line, e.g. `--config.pool.block_size=32`; the fields, their
defaults and what they mean are the dataclasses of pagedjax/config.py.
"""
from pagedjax.config import Config

PROMPTS = (
    'The capital of France is',
    'In the beginning God created',
    'The three primary colors are',
    'def fibonacci(n):',
    'Water boils at a temperature of',
    'The largest planet in our solar system is',
)


def get_config(arg=None):
  # Every field and its default comes from the typed config (pagedjax/config.py, which
  # documents each one); this file sets only what the main job chooses differently.
  config = Config().to_configdict()
  config.sampling.max_new_tokens = 24
  config.prompts = list(PROMPTS)

  if arg == 'tiny':
    config.model.source = 'random'
    config.sampling.max_new_tokens = 16
  elif arg:
    raise ValueError(f'configs/default.py: unknown variant {arg!r}; allowed: tiny')
  config.variant = arg or 'full'
  return config
