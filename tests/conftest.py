"""Shared pytest set-up: the repository root on sys.path, one torch thread (tests run beside other work)."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped without one (`pytest -m cuda` runs them)")
