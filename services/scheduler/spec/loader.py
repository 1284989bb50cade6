"""Load a spec's YAML documents without letting the YAML amplify (contract §19).

YAML aliases let a short text stand for a huge value: a 20 KB spec whose anchors
refer to anchors nine levels deep expands to gigabytes once anything walks it.
Loading therefore goes in three steps:

1. the text must be at most ``MAX_SPEC_BYTES`` of UTF-8;
2. it is *composed* into YAML's node graph, in which an alias is the same node
   object as its anchor, so the graph is never larger than the text;
3. the graph is *measured* as if every alias were expanded, without expanding it:
   each node's expanded size and height are computed once and reused wherever an
   alias points at the node, so measuring costs time linear in the text. A graph
   over ``MAX_SPEC_BYTES`` expanded, or nested deeper than ``MAX_YAML_DEPTH``
   collections, is refused; a recursive alias (``&a [*a]``) is infinitely deep and
   is refused by the same rule. Only then are the documents constructed.

The expanded size counts each scalar's UTF-8 bytes plus one for every node (the
separators and brackets a dump would need), so a spec without aliases measures
about its own size and a spec at the byte limit passes both checks.

libyaml's loader is used where PyYAML has it: the same safe subset, several times
faster; it also caps nesting at 1,000 levels while scanning, before composing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import yaml

from services.common.bounds import MAX_SPEC_BYTES, MAX_YAML_DEPTH
from services.scheduler.spec.fields import SpecError

__all__ = ["LOADER", "load_documents"]

# A loader class: called with the text, it composes and constructs (PyYAML's protocol).
LoaderClass = Callable[[str], Any]
LOADER: LoaderClass = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_FIELD = "spec_yaml"
_SCALAR = yaml.ScalarNode
_MAPPING = yaml.MappingNode


class _Measure:
    """Expanded size and height of node graphs, each collection node measured once.

    Scalars are counted inline (their size is their length wherever they appear),
    which keeps the measure cheap next to libyaml's parsing of a normal spec.
    """

    def __init__(self) -> None:
        self.total = 0
        # id(collection node) -> (expanded size, height); the nodes outlive the measure.
        self._known: dict[int, tuple[int, int]] = {}

    def document(self, root: yaml.Node) -> None:
        if isinstance(root, yaml.ScalarNode):
            self.total += _scalar_bytes(root.value)
        else:
            self.total += self._collection(root, 1)[0]
        if self.total > MAX_SPEC_BYTES:
            raise _too_large()

    def _collection(self, node: yaml.Node, level: int) -> tuple[int, int]:
        """Measures a sequence or mapping found at ``level`` (the root is level 1)."""
        if level > MAX_YAML_DEPTH:
            raise _too_deep()
        items = node.value
        children = itertools.chain.from_iterable(items) if isinstance(node, _MAPPING) else items
        size, height = 1, 1
        for child in children:
            if child.__class__ is _SCALAR:
                size += _scalar_bytes(child.value)
                continue
            known = self._known.get(id(child))
            if known is None:
                known = self._collection(child, level + 1)
                self._known[id(child)] = known
            elif level + known[1] > MAX_YAML_DEPTH:
                # First met shallower, reached again deeper through an alias.
                raise _too_deep()
            size += known[0]
            height = max(height, known[1] + 1)
        # Each child's size is at most the limit, so this sum stays a small number.
        if size > MAX_SPEC_BYTES:
            raise _too_large()
        return size, height


def _scalar_bytes(value: str) -> int:
    """A scalar's UTF-8 size plus one for its node; isascii() is O(1) for Python strings."""
    return (len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))) + 1


def _too_large() -> SpecError:
    return SpecError(
        _FIELD, f"the spec is larger than {MAX_SPEC_BYTES} bytes once its aliases are expanded"
    )


def _too_deep() -> SpecError:
    return SpecError(_FIELD, f"the spec nests more than {MAX_YAML_DEPTH} levels deep")


def _compose_and_construct(spec_yaml: str, loader_class: LoaderClass) -> list[object]:
    loader = loader_class(spec_yaml)
    try:
        nodes = []
        while loader.check_node():
            nodes.append(loader.get_node())
        measure = _Measure()
        for node in nodes:
            if node is not None:
                measure.document(node)
        return [None if node is None else loader.construct_document(node) for node in nodes]
    finally:
        loader.dispose()


def load_documents(spec_yaml: str, loader_class: LoaderClass = LOADER) -> list[object]:
    """Loads every YAML document of a spec, refusing specs that are too large or deep.

    Args:
        spec_yaml: The spec's text.
        loader_class: A safe PyYAML loader; libyaml's by default, else PyYAML's own.

    Returns:
        The documents' values, empty documents left out.

    Raises:
        SpecError: At ``spec_yaml``: the text is over the size limit before or after
            alias expansion, nests too deeply, or is not valid YAML.
    """
    if len(spec_yaml.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(_FIELD, f"the spec is larger than {MAX_SPEC_BYTES} bytes")
    try:
        docs = _compose_and_construct(spec_yaml, loader_class)
    except SpecError:
        raise
    except yaml.MarkedYAMLError as err:
        where = f" at line {err.problem_mark.line + 1}" if err.problem_mark else ""
        problem = err.problem or err.context or "syntax error"
        raise SpecError(_FIELD, f"invalid YAML{where}: {problem[:200]}") from None
    except RecursionError:
        # Only the pure-Python loader recurses per level; libyaml caps nesting itself.
        raise _too_deep() from None
    except (yaml.YAMLError, ValueError, OverflowError) as err:
        if isinstance(err, ValueError) and "integer string conversion" in str(err):
            # Python refuses to read huge integers (CVE-2020-10735); say so in our words.
            raise SpecError(_FIELD, "invalid YAML: an integer with thousands of digits") from None
        # PyYAML raises plain ValueError for impossible dates such as 2024-13-01.
        first_line = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise SpecError(_FIELD, f"invalid YAML: {first_line}") from None
    return [doc for doc in docs if doc is not None]
