"""Fixtures of the train tests."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture()
def small_disk(tmp_path):
    """A real 64 KiB tmpfs (root only)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
