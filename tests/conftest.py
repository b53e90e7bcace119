import atexit
import os
import shutil
import sys
import tempfile

import torch

# tests import helper modules from tests/ and run spawned ranks that must find them
sys.path.insert(0, os.path.dirname(__file__))
os.environ["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")
torch.set_num_threads(1)
# the planner's traces kept on disk (gems/plan/store.py): shared by this session's runs, never by another's
if "GEMS_CACHE_DIR" not in os.environ:
    os.environ["GEMS_CACHE_DIR"] = tempfile.mkdtemp(prefix="gems-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GEMS_CACHE_DIR"], True)
