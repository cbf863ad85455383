"""Test setup: Triton kernels run under the interpreter on the CPU (set before any import of
interlace, and inherited by the gloo worker processes the tests spawn); torch.compile's caches
in a folder of this session (inductor's on-disk cache served code compiled against an older
schema of interlace's custom ops after the schema changed)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # (the first process makes it, removes it at exit)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="interlace-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import strict_tensor_descriptors  # noqa: E402
from interlace.kernels import alloc  # noqa: E402

strict_tensor_descriptors()  # (helpers applies it on import too: the gloo workers import it)


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every kernel output starts as NaN / sentinel so unwritten rows fail the comparisons."""
    alloc.poison(True)
    torch.manual_seed(1234)
    yield
    alloc.poison(False)


@pytest.fixture(autouse=True)
def _environment_read_again():
    """Tests that set an ``INTERLACE_*`` variable through monkeypatch call ``env.refresh()``;
    this fixture's teardown runs after monkeypatch's undo and reads the restored values."""
    yield
    from interlace import env

    env.refresh()


@pytest.fixture(autouse=True)
def _own_auto_calibrations():
    """``auto`` layers of one process with equal config, group and options share one calibration
    (``auto_plan.shared_decider``, held weakly); an earlier test's layers, kept alive by reference
    cycles until a collection, must not lend a test their decisions."""
    from interlace.strategies import auto_plan

    auto_plan._SHARED.clear()
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    """Dynamo counts recompilations of one code object (``MoELayer.forward``) over the whole
    process, and a worker runs many files' compiled layers: each test starts from empty caches,
    so no test meets ``recompile_limit`` through its predecessors' compiles."""
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
