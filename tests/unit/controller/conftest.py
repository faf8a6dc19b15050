"""Fixtures the controller's Ray tests share."""

import asyncio

import pytest


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module: its Ray backend's actors answer coroutines run on it across the tests."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
