"""Text <-> token ids, built offline from GGUF metadata or an HF tokenizer.json.

The SmolLM2 GGUF carries its whole tokenizer (vocabulary, merges, token types, special ids,
chat template), so no network download is needed: we rebuild it as a Hugging Face `tokenizers`
byte-level BPE with the pre-tokenizer llama.cpp calls "smollm" (every digit its own piece, then
the GPT-2 byte-level regex, no prefix space).
"""
import json
import mmap
import os
import struct
from typing import Dict, Optional, Sequence

import numpy as np

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# llama.cpp token types (gguf.TokenType): control tokens are specials like <|im_end|>;
# user-defined tokens are added tokens matched whole but not special.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# tokenizer.ggml.pre values whose pre-tokenization we reproduce exactly.
_DIGITS_THEN_BYTE_LEVEL = ('smollm',)
_BYTE_LEVEL_ONLY = ('gpt2', 'default')


class Tokenizer:
  """A thin wrapper over a `tokenizers.Tokenizer` with the ids the decode loop needs."""

  def __init__(self, tok: tokenizers.Tokenizer, bos_id: Optional[int], eos_id: Optional[int],
               chat_template: Optional[str] = None):
    self._tok = tok
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.chat_template = chat_template

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list:
    """Ids for text; special tokens written in the text (e.g. <|im_end|>) become single ids.

    No BOS is prepended: SmolLM2 is trained without one (tokenizer.ggml.add_bos_token=false).
    Raises ValueError for text that is not valid Unicode (a lone surrogate, which `tokenizers`
    would refuse with a bare TypeError).
    """
    if not isinstance(text, str):
      raise TypeError(f'text must be a str, not {type(text).__name__}')
    try:
      text.encode('utf-8')
    except UnicodeEncodeError as e:
      raise ValueError(f'text is not valid Unicode: lone surrogate {text[e.start:e.end]!r} at '
                       f'index {e.start} (allowed: text that encodes as UTF-8)') from None
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """Text for ids. Specials are kept by default so encode/decode round-trips exactly."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f'token ids out of range [0, {self.vocab_size}): {bad[:8]}')
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> Optional[int]:
    return self._tok.token_to_id(token)

  def save(self, tokenizer_json: str):
    """Write an HF tokenizer.json (a JSON load, where a GGUF's whole metadata must be parsed)."""
    self._tok.save(tokenizer_json)

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True
                          ) -> str:
    """Render [{'role': ..., 'content': ...}] with the model's Jinja chat template (needs jinja2).

    Returns the prompt text; pass it to encode(). The template is rendered in a sandbox, as
    Hugging Face does, since it comes from a model file.
    """
    if not self.chat_template:
      raise ValueError('this tokenizer has no chat template')
    try:
      from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
      raise ImportError('apply_chat_template needs jinja2: pip install jinja2') from e
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=['jinja2.ext.loopcontrols'])

    def raise_exception(message):  # templates call this to reject bad conversations
      raise ValueError(f'chat template: {message}')

    env.globals['raise_exception'] = raise_exception
    special = lambda i: self._tok.id_to_token(i) if i is not None else ''
    return env.from_string(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=special(self.bos_id), eos_token=special(self.eos_id))

  @classmethod
  def from_gguf(cls, path: str) -> 'Tokenizer':
    """Byte-level BPE from a GGUF file's tokenizer.ggml.* metadata."""
    if not os.path.isfile(path):
      raise FileNotFoundError(f'GGUF file not found: {path!r}')
    metadata = gguf_metadata(path)
    field = metadata.get
    kind, pre = field('tokenizer.ggml.model'), field('tokenizer.ggml.pre') or 'default'
    if kind != 'gpt2':
      raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE 'gpt2'")
    if pre not in _DIGITS_THEN_BYTE_LEVEL + _BYTE_LEVEL_ONLY:
      raise ValueError(f'unsupported GGUF pre-tokenizer {pre!r}; supported: '
                       f'{_DIGITS_THEN_BYTE_LEVEL + _BYTE_LEVEL_ONLY}')
    tokens, merges = field('tokenizer.ggml.tokens'), field('tokenizer.ggml.merges')
    if not tokens or not merges:
      raise ValueError(f'{path}: GGUF lacks tokenizer.ggml.tokens or tokenizer.ggml.merges')
    types = field('tokenizer.ggml.token_type') or [_NORMAL] * len(tokens)
    merges = [tuple(m.split(' ', 1)) for m in merges]
    tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                          merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_BYTE_LEVEL:
      tok.pre_tokenizer = pre_tokenizers.Sequence(
          [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
      tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # The ids already exist in the vocab, so registering them keeps their ids; registration is
    # what makes "<|im_end|>" in text one token instead of byte-level pieces.
    added = lambda wanted: [tokenizers.AddedToken(t, special=wanted == _CONTROL, normalized=False)
                            for t, ty in zip(tokens, types) if ty == wanted]
    tok.add_special_tokens(added(_CONTROL))
    tok.add_tokens(added(_USER_DEFINED))
    ids = lambda key: None if field(key) is None else int(field(key))
    return cls(tok, ids('tokenizer.ggml.bos_token_id'), ids('tokenizer.ggml.eos_token_id'),
               field('tokenizer.chat_template'))

  @classmethod
  def from_file(cls, tokenizer_json: str) -> 'Tokenizer':
    """From an HF tokenizer.json; BOS/EOS and chat template from sibling files.

    BOS/EOS come from tokenizer_config.json, else config.json's bos/eos_token_id; the template
    from tokenizer_config.json, else chat_template.jinja.
    """
    if not os.path.isfile(tokenizer_json):
      raise FileNotFoundError(f'tokenizer file not found: {tokenizer_json!r}')
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    folder = os.path.dirname(os.path.abspath(tokenizer_json))
    bos = eos = template = None
    config = _read_json(os.path.join(folder, 'tokenizer_config.json'))
    if config is not None:
      bos = _token_id(tok, config.get('bos_token'))
      eos = _token_id(tok, config.get('eos_token'))
      template = config.get('chat_template')
      if isinstance(template, list):  # named templates: [{'name': ..., 'template': ...}]
        template = next((t['template'] for t in template if t.get('name') == 'default'), None)
    jinja = os.path.join(folder, 'chat_template.jinja')  # where transformers>=4.5x saves it
    if template is None and os.path.isfile(jinja):
      with open(jinja) as f:
        template = f.read()
    model_config = _read_json(os.path.join(folder, 'config.json')) or {}
    first = lambda v: v[0] if isinstance(v, list) else v
    bos = bos if bos is not None else first(model_config.get('bos_token_id'))
    eos = eos if eos is not None else first(model_config.get('eos_token_id'))
    return cls(tok, bos, eos, template)


def _read_json(path: str) -> Optional[dict]:
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def _token_id(tok: tokenizers.Tokenizer, token) -> Optional[int]:
  """tokenizer_config.json writes specials as a string or as {'content': ...}."""
  if isinstance(token, dict):
    token = token.get('content')
  return None if token is None else tok.token_to_id(token)


# ---- GGUF metadata -----------------------------------------------------------------------------
# The key-value section at the head of a GGUF file (the spec: github.com/ggml-org/ggml, docs/
# gguf.md), read directly: the gguf package's reader builds a numpy view per string, ~3 s for a
# 49,152-token vocabulary, which every process that tokenizes would pay.
_SCALARS = {0: '<B', 1: '<b', 2: '<H', 3: '<h', 4: '<I', 5: '<i', 6: '<f', 7: '<?', 10: '<Q',
            11: '<q', 12: '<d'}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: str) -> Dict[str, object]:
  """Every metadata key of a GGUF file (v2 or v3) -> its value: a number, a str, or a list
  (numeric arrays as lists of Python numbers, string arrays as lists of str)."""
  with open(path, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    if buf[:4] != b'GGUF':
      raise ValueError(f'{path}: not a GGUF file (magic {bytes(buf[:4])!r})')
    version, _, count = struct.unpack_from('<IQQ', buf, 4)
    if version not in (2, 3):
      raise ValueError(f'{path}: GGUF version {version}; supported: 2, 3')
    pos, out = 24, {}

    def string(at):
      (n,) = struct.unpack_from('<Q', buf, at)
      return buf[at + 8:at + 8 + n].decode('utf-8'), at + 8 + n

    def value(kind, at):
      if kind == _STRING:
        return string(at)
      if kind == _ARRAY:
        item, n = struct.unpack_from('<IQ', buf, at)
        at += 12
        if item in _SCALARS:
          dtype = np.dtype(_SCALARS[item])
          return np.frombuffer(buf, dtype, n, at).tolist(), at + n * dtype.itemsize
        items = []
        for _ in range(n):
          v, at = value(item, at)
          items.append(v)
        return items, at
      if kind not in _SCALARS:
        raise ValueError(f'{path}: unknown GGUF value type {kind}')
      return struct.unpack_from(_SCALARS[kind], buf, at)[0], at + struct.calcsize(_SCALARS[kind])

    for _ in range(count):
      key, pos = string(pos)
      (kind,) = struct.unpack_from('<I', buf, pos)
      out[key], pos = value(kind, pos + 4)
    return out
