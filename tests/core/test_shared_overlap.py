"""interlace.shared_overlap's stream protocol, with stand-in streams and tensors (no GPU here):
the side stream waits for the current one before the branch, the branch runs inside the side
stream's context, its inputs are recorded on the side stream, and the join makes the current
stream wait and records the output on it. The math on a CPU is tested in test_routing_families."""

import contextlib

import torch

from interlace import shared_overlap


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


class FakeTensor:
    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, name, log):
        self.name, self.log = name, log

    def record_stream(self, stream):
        self.log.append(f"{self.name} recorded on {stream.name}")


def test_fork_and_join_order(monkeypatch):
    log = []
    main, side = FakeStream("main", log), FakeStream("side", log)
    active = [main]

    @contextlib.contextmanager
    def use(stream):
        active.append(stream)
        log.append(f"enter {stream.name}")
        yield
        active.pop()
        log.append(f"exit {stream.name}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: active[-1])
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(shared_overlap, "_SIDE_STREAMS", {0: side})

    def branch(x):
        log.append(f"branch on {active[-1].name}")
        return FakeTensor("y", log)

    x = FakeTensor("x", log)
    started = shared_overlap.start(branch, x)
    assert started.overlapped
    log.append("routed experts")
    y = started.join()
    assert y.name == "y" and not started.overlapped
    assert log == ["side waits main", "enter side", "branch on side", "exit side", "x recorded on side",
                   "routed experts", "main waits side", "y recorded on main"]
    # Turned off (or on a CPU): the branch runs at once on the current stream, nothing recorded.
    log.clear()
    assert not shared_overlap.start(branch, x, overlap=False).overlapped
    assert log == ["branch on main"]
