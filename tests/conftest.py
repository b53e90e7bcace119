import os
import sys

import torch

# tests import helper modules from tests/ and run spawned ranks that must find them
sys.path.insert(0, os.path.dirname(__file__))
os.environ["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")
torch.set_num_threads(1)
