"""`python -m tokenwire.model.kernels`: build the CPU kernels now (the Makefile does at install)."""

import logging

from tokenwire.model.kernels import load_kernels

logging.basicConfig(level=logging.INFO, format="%(message)s")
load_kernels()
