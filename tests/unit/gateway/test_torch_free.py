"""The gateway runs without torch: every gateway module imports, and the served model
(tokenizer and limits) loads, in a process where `import torch` fails."""
from __future__ import annotations

import subprocess
import sys

from tests.support.paths import REPO_ROOT

_SCRIPT = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import gateway
names = [m.name for m in pkgutil.walk_packages(gateway.__path__, "gateway.")]
for name in names:
    importlib.import_module(name)
from gateway.validation import load_served_model
model = load_served_model(None)
assert model.tokenizer.encode("Hello") and model.max_position_embeddings > 0
print("imported", len(names), "modules; torch loaded:", sys.modules.get("torch") is not None)
"""


def test_gateway_imports_and_loads_its_model_without_torch(bundled_model_dir):
    result = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch loaded: False" in result.stdout
