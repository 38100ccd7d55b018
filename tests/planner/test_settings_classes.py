"""The settings classes are written out for readers and type checkers; they stay equal to the table."""

import dataclasses
import types
import typing

import pytest

from shardserve.planner.options import PlanOptions
from shardserve.planner.settings import BY_NAME, ENGINE, PLAN, SettingError, names
from shardserve.runtime.engine_args import EngineArgs


def members(hint) -> set:
    """A type's kinds, as the table and the classes may spell them (Optional[X] or X | None, tuple or
    tuple[int, ...])."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return {typing.get_origin(a) or a for a in args}


@pytest.mark.parametrize("cls, layer", [(PlanOptions, PLAN), (EngineArgs, ENGINE)])
def test_fields_are_the_tables(cls, layer):
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    assert tuple(f.name for f in fields) == names(layer)  # every setting of the layer, in table order
    for f in fields:
        setting = BY_NAME[f.name]
        assert f.default == setting.default, f.name
        expected = members(setting.annotation) | ({type(None)} if setting.default is None else set())
        assert members(hints[f.name]) == expected, f.name


@pytest.mark.parametrize("cls", [PlanOptions, EngineArgs])
def test_values_are_checked_when_made(cls):
    with pytest.raises(SettingError, match="max_num_seqs"):
        cls(max_num_seqs=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cls().max_num_seqs = 3
