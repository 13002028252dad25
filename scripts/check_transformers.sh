#!/usr/bin/env bash
# Runs hf_paged's parity set (`pytest -m parity`: drop-in generate, the engine, pipeline, returned caches,
# the family sweep's fast part, the private-API list) against one transformers release, in an environment
# of its own beside .venv that reuses everything .venv has (torch included) but transformers.
#
#   scripts/check_transformers.sh 5.26.0        # the next release, one command away
#   scripts/check_transformers.sh oldest        # the oldest supported (what .ci/run checks)
#
# Extra arguments go to pytest. A release outside the declared range is tried with
# HF_PAGED_ALLOW_UNTESTED_TRANSFORMERS=1 (the drop-in patch installs if its internals still match).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/check_transformers.sh VERSION|oldest [pytest args]}
shift
BASE=${VENV:-.venv}
[ -x "$BASE/bin/python" ] || VENV="$BASE" bash scripts/bootstrap.sh
if [ "$VERSION" = oldest ]; then
  VERSION=$("$BASE/bin/python" -c "from hf_paged.transformers_api import SUPPORTED_TRANSFORMERS; print(SUPPORTED_TRANSFORMERS[0])")
fi
ENV_DIR=${CHECK_ENV_DIR:-.venv-transformers-$VERSION}

if [ ! -x "$ENV_DIR/bin/python" ]; then
  "$BASE/bin/python" -m venv "$ENV_DIR"
  # After its own site-packages, the new environment sees .venv's (and the .pth files there, hf_paged's
  # editable install among them): only what this release needs differently is installed below.
  base_site=$("$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  own_site=$("$ENV_DIR/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$(cd "$base_site" && pwd)')" > "$own_site/zz_hf_paged_base_env.pth"
fi
"$ENV_DIR/bin/python" -m pip install --disable-pip-version-check -q "transformers==$VERSION"
got=$("$ENV_DIR/bin/python" -c "import torch, transformers; print(transformers.__version__, torch.__version__)")
echo "check_transformers: transformers ${got% *} with torch ${got#* } ($ENV_DIR)"
[ "${got% *}" = "$VERSION" ] || { echo "check_transformers: expected transformers $VERSION" >&2; exit 1; }
if ! "$ENV_DIR/bin/python" -c "import sys; from hf_paged.transformers_api import is_supported_version as s; sys.exit(not s('$VERSION'))"; then
  export HF_PAGED_ALLOW_UNTESTED_TRANSFORMERS=1
fi
exec "$ENV_DIR/bin/python" -m pytest -m parity -q -p no:cacheprovider "$@"
