#!/usr/bin/env bash
# The test command: install what the tests need, start a throwaway PostgreSQL, run the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k store -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
# shellcheck disable=SC1091
. .venv/bin/activate
# shellcheck disable=SC1091
. scripts/postgres.sh
if start_postgres; then
  export HARNESSRL_TEST_PG_REQUIRED=1   # a server is up: a PostgreSQL test that cannot reach it must fail
else
  echo "WARNING: no PostgreSQL server could be started; PostgreSQL tests will be skipped" >&2
fi
trap stop_postgres EXIT
set +e
pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "pytest collected no tests"; rc=0; fi
exit "$rc"
