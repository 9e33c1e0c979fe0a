"""The copier orders its CUDA copies against the stream the caller computes on *now*, not
the one current when the copier was made (the compiled back-end's copier lives for the
process; a loop may enter ``torch.cuda.stream`` inside an ``offload`` block). Checked on
the CPU with stand-ins for torch.cuda's streams and events that log what waits on what."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tierflow.runtime.streams import Copier


class _Event:
    def __init__(self) -> None:
        self.on: _Stream | None = None

    def record(self, stream: _Stream) -> None:
        self.on = stream


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_for: list[_Event] = []

    def wait_event(self, event: _Event) -> None:
        self.waited_for.append(event)


class _Side:
    """Either side of a copy, as ``Copier.copy`` uses it: copied into, its stream marked."""

    def __init__(self) -> None:
        self.copied = 0
        self.used_on: list[_Stream] = []

    def copy_(self, src, non_blocking: bool = False) -> None:
        self.copied += 1

    def record_stream(self, stream: _Stream) -> None:
        self.used_on.append(stream)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream calls replaced; ``state["current"]`` is the caller's stream."""
    made = iter(["outward", "inward"])
    state = {"current": _Stream("made-on")}

    @contextmanager
    def stream(s: _Stream):
        before, state["current"] = state["current"], s
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream(next(made)))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return state


def test_a_copy_back_waits_for_the_stream_current_at_the_call(fake_cuda):
    copier = Copier(torch.device("cuda", 0))
    later = fake_cuda["current"] = _Stream("user")
    dst = _Side()
    done = copier.copy(dst, _Side(), dst)
    assert dst.copied == 1 and dst.used_on == [copier.inward]
    assert [e.on for e in copier.inward.waited_for] == [later]  # not the stream at construction
    assert done.on is copier.inward


def test_a_wait_holds_the_stream_current_at_the_call(fake_cuda):
    copier = Copier(torch.device("cuda", 0))
    first = fake_cuda["current"]
    later = fake_cuda["current"] = _Stream("user")
    src = _Side()
    done = copier.copy(_Side(), src, src)  # a copy out: on the outward stream
    copier.wait(done)
    assert later.waited_for == [done] and first.waited_for == []
