import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

# tests import helper modules from tests/ and run spawned ranks that must find them
sys.path.insert(0, os.path.dirname(__file__))
os.environ["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")
torch.set_num_threads(1)
# the planner's traces kept on disk (gems/plan/store.py): shared by this session's runs, never by another's
if "GEMS_CACHE_DIR" not in os.environ:
    os.environ["GEMS_CACHE_DIR"] = tempfile.mkdtemp(prefix="gems-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GEMS_CACHE_DIR"], True)


def pytest_collection_modifyitems(config, items):
    """scripts/test.sh runs the suite on two workers (pytest-xdist, --dist loadgroup): every test that submits to
    the Slurm test cluster runs on one of them, one at a time, as the queue, the cancels and the four nodes are
    shared. Tests marked ``both_cores`` (a rank with two threads) run one at a time too, on one worker: two of
    them at once on this 2-core machine once ran each step three times slower, past the stall timeout. The rest
    spread over both."""
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.get_closest_marker("both_cores") is not None:
            item.add_marker(pytest.mark.xdist_group("both_cores"))


@pytest.fixture(autouse=True)
def _gems_environment_kept():
    """gems's own variables (GEMS_*) as they were before each test, whatever it set: a run launched by a later test
    hands the process's environment to its ranks, so a variable one test left (the CUDA graphs' stand-in, a comm log)
    would change what the next test's runs do, and the suite's result would hang on its order."""
    before = {k: v for k, v in os.environ.items() if k.startswith("GEMS_")}
    yield
    for k in [k for k in os.environ if k.startswith("GEMS_") and k not in before]:
        del os.environ[k]
    os.environ.update(before)
