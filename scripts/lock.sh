#!/usr/bin/env bash
# Write scripts/requirements-py3XX.lock for the venv's Python: every package that
# `pip install -e '.[test]'` installs, pinned (name==version, so pip still takes each from
# the machine's configured index or find-links: the CPU torch stays local). scripts/setup.sh
# installs the lock first without resolving, then resolves once (a no-op when the lock is
# current). Run after changing a dependency in pyproject.toml; tests/unit/deploy/
# test_setup_lock.py fails until then.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
version=$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
report=$(mktemp)
trap 'rm -f "$report"' EXIT
# --ignore-installed: resolved as for an empty venv, whatever this one holds.
.venv/bin/pip install -q --disable-pip-version-check --dry-run --ignore-installed --report "$report" -e '.[test]'
.venv/bin/python - "$report" "scripts/requirements-py$version.lock" <<'PY'
import json
import platform
import sys

report_path, lock_path = sys.argv[1:]
with open(report_path) as f:
    report = json.load(f)
# The version without its local label (2.13.0, not 2.13.0+cpu): pyproject.toml's own pin,
# which each machine resolves to its build (the CPU one from its find-links).
pins = [(item["metadata"]["name"], item["metadata"]["version"].split("+")[0]) for item in report["install"]
        if not item.get("download_info", {}).get("dir_info", {}).get("editable")]
with open(lock_path, "w") as f:
    f.write(f"# Every package of `pip install -e '.[test]'` on Python {platform.python_version()}, "
            f"{platform.machine()} Linux,\n# pinned by scripts/lock.sh; scripts/setup.sh installs it "
            f"first, without resolving.\n")
    f.writelines(f"{name}=={version}\n" for name, version in sorted(pins, key=lambda p: p[0].lower()))
print(f"wrote {lock_path}: {len(pins)} packages")
PY
