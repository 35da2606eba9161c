"""Planted device-check sections for tests/test_device_check.py: one that succeeds, one that
raises, one that never ends."""

import time


def fine(quick, out):
    return {"quick": quick, "out": out}


def broken(quick, out):
    raise RuntimeError("planted failure")


def hangs(quick, out):
    time.sleep(600)
