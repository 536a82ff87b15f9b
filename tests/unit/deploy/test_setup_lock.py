"""scripts/requirements-py3XX.lock (written by scripts/lock.sh) against what pdserve requires:
scripts/setup.sh installs the lock without resolving, then resolves; a lock that disagrees
would have it install one version and then another, or miss a package."""
from __future__ import annotations

import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.paths import REPO_ROOT

LOCK = REPO_ROOT / "scripts" / f"requirements-py{sys.version_info[0]}{sys.version_info[1]}.lock"
STALE = "run scripts/lock.sh"


@pytest.fixture(scope="module")
def locked() -> dict[str, Version]:
    if not LOCK.exists():
        pytest.skip(f"no lock for this Python ({LOCK.name}): setup.sh resolves instead")
    pins: dict[str, Version] = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{LOCK.name}: {line!r} is not name==version"
            assert canonicalize_name(name) not in pins, f"{LOCK.name} pins {name} twice"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _accepts(requirement: Requirement, version: Version) -> bool:
    return requirement.specifier.contains(version, prereleases=True)


def test_the_lock_satisfies_pyprojects_requirements(locked):
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for raw in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        requirement = Requirement(raw)
        name = canonicalize_name(requirement.name)
        assert name in locked, f"pyproject.toml requires {raw}, which {LOCK.name} does not pin: {STALE}"
        assert _accepts(requirement, locked[name]), f"{LOCK.name} pins {name} {locked[name]}, not {raw}: {STALE}"


def test_the_lock_is_exactly_what_the_installed_packages_require(locked):
    """From pdserve[test] through each installed package's own requirements (markers for
    this machine, extras followed): every package reached is pinned at a version it accepts,
    and the lock pins nothing else."""
    reached: set[str] = set()
    todo = [("pdserve", frozenset({"test"}))]
    seen = set(todo)
    while todo:
        name, extras = todo.pop()
        distribution = metadata.distribution(name)
        if name != "pdserve":
            # The venv holds the locked version (setup.sh installed it): its metadata is the lock's.
            assert Version(distribution.version).public == str(locked[name]), (
                f"{name} {distribution.version} installed, {locked[name]} locked: {STALE}, or scripts/setup.sh")
        for raw in distribution.requires or []:
            requirement = Requirement(raw)
            if requirement.marker is not None and not any(requirement.marker.evaluate({"extra": extra})
                                                          for extra in ("", *extras)):
                continue
            dependency = canonicalize_name(requirement.name)
            assert dependency in locked, f"{name} requires {raw}, which {LOCK.name} does not pin: {STALE}"
            assert _accepts(requirement, locked[dependency]), (
                f"{name} requires {raw}; {LOCK.name} pins {locked[dependency]}: {STALE}")
            reached.add(dependency)
            key = (dependency, frozenset(requirement.extras))
            if key not in seen:
                seen.add(key)
                todo.append(key)
    unreached = sorted(set(locked) - reached)
    assert unreached == [], f"{LOCK.name} pins {unreached}, which nothing requires: {STALE}"
