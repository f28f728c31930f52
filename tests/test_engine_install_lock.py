"""One install of the engine plugin at a time into one environment (lab/engine_install._locked): two repros
started together each ran pip --force-reinstall into the same venv, one removing what the other's server was
importing."""

from __future__ import annotations

import threading
import time

import pytest

from wedgectl.lab.engine_install import PluginInstallError, _locked


def test_a_second_install_waits_for_the_first(tmp_path):
    lock = tmp_path / "env.lock"
    order: list[str] = []
    held = threading.Event()

    def first() -> None:
        with _locked(lock, 10):
            order.append("first in")
            held.set()
            time.sleep(0.5)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    assert held.wait(10)
    with _locked(lock, 10):
        order.append("second in")
    t.join(10)
    assert order == ["first in", "first out", "second in"]
    assert (lock.stat().st_mode & 0o777) == 0o600


def test_a_lock_held_past_the_bound_is_one_clear_error(tmp_path):
    lock = tmp_path / "env.lock"
    with _locked(lock, 10):
        t0 = time.monotonic()
        with pytest.raises(PluginInstallError, match="held .* for over 0 s"):
            with _locked(lock, 0.3):
                pass
        assert time.monotonic() - t0 < 5


def test_a_link_planted_at_the_lock_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "env.lock").symlink_to(target)
    with pytest.raises(OSError):
        with _locked(tmp_path / "env.lock", 1):
            pass
    assert target.read_text() == "keep"
