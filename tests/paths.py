"""Paths the tests read, wherever a test file sits under tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
# The test copy of the contract vectors and other fixtures files.
TEST_DATA = TESTS / "data"
# The shared copy of the contract vectors, beside the checkout (preferred when present).
SHARED_CONTRACT = REPO_ROOT.parent / "shared" / "contract"
