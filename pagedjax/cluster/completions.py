"""A completion request as it travels from the Serve ingress to a replica (serve.py).

`parse_completion` turns an OpenAI /v1/completions body into a `RoutedPrompt` (or a
RequestError naming the field); the router keeps what it computed for the request on it
(`RoutedPrompt.route`: the prompt's chain keys), and the replica hands those keys to its engine.

Why this is not in serve.py: Ray Serve ships a request router by value. RequestRouterConfig
registers the router class's module with `cloudpickle.register_pickle_by_value` and pickles the
class, so in the ingress's process the router's code runs against a copy of serve.py's globals,
in which every class serve.py defines is a second class of the same name. A `RoutedPrompt`
defined there was, to the router, not a RoutedPrompt (`isinstance` false): the router computed
its keys but never kept them on the request, and every replica hashed its prompt again. A class
from this module is pickled by reference (this module is not registered), so the router, the
ingress and the replicas all see the one class. Plain Python: no Ray, no jax.
"""
import dataclasses
import uuid
from typing import Optional

from pagedjax.cluster import routers as routers_lib
from pagedjax.host.requests.intake import RequestError
from pagedjax.host.requests.sampling_params import as_params, brief


@dataclasses.dataclass
class RoutedPrompt:
  """One completion request after the ingress parsed it. `prompt` is text for routers that
  match characters (Ray's PrefixCacheAffinityRouter reads `.prompt`); token-id prompts give
  their ids as text."""
  prompt_ids: object  # token ids (a list of ints) or, when not a str or list, the raw value
  prompt: str
  params: dict  # SamplingParams fields
  request_id: str
  stream: bool = False
  model: str = ''
  # what the router saw (route_request): its chain keys are computed once, when the router
  # first sees the request, and kept for on_request_routed and for a retry after a replica died
  route: Optional[routers_lib.RouteRequest] = dataclasses.field(default=None, repr=False,
                                                                compare=False)
  # wall-clock stamps (time.time(); every process is on one machine) of the request's way to
  # its first token, added by the ingress, the router and the replica (serve.STAGES)
  times: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  @property
  def salt(self) -> Optional[str]:
    return self.params.get('cache_salt')


COMPLETION_FIELDS = ('prompt', 'max_tokens', 'temperature', 'top_p', 'seed', 'stream', 'model',
                     'cache_salt', 'ignore_eos', 'request_id')
MAX_REQUEST_ID = 128  # characters


def parse_completion(body, tokenizer=None) -> RoutedPrompt:
  """An OpenAI /v1/completions body -> RoutedPrompt, or RequestError naming the field.

  max_tokens (default 16, as OpenAI's) is SamplingParams.max_new_tokens; temperature (default
  1.0), top_p, seed and cache_salt are SamplingParams' own; ignore_eos (vLLM's extension,
  default false) is `not stop_on_eos`; request_id (vLLM's extension: the caller's id for the
  request, the answer's `id`; default a fresh 'cmpl-...') is what KVEventBus.serving finds the
  request's replica by. The parameters are checked here by
  the engine's own SamplingParams checks, the prompt (ids in the vocabulary, length within
  max_seq_len) by the engine that receives it."""
  if not isinstance(body, dict):
    raise RequestError(f'request body {brief(body)} is not allowed: a JSON object')
  unknown = sorted(set(body) - set(COMPLETION_FIELDS))
  if unknown:
    raise RequestError(f'field {unknown[0]!r} is not allowed: the fields are '
                       f'{", ".join(COMPLETION_FIELDS)}')
  if 'prompt' not in body:
    raise RequestError('field prompt is missing: a string or a list of token ids')
  stream = body.get('stream', False)
  if not isinstance(stream, bool):
    raise RequestError(f'stream={brief(stream)} is not allowed: true or false')
  model = body.get('model', '')
  if not isinstance(model, str):
    raise RequestError(f'model={brief(model)} is not allowed: a string')
  params = dict(max_new_tokens=body.get('max_tokens', 16),
                temperature=body.get('temperature', 1.0), top_p=body.get('top_p', 1.0),
                seed=body.get('seed', 0), cache_salt=body.get('cache_salt'))
  ignore_eos = body.get('ignore_eos', False)
  if not isinstance(ignore_eos, bool):
    raise RequestError(f'ignore_eos={brief(ignore_eos)} is not allowed: true or false')
  params['stop_on_eos'] = not ignore_eos
  request_id = body.get('request_id', f'cmpl-{uuid.uuid4().hex[:24]}')
  if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID:
    raise RequestError(f'request_id={brief(request_id)} is not allowed: a string of 1 to '
                       f'{MAX_REQUEST_ID} characters')
  try:
    as_params(params).validate()
  except ValueError as e:  # the engine's own check, named as the request names the field
    raise RequestError(str(e).replace('max_new_tokens=', 'max_tokens=', 1)) from None
  prompt = body['prompt']
  if isinstance(prompt, str) and tokenizer is not None:
    try:
      ids = tokenizer.encode(prompt)
    except ValueError as e:  # text the tokenizer cannot take (a lone surrogate)
      raise RequestError(f'prompt={brief(prompt)} is not allowed: {e}') from None
    text = prompt
  elif isinstance(prompt, list):
    ids, text = prompt, ' '.join(map(str, prompt))
  else:
    ids, text = prompt, ''  # the engine names what is wrong with it
  return RoutedPrompt(ids, text, params, request_id, stream, model)
