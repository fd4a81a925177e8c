"""A spawned child's target that imports nothing heavy (tests/test_memory_release.py): were it defined in a test
module, the child would import that module, torch and all, to unpickle it (~3 s a spawn)."""
from __future__ import annotations


def echo(rx, tx) -> None:
    """One batch back, then end of file."""
    tx.send(rx.recv(30))
    tx.close()
