"""Priority classes (controller/priorities.py): the operator's file is read with an error that
names the entry and the fix, a spec's unknown class is refused with the pool's list, and a
class removed since a job was admitted counts as the lowest."""

from __future__ import annotations

import pytest

from controller.priorities import PriorityClass, PriorityClasses, load
from services.spec import parse_spec
from tests.stack import tiny_spec


def spec(klass: str):
    return parse_spec({**tiny_spec("p"), "priority": {"class": klass}})


def test_the_built_in_classes():
    c = PriorityClasses()
    assert c.of(parse_spec(tiny_spec("p"))) == PriorityClass("default", 100)
    assert c.of(spec("high")) == PriorityClass("high", 1000, preempts=True)
    assert c.problems(spec("high")) == []
    (problem,) = c.problems(spec("urgent"))
    assert problem.field == "priority.class"
    assert "'urgent'" in problem.message
    assert "low (0), default (100), high (1000, preempts)" in problem.message


def test_an_operators_file_replaces_them(tmp_path):
    f = tmp_path / "classes.yaml"
    f.write_text(
        "- {name: batch, value: 10}\n- {name: default, value: 50}\n"
        "- {name: prod, value: 900, preempts: true}\n"
    )
    c = load(f)
    assert c.of(spec("prod")) == PriorityClass("prod", 900, preempts=True)
    assert c.problems(spec("high"))  # the built-in ones are gone
    assert c.of(spec("high")) == PriorityClass("high", 10)  # removed since: the lowest


@pytest.mark.parametrize(
    "text,says",
    [
        ("- {name: prod, value: 900}\n", "no class named 'default'"),
        ("- {name: default, value: high}\n", "entry 1 (default): value must be an integer"),
        ("- {name: default, value: 1}\n- {name: default, value: 2}\n", "listed twice"),
        ("- {name: default, value: 1, preempt: true}\n", "entry 1: expected {name, value"),
        ("- {name: default, value: 1, preempts: yes please}\n", "preempts must be true or false"),
        ("name: default\n", "expected a YAML list"),
        ("- [unclosed\n", "cannot read it"),
    ],
)
def test_a_bad_file_names_the_entry_and_the_fix(tmp_path, text, says):
    f = tmp_path / "classes.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=str(f)) as e:
        load(f)
    assert says in str(e.value)
