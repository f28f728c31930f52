"""collect.processes.accelerator_devices on a recorded-shape /proc tree (fd symlinks), and on this process."""

from __future__ import annotations

import os

import psutil

from wedgectl.collect.processes import accelerator_devices, sample_process
from wedgectl.model.types import Role


def test_devices_from_fd_links(tmp_path):
    fd = tmp_path / "42" / "fd"
    fd.mkdir(parents=True)
    for n, target in enumerate(["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/null", "socket:[123]",
                                "/dev/dri/renderD128", "/tmp/x", "/dev/nvidia0"]):
        os.symlink(target, fd / str(n))
    assert accelerator_devices(42, tmp_path) == ("/dev/dri/renderD128", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl")


def test_no_devices_and_unreadable_are_empty(tmp_path):
    assert accelerator_devices(7, tmp_path) == ()  # no such pid under this root
    assert accelerator_devices(os.getpid()) == ()  # a CPU test process holds none


def test_a_real_sample_carries_start_time_and_devices():
    me = psutil.Process()
    sample, _ = sample_process(me, Role.OTHER, with_threads=False)
    assert sample.started == me.create_time() and sample.devices == ()
