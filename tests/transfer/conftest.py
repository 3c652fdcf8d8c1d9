import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # peer.py

from peer import Peer  # noqa: E402


@pytest.fixture
def peers():
    """Make Peer processes; all are killed when the test ends."""
    made = []

    def make(*args, **kwargs):
        made.append(Peer(*args, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.kill()
