"""YAML parsing that rejects duplicated keys (PyYAML's safe loader keeps the last one).

A second ``admission:`` section would otherwise silently replace the first. The error
names the key and both line numbers. Merge keys (``<<: *anchor``) are not duplicates:
explicit keys override merged ones, as YAML specifies.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping repeats a key."""

    def __init__(self, key: str, first_line: int, line: int) -> None:
        super().__init__(f"duplicate key {key!r} at line {line} (first at line {first_line})")
        self.key = key
        self.first_line = first_line
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            first = seen.get(key)
            if first is not None:
                raise DuplicateKeyError(str(key), first, line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """Parse one YAML document; raises :class:`DuplicateKeyError` or ``yaml.YAMLError``."""
    # A SafeLoader subclass: no arbitrary objects are constructed.
    return yaml.load(text, Loader=_UniqueKeyLoader)
