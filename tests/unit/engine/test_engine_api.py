"""The engine's declared interface (treadle/engine/protocol.py): the single-process `Engine` and
a worker group's `GroupExecutor` both satisfy `EngineAPI`, call for call; the executor runs on
every rank exactly the calls `EngineAPI` marks `changes_adapter`, and the rest on rank 0 alone.
(The import rules of the engine's rooms are in tests/unit/test_architecture.py.)"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from treadle.engine import Engine, EngineAPI, GroupExecutor
from treadle.engine.protocol import adapter_calls

# Calls of the group itself or of its sampling (a batch every rank decodes: `decoding`), which
# neither mirror a call nor run it on rank 0 alone.
GROUP_CALLS = {
    "open_batch",
    "sample_batch",
    "samples_beside_training",  # never: a group's ranks decode between its training calls
    "topology",
    "rank_memory",
    "ping",
    "close",
}


def _calls(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def _shape(signature: inspect.Signature) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


@pytest.mark.parametrize("implementation", [Engine, GroupExecutor])
def test_both_engines_answer_every_call_of_the_interface_alike(implementation: type) -> None:
    """Each `EngineAPI` call is a method of the implementation with the same parameters (names,
    kinds, defaults), and its attributes are set: a worker can hold either."""
    theirs = _calls(implementation)
    missing = sorted(set(_calls(EngineAPI)) - set(theirs))
    assert missing == []
    for name, signature in _calls(EngineAPI).items():
        assert _shape(theirs[name]) == _shape(signature), name


def test_the_marker_names_the_calls_that_change_an_adapter() -> None:
    assert adapter_calls() == {
        "create_adapter",
        "drop_adapter",
        "set_adapter_weights",
        "forward_backward",
        "optim_step",
        "snapshot",
        "drop_snapshot",
        "import_adapter",
        "load_snapshot",
    }


class _Recorder:
    """Rank 0's own engine as the executor sees it: records each call it is asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.asked.append(name)


class _Executor(GroupExecutor):
    """The executor with its sending (a broadcast, then the call on every rank) replaced by a
    record of the calls it sends; which calls it sends is the real executor's choice."""

    def __init__(self) -> None:
        self.engine = _Recorder()  # type: ignore[assignment]
        self.sent: list[str] = []

    def _send(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.sent.append(name)


def test_the_executor_mirrors_exactly_the_marked_calls() -> None:
    """Every call of `EngineAPI` but the group's own: the marked ones are sent to every rank,
    the others run on rank 0's engine alone."""
    executor = _Executor()
    for name, signature in _calls(EngineAPI).items():
        if name in GROUP_CALLS:
            continue
        args = [
            None
            for p in list(signature.parameters.values())[1:]
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
        ]
        kwargs = {
            p.name: None
            for p in signature.parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.default is p.empty
        }
        getattr(executor, name)(*args, **kwargs)
    marked = adapter_calls()
    assert sorted(executor.sent) == sorted(marked)
    assert set(executor.engine.asked) == set(_calls(EngineAPI)) - marked - GROUP_CALLS  # type: ignore[attr-defined]


def test_a_call_the_interface_does_not_mark_is_never_sent() -> None:
    executor = _Executor()
    with pytest.raises(AssertionError, match="export_adapter is not marked changes_adapter"):
        executor._mirror("export_adapter", "a")
    assert executor.sent == []


def test_the_facade_names_each_of_its_names_once_and_each_loads() -> None:
    """treadle.engine's `__all__` and its lazy table name the same names, and each loads from
    the module the table gives."""
    import treadle.engine as facade

    assert sorted(facade.__all__) == sorted(facade._WHERE)
    for name in facade.__all__:
        assert getattr(facade, name) is not None, name


def test_the_calls_that_set_weights_are_marked_and_compared_across_ranks() -> None:
    """After these every rank's weight hash is compared (`executor.SETS_WEIGHTS`): the marker
    names them, and each is mirrored."""
    from treadle.engine.distributed.executor import SETS_WEIGHTS
    from treadle.engine.protocol import weight_setting_calls

    assert weight_setting_calls() == {
        "create_adapter",
        "set_adapter_weights",
        "optim_step",
        "import_adapter",
    }
    assert weight_setting_calls() == SETS_WEIGHTS and adapter_calls() >= SETS_WEIGHTS
