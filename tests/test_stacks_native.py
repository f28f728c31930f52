"""--native as an operator reads it (recorded bundles of a real TP=2 collective hang, with and without native
frames): the Python frame stays the subject, the native frame above it is added, a bare libc address is never the
answer, and no advice asks for native stacks the capture already took."""

from __future__ import annotations

from pathlib import Path

from wedgectl.classify import classify
from wedgectl.read import stacks as stk
from wedgectl.store.bundle import read_bundle

BUNDLES = Path(__file__).parent / "fixtures" / "bundles"


def _dumps(name: str) -> dict[int, stk.StackDump]:
    b = read_bundle(BUNDLES / name)
    return {d.pid: d for s in b.samples for d in s.stacks if d.threads}


def test_the_python_frame_stays_the_subject_and_the_native_one_is_added():
    native = _dumps("collective-hang-native.tar.gz")
    # the rank held in Python: libc's bare addresses and the lock are inside; the fault's frame is the answer
    assert stk.innermost_interesting(native[8988]) == (
        "activate.<locals>.model_forward_then_hold (wedge_engine/faults/collective.py:105), "
        "in native PyThread_acquire_lock_timed (libpython3.11.so.1.0)")
    # the rank in the shared-memory all-reduce: the compiled graph's frame, and the C++ loop it spins in
    assert stk.innermost_interesting(native[8987]).endswith(", in native get_curr_stamp (shm.cpp:130)")
    # plumbing (read, poll, epoll) is passed over for the library call that says what it waits on
    assert stk.innermost_interesting(native[8603]) == (
        "Poller.poll (zmq/sugar/poll.py:106), in native zmq_poll (libzmq-2f02442c.so.5.2.5)")
    assert not any(stk.innermost_interesting(d).startswith("0x") for d in native.values())
    assert all(stk.has_native(d) for d in native.values())


def test_without_native_frames_nothing_changes():
    plain = _dumps("collective-hang.tar.gz")
    assert not any(stk.has_native(d) for d in plain.values())  # generated code's pseudo-files are not native
    assert all(", in native " not in (stk.innermost_interesting(d) or "") for d in plain.values())


def test_the_advice_asks_for_native_stacks_only_when_the_capture_had_none():
    def asks(name: str) -> bool:
        return any("--native" in a for a in classify(read_bundle(BUNDLES / name)).advice)

    assert asks("collective-hang.tar.gz") and asks("engine-deadlock.tar.gz")
    assert not asks("collective-hang-native.tar.gz")
    v = classify(read_bundle(BUNDLES / "collective-hang-native.tar.gz"))
    assert v.advice[0].startswith("Read the ranks' native frames above: a lagging rank in cudaStreamSynchronize")
