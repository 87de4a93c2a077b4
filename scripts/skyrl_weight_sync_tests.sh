#!/usr/bin/env bash
# SkyRL's own CPU weight-sync tests (skyrl-train 0.3.1, tests/cpu/weight_sync/, 40 tests) run
# against weightsync.compat.skyrl, outside this checkout: the test files are taken from SkyRL's
# repository at the commit that released 0.3.1 (they are not in its PyPI packages), their
# imports rewritten from skyrl_train to weightsync.compat.skyrl, and pytest run on them in a
# temp dir with skyrl-train's one test dependency (pytest-asyncio). skyrl-train is not installed.
#
#   bash scripts/skyrl_weight_sync_tests.sh            from the root of a weightsync checkout
#   SKYRL_GIT=/path/to/SkyRL bash scripts/skyrl_weight_sync_tests.sh   from a clone of SkyRL
#
# Needs network access to GitHub (or SKYRL_GIT) and PyPI. Nothing is written to the checkout.
set -euo pipefail

REPO=${SKYRL_GIT:-https://github.com/NovaSky-AI/SkyRL}
SHA=ce6def0e8f996eb823de4f10d1c0d1528c9a2f6b  # "Bump skyrl-train to 0.3.1 (#826)"
WS=$(pwd)
T=$(mktemp -d)

git clone -q --bare --filter=blob:none "$REPO" "$T/skyrl.git"
for f in test_transfer_strategies test_weight_chunk test_weight_extractor_utils \
         test_remote_weight_loader; do
  git --git-dir "$T/skyrl.git" show "$SHA:skyrl-train/tests/cpu/weight_sync/$f.py" > "$T/$f.py"
done
sed -i -E 's/skyrl_train\.(weight_sync(\.[a-z_]+)?|config\.utils|inference_engines\.remote_inference_engine)/weightsync.compat.skyrl/g' \
  "$T"/test_*.py
python -m pip install -q --target "$T/deps" pytest-asyncio
cd "$T"
PYTHONPATH="$WS:$T/deps" python -m pytest -q -p no:cacheprovider .
