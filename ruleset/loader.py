"""Rule files: YAML in, validated `Rule`s (or every error, with file and line) out.

Invariant: a rule set is either loaded whole, every rule checked, or not at all: any error in
any file (YAML syntax, unknown or missing field, wrong type, unknown kind, severity or action,
duplicate id, bad CEL condition, bad template) makes `load_ruleset` raise `RulesetError` with
all of them. Files are read with PyYAML's safe composer only (nodes keep their line numbers,
no tag ever constructs a Python object), and only files of at most MAX_FILE_BYTES nested at
most MAX_DEPTH deep: anything else is one error naming the file, never an exception out of
PyYAML (whose composer recurses once per level). Rule order is file name order, then order in a file.
A rule's fields (rule, description, finding, condition, severity, action, output, tags,
exceptions, enabled): REQUIRED_FIELDS and OPTIONAL_FIELDS below, ruleset/rules/*.yaml, and
docs/operator.md, "Rules". Beside rules, a file may hold named lists (`- list: NAME`, `items`,
`append`) of the kinds in LISTS: defined once, extended by later items with `append: true`.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvguard.ledger.findings import ACTIONS, KINDS, SEVERITIES
from kvguard.proto.limits import ATTENTION_PATTERNS_BYTES
from kvguard.ruleset.condition import Condition, ConditionError
from kvguard.ruleset.errors import RuleError, RulesetError
from kvguard.ruleset.evaluator import UNMATCHED_RULE, Ruleset
from kvguard.ruleset.rule import Rule, RuleException
from kvguard.ruleset.template import Template, TemplateError

DEFAULT_RULES_DIR: Path = Path(__file__).resolve().parent / "rules"

REQUIRED_FIELDS: tuple[str, ...] = ("rule", "description", "finding", "severity", "action", "output")
OPTIONAL_FIELDS: tuple[str, ...] = ("condition", "tags", "exceptions", "enabled")
EXCEPTION_FIELDS: tuple[str, ...] = ("name", "condition")
MAX_FILE_BYTES = 64 << 10  # the shipped files are a few KiB; PyYAML in pure Python is slow on big ones
MAX_DEPTH = 32  # a rule file needs 5 levels (rules, a rule, exceptions, an exception, a value)
_RULE_ID = re.compile(r"[a-z0-9_.-]+")
# The lists a rule file may define: name -> what its items are.
LISTS: dict[str, str] = {
    "attention_kernels": "name patterns (fnmatch) of the kernels that read KV (the CUDA launch witness)",
}
LIST_FIELDS: tuple[str, ...] = ("list", "items", "description", "append")
MAX_ITEM = 256
_MISSING = object()
_PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "seq", "map")
)


def load_ruleset(path: Path | None = None) -> Ruleset:
    """The rule set of `path` (a rules directory or one rule file; default DEFAULT_RULES_DIR).

    Raises RulesetError listing every error found.
    """
    lists: dict[str, tuple[str, ...]] = {}
    rules, errors = load_rules(path, lists)
    if errors:
        raise RulesetError(errors)
    return Ruleset(rules, lists)


def load_rules(
    path: Path | None = None, lists: dict[str, tuple[str, ...]] | None = None
) -> tuple[list[Rule], list[RuleError]]:
    """The rules of `path` and the errors found; the rules are only usable if there are none.
    The lists the files define go into `lists`."""
    root = Path(path) if path is not None else DEFAULT_RULES_DIR
    if root.is_dir():
        files = sorted((p for p in root.glob("*.yaml") if not p.name.startswith(".")), key=lambda p: p.name)
        if not files:
            return [], [RuleError(root, 0, "no rule files (*.yaml) in this directory")]
    elif root.is_file():
        files = [root]
    else:
        return [], [RuleError(root, 0, "no such rules file or directory")]
    rules: list[Rule] = []
    errors: list[RuleError] = []
    seen_ids: dict[str, tuple[Path, int]] = {}
    lists = {} if lists is None else lists
    for file in files:
        parser = _FileParser(file, seen_ids, lists)
        rules.extend(parser.parse())
        errors.extend(sorted(parser.errors, key=lambda error: error.line))  # stable: same line keeps order
    return rules, errors


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _describe(node: Node, value: Any = None) -> str:
    """What a YAML value is, for a reason: 'a list', 'a mapping', 'a number', ..."""
    if isinstance(node, SequenceNode):
        return "a list"
    if isinstance(node, MappingNode):
        return "a mapping"
    if value is None:
        return "nothing (an empty value)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"a number ({value})"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def _suggest(name: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


class _TooDeep(Exception):
    """A node nested deeper than MAX_DEPTH, at `line`."""

    def __init__(self, line: int) -> None:
        super().__init__(line)
        self.line = line


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing (with _TooDeep) to compose a node deeper than MAX_DEPTH,
    before its recursion could reach Python's limit."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1


def _read_bounded(path: Path) -> str:
    """The file's text; ValueError if it is larger than MAX_FILE_BYTES (read no further, so
    that neither a huge file nor a link to /dev/zero takes the memory)."""
    with path.open("rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes: not a rule file")
    return data.decode("utf-8")


class _FileParser:
    """Parses one rule file, appending to `errors` and to the shared `seen_ids`."""

    def __init__(
        self, path: Path, seen_ids: dict[str, tuple[Path, int]], lists: dict[str, tuple[str, ...]]
    ) -> None:
        self.path = path
        self.seen_ids = seen_ids
        self.lists = lists
        self.errors: list[RuleError] = []
        self._constructor = SafeConstructor()

    def error(self, line: int, reason: str) -> None:
        self.errors.append(RuleError(self.path, line, reason))

    def parse(self) -> list[Rule]:
        try:
            text = _read_bounded(self.path)
        except UnicodeDecodeError as exc:
            self.error(0, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
            return []
        except ValueError as exc:
            self.error(0, str(exc))
            return []
        except OSError as exc:
            self.error(0, f"cannot read: {exc.strerror or exc}")
            return []
        try:
            root = yaml.compose(text, Loader=_BoundedLoader)
        except _TooDeep as exc:
            self.error(exc.line, f"nested deeper than {MAX_DEPTH} levels (a rule file needs 5)")
            return []
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            reason = f"YAML syntax error: {exc.problem or exc.context}"
            if exc.problem and exc.context and exc.context_mark:
                reason += f" ({exc.context}, from line {exc.context_mark.line + 1})"
            self.error(mark.line + 1 if mark else 0, reason)
            return []
        except yaml.reader.ReaderError as exc:  # a character YAML does not take, or not UTF-8
            line = text.count("\n", 0, exc.position) + 1
            self.error(line, f"not YAML text: {str(exc).splitlines()[0]}")
            return []
        except yaml.YAMLError as exc:
            self.error(0, f"YAML error: {str(exc).splitlines()[0]}")
            return []
        if root is None:
            return []  # an empty file holds no rules
        if not self._plain_tags(root):
            return []
        if not isinstance(root, SequenceNode):
            self.error(
                _line(root),
                f"a rule file must be a YAML list of rules, not {self._what(root)} "
                "(start each rule with '- ')",
            )
            return []
        rules: list[Rule] = []
        for item in root.value:
            if not isinstance(item, MappingNode):
                self.error(_line(item), f"each rule must be a mapping of fields, not {self._what(item)}")
                continue
            if any(self._scalar(key) == "list" for key, _ in item.value):
                self._list(item)
                continue
            rule = self._rule(item)
            if rule is not None:
                rules.append(rule)
        return rules

    def _plain_tags(self, root: Node) -> bool:
        """True if every node is a plain string, number, boolean, null, list or mapping."""
        ok = True
        stack = [root]
        seen: set[int] = set()  # aliases share nodes: visit each once (no alias bombs)
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.tag not in _PLAIN_TAGS:
                self.error(_line(node), f"YAML tag '{node.tag}' is not allowed in rule files")
                ok = False
            if isinstance(node, SequenceNode):
                stack.extend(node.value)
            elif isinstance(node, MappingNode):
                for key, value in node.value:
                    stack.extend((key, value))
        return ok

    # -- values ------------------------------------------------------------------------------

    def _scalar(self, node: Node) -> Any:
        """The Python value of a scalar node; _MISSING (with an error) if it cannot be built."""
        if not isinstance(node, ScalarNode):
            return _MISSING
        try:
            return self._constructor.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc)
            self.error(_line(node), f"cannot read value: {problem}")
            return _MISSING

    def _what(self, node: Node) -> str:
        value = self._scalar(node) if isinstance(node, ScalarNode) else None
        return _describe(node, None if value is _MISSING else value)

    def _string(self, field: str, node: Node, *, empty_ok: bool = False) -> str | None:
        value = self._scalar(node)
        if isinstance(value, str) and (empty_ok or value.strip()):
            return value
        if isinstance(value, str):
            self.error(_line(node), f"'{field}' must not be empty")
        elif value is not _MISSING or not isinstance(node, ScalarNode):
            hint = " (quote it to make it a string)" if isinstance(value, bool | int | float) else ""
            self.error(_line(node), f"'{field}' must be a string, not {_describe(node, value)}{hint}")
        return None

    def _choice(self, field: str, node: Node, allowed: tuple[str, ...]) -> str | None:
        value = self._string(field, node)
        if value is None:
            return None
        if value not in allowed:
            self.error(
                _line(node),
                f"unknown {field} '{value}' (one of: {', '.join(allowed)}){_suggest(value, allowed)}",
            )
            return None
        return value

    def _mapping(self, node: MappingNode, allowed: tuple[str, ...], what: str) -> dict[str, Node]:
        """Field name -> value node; unknown and repeated fields are errors."""
        fields: dict[str, Node] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = self._scalar(key_node)
            if not isinstance(key, str):
                if key is not _MISSING or not isinstance(key_node, ScalarNode):
                    self.error(
                        _line(key_node), f"{what} field names must be strings, not {_describe(key_node, key)}"
                    )
                continue
            if key in fields:
                self.error(_line(key_node), f"duplicate field '{key}' in {what} (first on line {lines[key]})")
                continue
            if key not in allowed:
                self.error(
                    _line(key_node),
                    f"unknown field '{key}' in {what} "
                    f"(allowed: {', '.join(allowed)}){_suggest(key, allowed)}",
                )
                continue
            fields[key] = value_node
            lines[key] = _line(key_node)
        return fields

    def _condition(self, label: str, node: Node) -> Condition | None:
        source = self._string(label, node)
        if source is None:
            return None
        try:
            return Condition(source)
        except ConditionError as exc:
            self.error(_line(node), f"{label}: {exc}")
            return None

    # -- rules -------------------------------------------------------------------------------

    def _rule(self, node: MappingNode) -> Rule | None:
        count = len(self.errors)
        start = _line(node)
        fields = self._mapping(node, REQUIRED_FIELDS + OPTIONAL_FIELDS, "a rule")
        for name in REQUIRED_FIELDS:
            if name not in fields:
                self.error(start, f"rule is missing required field '{name}'")
        rule_id = self._rule_id(fields["rule"]) if "rule" in fields else None
        description = self._string("description", fields["description"]) if "description" in fields else None
        kinds = self._kinds(fields["finding"]) if "finding" in fields else None
        severity = self._choice("severity", fields["severity"], SEVERITIES) if "severity" in fields else None
        action = self._choice("action", fields["action"], ACTIONS) if "action" in fields else None
        output = self._output(fields["output"]) if "output" in fields else None
        condition = self._condition("condition", fields["condition"]) if "condition" in fields else None
        if condition is not None and kinds:
            for kind in kinds:
                reason = condition.check_result_type(kind)
                if reason:
                    self.error(_line(fields["condition"]), f"condition: {reason}")
                    break
        tags = self._tags(fields["tags"]) if "tags" in fields else ()
        exceptions = self._exceptions(fields["exceptions"]) if "exceptions" in fields else ()
        enabled = self._enabled(fields["enabled"]) if "enabled" in fields else True
        if (
            len(self.errors) > count
            or rule_id is None
            or description is None
            or kinds is None
            or severity is None
            or action is None
            or output is None
            or tags is None
            or exceptions is None
            or enabled is None
        ):
            return None
        return Rule(
            id=rule_id,
            description=description.strip(),
            kinds=kinds,
            severity=severity,
            action=action,
            output=output,
            condition=condition,
            tags=tags,
            exceptions=exceptions,
            enabled=enabled,
            path=self.path,
            line=start,
        )

    def _list(self, node: MappingNode) -> None:
        fields = self._mapping(node, LIST_FIELDS, "a list")
        name = self._choice("list", fields["list"], tuple(LISTS))
        if "items" not in fields:
            self.error(_line(node), "list is missing required field 'items'")
            return
        items = fields["items"]
        if not isinstance(items, SequenceNode):
            self.error(_line(items), f"items must be a list of strings, not {self._what(items)}")
            return
        values = [self._string("items", item) for item in items.value]
        for item, value in zip(items.value, values, strict=True):
            if value is not None and (len(value) > MAX_ITEM or not value.isprintable()):
                self.error(
                    _line(item), f"list item {value[:40]!r} is over {MAX_ITEM} characters or unprintable"
                )
        append = self._enabled(fields["append"], "append") if "append" in fields else False
        if name is None or None in values or append is None:
            return
        if name in self.lists and not append:
            self.error(_line(node), f"list '{name}' is defined again: add `append: true` to extend it")
            return
        merged = (*self.lists.get(name, ()), *(v for v in values if v is not None))
        size = sum(len(v.encode()) + 1 for v in merged)
        if size > ATTENTION_PATTERNS_BYTES:
            self.error(_line(items), f"list '{name}' takes {size} bytes (at most {ATTENTION_PATTERNS_BYTES})")
            return
        self.lists[name] = merged

    def _rule_id(self, node: Node) -> str | None:
        value = self._string("rule", node)
        if value is None:
            return None
        if not _RULE_ID.fullmatch(value):
            self.error(_line(node), f"rule id '{value}' may only use a-z, 0-9, '_', '.' and '-'")
            return None
        if value == UNMATCHED_RULE:
            self.error(_line(node), f"rule id '{value}' is reserved for findings that match no rule")
            return None
        if value in self.seen_ids:
            path, line = self.seen_ids[value]
            self.error(_line(node), f"duplicate rule id '{value}' (first defined at {path}:{line})")
            return None
        self.seen_ids[value] = (self.path, _line(node))
        return value

    def _kinds(self, node: Node) -> tuple[str, ...] | None:
        items = node.value if isinstance(node, SequenceNode) else [node]
        if isinstance(node, SequenceNode) and not items:
            self.error(_line(node), "'finding' must name at least one finding kind")
            return None
        kinds: list[str] = []
        ok = True
        for item in items:
            kind = self._choice("finding", item, KINDS)
            if kind is None:
                ok = False
            elif kind not in kinds:
                kinds.append(kind)
        return tuple(kinds) if ok else None

    def _output(self, node: Node) -> Template | None:
        source = self._string("output", node)
        if source is None:
            return None
        try:
            return Template(source.strip())
        except TemplateError as exc:
            self.error(_line(node), f"output: {exc}")
            return None

    def _tags(self, node: Node) -> tuple[str, ...] | None:
        if not isinstance(node, SequenceNode):
            self.error(_line(node), f"'tags' must be a list of strings, not {self._what(node)}")
            return None
        tags = [self._string("tags", item) for item in node.value]
        return tuple(dict.fromkeys(t for t in tags if t is not None)) if None not in tags else None

    def _enabled(self, node: Node, field: str = "enabled") -> bool | None:
        value = self._scalar(node)
        if isinstance(value, bool):
            return value
        if value is not _MISSING or not isinstance(node, ScalarNode):
            self.error(_line(node), f"'{field}' must be true or false, not {_describe(node, value)}")
        return None

    def _exceptions(self, node: Node) -> tuple[RuleException, ...] | None:
        if not isinstance(node, SequenceNode):
            self.error(
                _line(node), f"'exceptions' must be a list of {{name, condition}}, not {self._what(node)}"
            )
            return None
        out: list[RuleException] = []
        names: dict[str, int] = {}
        ok = True
        for item in node.value:
            if not isinstance(item, MappingNode):
                self.error(
                    _line(item),
                    f"an exception must be a mapping with name and condition, not {self._what(item)}",
                )
                ok = False
                continue
            fields = self._mapping(item, EXCEPTION_FIELDS, "an exception")
            for name in EXCEPTION_FIELDS:
                if name not in fields:
                    self.error(_line(item), f"exception is missing required field '{name}'")
                    ok = False
            name = self._string("name", fields["name"]) if "name" in fields else None
            if name is not None and name in names:
                self.error(
                    _line(fields["name"]), f"duplicate exception name '{name}' (first on line {names[name]})"
                )
                name = None
            elif name is not None:
                names[name] = _line(fields["name"])
            label = f"exception '{name}' condition" if name else "exception condition"
            condition = self._condition(label, fields["condition"]) if "condition" in fields else None
            if name is None or condition is None:
                ok = False
                continue
            out.append(RuleException(name=name, condition=condition, line=_line(item)))
        return tuple(out) if ok else None
