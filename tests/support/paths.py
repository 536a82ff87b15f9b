"""Where tests find the repository's own files, wherever the test file sits."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
