"""Several command lines of one entry point, as `python -m MODULE ARGS...` runs each, for the
price of one interpreter start: this script imports what MODULE imports (its top-level import
statements, read from its source: jax and the library, ~1.3 s of CPU) once, then forks a child
per command line, which runs MODULE as __main__ with that sys.argv and its stdout and stderr
going to files of its own. Its exit status is the command's.

  python tests/forked_cli.py MODULE OUT_DIR ARGV_JSON
    ARGV_JSON: a JSON list of argument lists. Writes OUT_DIR/<i>.out, <i>.err for command i and
    prints the JSON list of exit statuses.

What the parent imported is what a real run has imported by the time its main() starts (the
module's own imports, nothing else: MODULE itself runs only in the children, so its flags are
defined there, by __main__, as they are under -m). The parent starts no JAX backend, so a
child that started one would log it on its own stderr, as a real run would.
"""
import ast
import importlib.util
import json
import os
import runpy
import sys
import traceback


def import_what_it_imports(module: str) -> None:
  """Runs the top-level import statements of `module`'s source (not the module itself)."""
  path = importlib.util.find_spec(module).origin
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
  exec(compile(ast.Module(body=imports, type_ignores=[]), path, 'exec'), {})  # pylint: disable=exec-used


def run_forked(module: str, argv: list, out_prefix: str) -> int:
  """`python -m module *argv` in a fork of this process -> its exit status."""
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
  code = 1
  try:  # the child: never returns into the parent's loop
    for fd, suffix in ((1, '.out'), (2, '.err')):
      os.dup2(os.open(out_prefix + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [module, *argv]  # run_module sets argv[0] to the module's file, as -m does
    runpy.run_module(module, run_name='__main__', alter_sys=True)
    code = 0
  except SystemExit as e:  # sys.exit(n), as the interpreter would report it
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


def main(module: str, out_dir: str, argv_json: str) -> None:
  sys.path[0] = os.getcwd()  # as under -m: the working directory, not this script's
  import_what_it_imports(module)
  codes = [run_forked(module, argv, os.path.join(out_dir, str(i)))
           for i, argv in enumerate(json.loads(argv_json))]
  print(json.dumps(codes))


if __name__ == '__main__':
  main(*sys.argv[1:])
