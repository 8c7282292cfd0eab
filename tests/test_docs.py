"""The README and docs/*.md cite only what exists: every repo path, every `python -m` module, every
`tests/...py::test_name`, every `config.py:variant` and every relative link. Plain text parsing,
no imports of the library.

What counts as a citation, inside `backticks` or a fenced code block (split at spaces, `=`, `,`,
brackets and quotes):
  - a path whose first folder is one of REPO_DIRS, or a pagedjax subpackage (`host/x.py` is
    read as pagedjax/host/x.py, the README's layout table writes them so);
  - a bare file name with a source extension (`allocator.py`, `setup.py`): some file of that
    name exists in the repo;
  - `FILE:NAME` (a config variant such as `configs/default.py:tiny`, or a function): NAME
    occurs in FILE as a word;
  - `FILE::test_name`, and a bare `::test_name` after one on the same line: FILE defines it;
  - the module after `-m` when it is one of this repo's packages;
  - markdown links `[text](target)` that are not URLs, relative to the page.
Outputs are not citations: paths under runs/, ~/, /, $VARS, WORKDIR/, DIR/ and URLs are skipped,
as are bare output names (`summary.json`, `table.md`).
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))
REPO_DIRS = ('pagedjax', 'kernels', 'experiments', 'configs', 'tests', 'docs', '.ci')
PAGEDJAX_SUBPACKAGES = ('host', 'device', 'model', 'sim', 'cluster', 'studies')
SOURCE_EXTENSIONS = ('.py', '.sh', '.txt', '.ini', '.toml', '.cfg')
OUTPUT_PREFIXES = ('runs/', '~', '/', '$', 'WORKDIR', 'DIR/', 'http:', 'https:')
MODULE_PACKAGES = ('pagedjax', 'kernels', 'experiments', 'configs', 'tests')
SPLIT = re.compile(r"[\s=,()\[\]{}\"'|<>`]+")
PATHLIKE = re.compile(r'[\w.\-/]+(::?[\w]*)?')


def repo_files():
  files = {p.relative_to(ROOT) for p in ROOT.iterdir() if p.is_file()}
  for top in REPO_DIRS:
    files |= {p.relative_to(ROOT) for p in (ROOT / top).rglob('*')
              if p.is_file() and '__pycache__' not in p.parts}
  return files


FILES = repo_files()
NAMES = {p.name for p in FILES}


def spans(text):
  """(line number, text) of every inline code span (which may wrap onto the next line) and of
  every line of a fenced block."""
  fenced, prose = False, []
  for number, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith('```'):
      fenced = not fenced
      prose.append('')
    elif fenced:
      prose.append('')
      yield number, line
    else:
      prose.append(line)
  prose = '\n'.join(prose)
  for match in re.finditer(r'`([^`]+)`', prose):
    yield prose.count('\n', 0, match.start()) + 1, match.group(1).replace('\n', ' ')


def resolve(path):
  """The repo file or folder a cited path names, or None."""
  path = path.rstrip('/')
  if '/' not in path:
    if path.endswith(SOURCE_EXTENSIONS) and path in NAMES:
      return next(ROOT / p for p in sorted(FILES) if p.name == path)
    return (ROOT / path) if (ROOT / path).exists() else None
  for base in (ROOT, ROOT / 'pagedjax', ROOT / 'tests'):
    if (base / path).exists():
      return base / path
  return None


def is_citation(token):
  if token.startswith(OUTPUT_PREFIXES) or '://' in token or not PATHLIKE.fullmatch(token):
    return False
  path = token.split(':', 1)[0]
  if '/' in path:
    return path.split('/', 1)[0] in REPO_DIRS + PAGEDJAX_SUBPACKAGES
  stem, dot, extension = path.rpartition('.')
  return bool(stem) and (('.' + extension) in SOURCE_EXTENSIONS or
                         (extension == 'md' and stem.isupper()))


def defines(path, name):
  return re.search(rf'^\s*(async\s+)?(def|class)\s+{re.escape(name)}\b', path.read_text(), re.M)


def problems_in(page):
  text = page.read_text()
  where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
  found = []
  last_file = {}  # line number -> the test file a bare ::name refers to
  for number, span in spans(text):
    tokens = [t.rstrip('.,;*') if t.startswith('::') else t.rstrip('.,;:*').lstrip('*')
              for t in SPLIT.split(span)]
    tokens = [t for t in tokens if t]
    for i, token in enumerate(tokens):
      if token == '-m' and i + 1 < len(tokens):
        module = tokens[i + 1]
        if module.split('.')[0] in MODULE_PACKAGES:
          base = ROOT / module.replace('.', '/')
          if not (base.with_suffix('.py').is_file() or (base / '__init__.py').is_file()):
            found.append(f'{where}:{number}: module {module} does not exist')
        continue
      if token.startswith('::'):
        name = token[2:]
        if number not in last_file:
          found.append(f'{where}:{number}: {token} follows no test file on its line')
        elif not defines(last_file[number], name):
          found.append(f'{where}:{number}: {last_file[number].name} has no {name}')
        continue
      if not is_citation(token):
        continue
      path, _, name = token.partition('::') if '::' in token else token.partition(':')
      target = resolve(path)
      if target is None:
        found.append(f'{where}:{number}: {path} does not exist')
        continue
      if '::' in token:
        last_file[number] = target
        if not defines(target, name):
          found.append(f'{where}:{number}: {path} has no {name}')
      elif name and target.is_file() and not re.search(rf'\b{re.escape(name)}\b',
                                                       target.read_text()):
        found.append(f'{where}:{number}: {path} has no {name!r} (cited as {token})')
  for number, line in enumerate(text.splitlines(), 1):
    for target in re.findall(r'\]\(([^)\s]+)\)', line):
      if target.startswith(('http:', 'https:', 'mailto:', '#')):
        continue
      if not (page.parent / target.split('#')[0]).exists():
        found.append(f'{where}:{number}: link {target} does not exist')
  return found


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_test_and_link_exists(page):
  assert problems_in(page) == []


def test_the_checker_catches_what_it_is_for(tmp_path):
  page = tmp_path / 'page.md'
  page.write_text('\n'.join([
      '`pagedjax/sharding.py` `host/no_such.py` `missing_module.py` `DESIGN.md`',
      '`python -m experiments.no_such --workdir=runs/x` `configs/default.py:no_such_variant`',
      '| `test_progress.py::test_no_such_test`, `::test_every_accepted_request_finishes` |',
      '`::test_orphan` [a link](no_such.md)',
      # all of these exist or are outputs, and must pass:
      '`pagedjax/model/sharding.py` `host/requests/intake.py` `allocator.py` `configs/default.py:tiny`',
      '`python -m experiments.decode --config=configs/default.py --workdir=runs/default`',
      '`summary.json` `table.md` `~/.cache/pagedjax` `$OUT` `file:///dir/` `runs/a/b.csv`',
      '`tests/test_docs.py::test_the_checker_catches_what_it_is_for` [readme](' +
      str(ROOT / 'README.md') + ')',
  ]))
  problems = problems_in(page)
  assert [p.split(': ', 1)[1] for p in problems] == [
      'pagedjax/sharding.py does not exist', 'host/no_such.py does not exist',
      'missing_module.py does not exist', 'DESIGN.md does not exist',
      'module experiments.no_such does not exist',
      "configs/default.py has no 'no_such_variant' (cited as configs/default.py:no_such_variant)",
      'test_progress.py has no test_no_such_test',
      '::test_orphan follows no test file on its line', 'link no_such.md does not exist']


# Pages read as findings with their commands, not as a work log.
DIARY = re.compile(r'(?i:\bissues? \d+|\b(this|previous|last) session|changes made for|tried and not '
                   r'kept)|\b[Rr]uns? [A-Z]( and [A-Z])?\b(?![\w-])')


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_read_as_findings_not_as_a_log(page):
  hits = [f'{number}: {line.strip()}' for number, line in
          enumerate(page.read_text().splitlines(), 1) if DIARY.search(line)]
  assert hits == []


def test_the_log_pattern_catches_what_it_is_for():
  for line in ('decode speed (issue 14)', "the previous session's figure", 'Run C, the current code',
               'runs A and B', 'Changes made for this issue', 'Tried and not kept:'):
    assert DIARY.search(line), line
  for line in ('to run a smoke run', 'Part A runs the engine', 'session_id',
               'Run the same command on every host', 'in a same-process A/B'):
    assert not DIARY.search(line), line


def test_every_docs_page_is_reachable_from_the_readme():
  seen, todo = set(), [ROOT / 'README.md']
  while todo:
    page = todo.pop()
    for target in re.findall(r'\]\(([^)\s#]+)(?:#[^)]*)?\)', page.read_text()):
      path = (page.parent / target).resolve()
      if path.suffix == '.md' and path.is_file() and path not in seen:
        seen.add(path)
        todo.append(path)
  assert sorted(p.name for p in PAGES[1:] if p.resolve() not in seen) == []


# Docstrings and comments of the code cite files too (`see pagedjax/model/llama.py`): a cited
# path that a move left behind is a dead end for a reader.
SOURCE_CITATION = re.compile(r'(?<![\w/.{])((?:pagedjax|kernels|experiments|configs|tests|docs|host|'
                             r'device|model|sim|cluster|studies)/[\w/]+\.(?:py|md|cc|inc|sh))')
EXAMPLES = ('configs/NAME.py', 'host/x.py', 'pagedjax/host/x.py')  # placeholders, not citations


def _exists(cited: str, source: pathlib.Path) -> bool:
  bases = (ROOT, ROOT / 'pagedjax', ROOT / 'pagedjax' / 'host', source.parent)
  return cited in EXAMPLES or any((base / cited).exists() for base in bases)


def test_source_files_cite_only_existing_paths():
  missing = []
  for top in ('pagedjax', 'kernels', 'experiments', 'configs'):
    for path in sorted((ROOT / top).rglob('*.py')):
      if '__pycache__' in path.parts:
        continue
      for number, line in enumerate(path.read_text().splitlines(), 1):
        missing += [f'{path.relative_to(ROOT)}:{number}: {cited}'
                    for cited in SOURCE_CITATION.findall(line) if not _exists(cited, path)]
  assert missing == []
