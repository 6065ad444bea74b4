"""YAML for configs and specs: a key written twice in one mapping is an error, not 'the last one wins'.

PyYAML's safe loader keeps the last of two equal keys without a word, so a
config with `line: A` above `line: B` silently served line B.  This loader
refuses it, naming the key and the line of its second occurrence.
"""
from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(yaml.YAMLError):
    """A mapping names the same key twice (`key`, at 1-based `line`)."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        self.key, self.line, self.first = key, line, first
        super().__init__(f"key {key!r} appears twice in one mapping (line {first}, then line {line})")


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue                    # `<<: *base`: keys written after it override the merged ones
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue                    # the base class names an unhashable key itself
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKey(key, line, seen[key])
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)


def load(text: str) -> Any:
    """`yaml.safe_load(text)`, refusing a key written twice in one mapping (`DuplicateKey`)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def problem(exc: yaml.YAMLError) -> str:
    """A YAML syntax error as one line ('line 3, column 6: mapping values are not allowed here'): PyYAML's own
    text spans several lines with a caret under a copy of the source."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{what}" + (f" ({context})" if context else "")
