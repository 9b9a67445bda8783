"""User errors end an entry point with one message and status 2: rank 0 prints it, tracebacks only on request."""

from __future__ import annotations

import pytest

from rapidtrain.core.errors import UserError, user_errors


@user_errors("tool")
def main(argv=None):
    raise UserError("--flag x: no such file; give an existing one")


def test_message_without_traceback_and_status_2(capsys, monkeypatch):
    monkeypatch.delenv("RAPIDTRAIN_DEBUG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as raised:
        main([])
    assert raised.value.code == 2 and isinstance(raised.value.__cause__, UserError)
    assert capsys.readouterr().err == "tool: error: --flag x: no such file; give an existing one\n"


def test_only_rank_0_prints(capsys, monkeypatch):
    monkeypatch.delenv("RAPIDTRAIN_DEBUG", raising=False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        main([])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["env", "flag"])
def test_debug_shows_the_traceback_too(capsys, monkeypatch, how):
    monkeypatch.delenv("RANK", raising=False)
    argv = []
    if how == "env":
        monkeypatch.setenv("RAPIDTRAIN_DEBUG", "1")
    else:
        monkeypatch.delenv("RAPIDTRAIN_DEBUG", raising=False)
        argv = ["--debug"]
    with pytest.raises(SystemExit) as raised:
        main(argv)
    err = capsys.readouterr().err
    assert raised.value.code == 2
    assert err.startswith("Traceback (most recent call last):") and err.endswith("give an existing one\n")


def test_other_exceptions_pass_through():
    @user_errors()
    def broken(argv=None):
        raise KeyError("a bug, not a user error")

    with pytest.raises(KeyError):
        broken([])
