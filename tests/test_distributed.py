"""ringattn.distributed: bad settings give errors naming them, before any process group exists."""

import re

import pytest

from ringattn.distributed import MULTICAST_OFF, init_distributed
from ringattn.parallel.comm import GROUP_TIMEOUT_ENV, P2P_TIMEOUT_ENV, p2p_timeout_s

BAD_SECONDS = [
    ("abc", "must be a number of seconds from 0.001 to 1e+09, got 'abc'"),
    ("nan", "must be a number of seconds from 0.001 to 1e+09, got nan"),
    ("-5", "must be a number of seconds from 0.001 to 1e+09, got -5.0"),
    # in range as floats, but gloo's milliseconds make the first 0 (at once) and torch's int64 nanoseconds overflow
    # with the second: every wait failed at once
    ("1e-4", "must be a number of seconds from 0.001 to 1e+09, got 0.0001"),
    ("1e10", "must be a number of seconds from 0.001 to 1e+09, got 10000000000.0"),
]


@pytest.fixture
def torchrun_env(monkeypatch):
    """A rank's environment as torchrun sets it; init_distributed's own writes are undone after the test."""
    for name, value in dict(MULTICAST_OFF, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(P2P_TIMEOUT_ENV, raising=False)
    return monkeypatch


@pytest.mark.parametrize("value,message", BAD_SECONDS, ids=[v for v, _ in BAD_SECONDS])
def test_timeouts_that_are_not_positive_seconds_raise_naming_the_variable(torchrun_env, value, message):
    """Regression: init_distributed read RINGATTN_TIMEOUT with float(): "abc" and "nan" gave Python's conversion
    errors, naming no variable, and -5 was accepted, the process group then timing out at -5000 ms; 1e-4 and 1e10
    were accepted, and failed in the process group's setup (1e10 in every ring wait)."""
    torchrun_env.setenv(GROUP_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=re.escape(f"${GROUP_TIMEOUT_ENV} {message}")):
        init_distributed("gloo")
    torchrun_env.delenv(GROUP_TIMEOUT_ENV)
    torchrun_env.setenv(P2P_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=re.escape(f"${P2P_TIMEOUT_ENV} {message}")):
        p2p_timeout_s()


def test_bad_timeout_argument_and_local_rank_raise_naming_them(torchrun_env):
    """Regression: a timeout_s of -5 reached the process group; LOCAL_RANK="abc" gave int()'s message alone."""
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds from 0.001 to 1e[+]09, got -5"):
        init_distributed("gloo", timeout_s=-5)
    torchrun_env.setenv("LOCAL_RANK", "abc")
    with pytest.raises(ValueError, match="LOCAL_RANK must be this process's rank on its node, an int >= 0, got 'abc'"):
        init_distributed("gloo")
    torchrun_env.setenv("LOCAL_RANK", "0")
    for rank, world in (("abc", "2"), ("2", "2"), ("0", "")):  # regression: int()'s message, or a socket timeout
        torchrun_env.setenv("RANK", rank)
        torchrun_env.setenv("WORLD_SIZE", world)
        with pytest.raises(ValueError, match="RANK and WORLD_SIZE must be ints with 0 <= RANK < WORLD_SIZE"):
            init_distributed("gloo")


def test_a_leftover_world_size_without_rank_is_refused(monkeypatch):
    """Regression: WORLD_SIZE=2 left in the environment without RANK (a plain run) was overwritten with 1, a group of
    one, while the script had read 2 ranks from it (launch/ring_check.py then failed in the ring)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE is '2' but RANK is not set: launch the ranks with torchrun"):
        init_distributed("gloo")
