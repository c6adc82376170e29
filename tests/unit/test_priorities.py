"""Priority classes (controller/priorities.py): the operator's file is read with an error that
names the entry and the fix, a spec's unknown class is refused with the pool's list, a class
removed since a job was admitted counts as the lowest, and a class is open to admins, to the
tokens it lists, and (listing none) to anyone unless it preempts."""

from __future__ import annotations

import pytest

from controller.auth import Principal
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
        ("- {name: default, value: 1, submitters: alice}\n", "submitters must be a list"),
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


ADMIN, ALICE, BOB = (
    Principal("root", "admin"),
    Principal("alice", "submitter"),
    Principal("bob", "submitter"),
)


def test_who_may_submit_into_a_class(tmp_path):
    f = tmp_path / "classes.yaml"
    f.write_text(
        "- {name: default, value: 50}\n"
        "- {name: prod, value: 900, preempts: true, submitters: [alice]}\n"
        "- {name: urgent, value: 950, preempts: true}\n"
        "- {name: research, value: 60, submitters: [bob]}\n"
    )
    c = load(f)
    opens = {
        name: [who.name for who in (ADMIN, ALICE, BOB) if c.of(spec(name)).open_to(who)]
        for name in ("default", "prod", "urgent", "research")
    }
    assert opens == {
        "default": ["root", "alice", "bob"],  # lists none, preempts nobody: anyone
        "prod": ["root", "alice"],  # listed
        "urgent": ["root"],  # preempts and lists none: admins only
        "research": ["root", "bob"],  # a list closes even a class that preempts nothing
    }
    no = c.refusal(spec("prod"), BOB)
    assert (no.status, no.problem.field) == (403, "priority.class")
    assert "open to admins and alice" in no.problem.message
    assert "use one of default" in no.problem.message
    assert c.refusal(spec("prod"), ALICE) is None
    assert c.refusal(spec("nonesuch"), BOB) is None  # unknown: `problems` says so, with 422


def test_the_built_in_high_class_is_the_admins(tmp_path):
    c = PriorityClasses()
    assert c.refusal(spec("high"), ALICE).status == 403
    assert c.refusal(spec("high"), ADMIN) is None
    assert c.refusal(spec("low"), ALICE) is None
