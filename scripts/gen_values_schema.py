"""Generate helm/meshkeeper/values.schema.json from the annotations in values.yaml.

    python scripts/gen_values_schema.py           # write the schema
    python scripts/gen_values_schema.py --check   # exit 1 with a diff when it is stale

The convention (also at the top of values.yaml):
- A key's type is inferred from its default value (string, integer, number, boolean, array,
  object).
- The comment lines directly above a key, and a comment at the end of its line, become its
  `description`.
- A comment line `# @schema <keyword>: <value>, ...` directly above a key adds JSON Schema
  (draft-07) keywords; the text after `@schema` is read as the inside of a YAML flow mapping,
  so `# @schema minimum: 1, maximum: 65535` or `# @schema enum: [cpu, cuda]`. Several such
  lines merge, mappings deeply. An annotated `type` replaces the inferred one;
  `required: true` lists the key in its parent's `required`.
- A mapping becomes an object with `additionalProperties: false` whose properties are its keys.
  A mapping annotated with `additionalProperties` (true, or a schema for every value) is a
  free-form map instead: its default's keys are examples, not properties. An empty mapping
  must say which it is.
- A list's `items` come only from an annotation; its default's entries are examples.

Only PyYAML is needed: its composer keeps each key's line, and the comments are read from
the file's lines.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "meshkeeper"
MARK = "@schema"
# What an annotation may say; anything else is most likely a misspelling.
KEYWORDS = set(
    """type description enum const pattern format minimum maximum exclusiveMinimum
    exclusiveMaximum multipleOf minLength maxLength minItems maxItems uniqueItems items
    additionalProperties properties required minProperties maxProperties examples""".split()
)
SCALAR_TYPES = {
    "tag:yaml.org,2002:str": "string",
    "tag:yaml.org,2002:int": "integer",
    "tag:yaml.org,2002:float": "number",
    "tag:yaml.org,2002:bool": "boolean",
}


class AnnotationError(ValueError):
    """A values.yaml annotation that cannot become a schema; the message names the line."""


def is_mark(comment: str) -> bool:
    return comment == MARK or comment.startswith(MARK + " ")


def deep_merge(base: dict, extra: dict) -> dict:
    """base updated by extra; where both hold a mapping, those merge too."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(out.get(key), dict) and isinstance(value, dict)
        out[key] = deep_merge(out[key], value) if both else value
    return out


class Generator:
    def __init__(self, values: Path):
        self.values = values
        self.text = values.read_text()
        self.lines = self.text.splitlines()

    def where(self, node: Node) -> str:
        return f"{self.values.name}:{node.start_mark.line + 1}"

    def schema(self) -> dict:
        try:
            root = yaml.compose(self.text)
        except yaml.YAMLError as e:
            raise AnnotationError(f"{self.values.name} is not valid YAML: {e}") from None
        if not isinstance(root, MappingNode):
            raise AnnotationError(f"{self.values.name}: the values must be a mapping")
        body = self.object(root, {}, "")
        return {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "title": "meshkeeper chart values",
            **body,
        }

    def notes(self, key: Node, value: Node) -> tuple[list[str], list[str]]:
        """(description lines, annotation bodies) of a key: the comment block directly above
        it (a blank line ends the block) and a comment at the end of its line."""
        above: list[str] = []
        line = key.start_mark.line - 1
        while line >= 0 and self.lines[line].lstrip().startswith("#"):
            above.insert(0, self.lines[line].lstrip()[1:].strip())
            line -= 1
        own = self.lines[key.start_mark.line]
        # after the value when it ends on the key's line, else after the key (`auth:  # ...`)
        same_line = value.end_mark.line == key.start_mark.line
        end = value.end_mark.column if same_line else key.end_mark.column
        rest = own[end:].lstrip(" \t:")
        if rest.startswith("#"):
            above.append(rest[1:].strip())
        marks = [text[len(MARK) :] for text in above if is_mark(text)]
        return [text for text in above if not is_mark(text)], marks

    def annotation(self, key: Node, bodies: list[str]) -> dict:
        merged: dict = {}
        for body in bodies:
            try:
                parsed = yaml.safe_load("{" + body + "}")
            except yaml.YAMLError as e:
                raise AnnotationError(
                    f"{self.where(key)}: `# {MARK}{body}` is not a YAML flow mapping body"
                    f" (write `# {MARK} keyword: value, ...`; quote patterns): {e}"
                ) from None
            unknown = sorted(set(parsed) - KEYWORDS)
            if unknown:
                raise AnnotationError(
                    f"{self.where(key)}: unknown @schema keyword(s) {unknown} on "
                    f"{key.value!r}; use JSON Schema keywords: {sorted(KEYWORDS)}"
                )
            merged = deep_merge(merged, parsed)
        return merged

    def key_schema(self, key: Node, value: Node, path: str) -> tuple[dict, bool]:
        """The schema of one key and whether its parent requires it."""
        description, bodies = self.notes(key, value)
        annotation = self.annotation(key, bodies)
        required = annotation.get("required") is True
        if isinstance(annotation.get("required"), bool):
            del annotation["required"]
        if description and "description" not in annotation:
            annotation = {"description": " ".join(description), **annotation}
        if isinstance(value, MappingNode):
            return self.object(value, annotation, path), required
        if "type" in annotation:
            return annotation, required
        if isinstance(value, SequenceNode):
            return {"type": "array", **annotation}, required
        if isinstance(value, ScalarNode) and value.tag in SCALAR_TYPES:
            return {"type": SCALAR_TYPES[value.tag], **annotation}, required
        raise AnnotationError(
            f"{self.where(key)}: {path} has no type to infer from its "
            f"default; add `# {MARK} type: ...` above it"
        )

    def object(self, node: MappingNode, annotation: dict, path: str) -> dict:
        schema = {"type": "object", **annotation}
        if "additionalProperties" in annotation or "properties" in annotation:
            return schema  # a free-form map: the default's keys are only examples
        if not node.value:
            raise AnnotationError(
                f"{self.where(node)}: {path} is an empty map; say what it may hold with "
                f"`# {MARK} additionalProperties: true` (any object) or "
                f"`# {MARK} additionalProperties: {{type: string}}` (a string map)"
            )
        properties, required = {}, []
        for key, value in node.value:
            name = key.value
            properties[name], needed = self.key_schema(key, value, f"{path}.{name}".lstrip("."))
            if needed:
                required.append(name)
        schema["additionalProperties"] = False
        schema["properties"] = properties
        if required:
            schema["required"] = required
        return schema


def render(values: Path) -> str:
    return json.dumps(Generator(values).schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 with a diff when the schema file differs from the values",
    )
    parser.add_argument("--values", type=Path, default=CHART / "values.yaml")
    parser.add_argument("--schema", type=Path, default=CHART / "values.schema.json")
    args = parser.parse_args(argv)
    try:
        text = render(args.values)
    except AnnotationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.check:
        args.schema.write_text(text)
        print(f"wrote {args.schema}")
        return 0
    old = args.schema.read_text() if args.schema.exists() else ""
    if old == text:
        return 0
    diff = list(
        difflib.unified_diff(
            old.splitlines(),
            text.splitlines(),
            str(args.schema),
            f"generated from {args.values.name}",
            lineterm="",
        )
    )
    changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
    print("\n".join(diff[:60] + (["..."] if len(diff) > 60 else [])))
    print(
        f"{args.schema} is stale ({changed} lines differ); regenerate it with "
        f"`python scripts/gen_values_schema.py`",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
