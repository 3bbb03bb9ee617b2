"""Where the tests' files are, for tests at any depth under tests/."""

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
ROOT_DIR = TESTS_DIR.parent  # the repository
TEST_DATA_DIR = TESTS_DIR / "data"  # model configs copied from the hub, with their sources
GOLDEN_DIR = TESTS_DIR / "golden"  # expected checkpoint files
