#!/usr/bin/env bash
# Run moe-stack from source with whatever python3 and torch the machine has (no uv,
# no install): puts every workspace package's src/ on PYTHONPATH.
#
#   tools/from_source.sh python3 -m pretrain            # run a command with the path set
#   source tools/from_source.sh                          # or set it in this shell
#   tools/from_source.sh python3 -m pytest -p moe_testing.pytest_plugin -m gpu
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for src in "$root"/packages/*/src "$root"/apps/*/src; do
  PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
done
export PYTHONPATH
if [ "${BASH_SOURCE[0]}" = "$0" ] && [ $# -gt 0 ]; then
  exec "$@"
fi
