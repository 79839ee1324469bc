#!/usr/bin/env bash
# Mutation-test some of the core in a private copy of the working tree, so that several
# runs (and edits to the tree) do not share mutmut's `mutants/` directory.
#   tools/mutation/area.sh <scratch-name> <source glob>... [-- <test path>...]
# e.g. tools/mutation/area.sh machine src/epp/extproc/machine.py -- tests/extproc
# Prints the scores for those files and the survivors; `cd /tmp/mutation/<name> &&
# <repo>/.venv/bin/mutmut show <mutant>` prints one mutant's diff.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
name=$1; shift
globs=(); tests=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; tests=("$@"); break; fi
  globs+=("$1"); shift
done
work=/tmp/mutation/$name
rm -rf "$work"; mkdir -p "$work"
tar -C "$repo" --exclude=./.venv --exclude=./.git --exclude=./mutants --exclude=./.bench \
  --exclude=./.hypothesis --exclude=./.fuzz --exclude=__pycache__ -cf - . | tar -C "$work" -xf -
"$repo/.venv/bin/python" - "$work/pyproject.toml" "${#globs[@]}" "${globs[@]}" "${tests[@]}" <<'PY'
import json, re, sys
path, n = sys.argv[1], int(sys.argv[2])
globs, tests = sys.argv[3:3 + n], sys.argv[3 + n:]
text = open(path).read()
text = re.sub(r"only_mutate = \[.*?\]\n", f"only_mutate = {json.dumps(globs)}\n", text, flags=re.S)
if tests:
    selection = ["-m", "not e2e", "-p", "no:cacheprovider", *tests]
    text = re.sub(r"pytest_add_cli_args_test_selection = \[.*?\]\n",
                  f"pytest_add_cli_args_test_selection = {json.dumps(selection)}\n", text, flags=re.S)
open(path, "w").write(text)
PY
cd "$work"
"$repo/.venv/bin/mutmut" run --max-children "${MUTATE_CHILDREN:-1}" >"$work/mutmut.log" 2>&1 || {
  tail -40 "$work/mutmut.log"; exit 1; }
"$repo/.venv/bin/python" tools/mutation/scores.py --survivors || true
