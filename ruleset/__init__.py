"""Rules: severity, action and output per finding, loaded from YAML and validated.

`load_ruleset()` reads the rule files (default: `DEFAULT_RULES_DIR`, the `rules/` folder of
this package) and returns a `Ruleset` whose `evaluate(finding)` gives each finding its
severity, action, rule id, message and tags (first matching rule wins; unmatched findings are
still reported). `RuleStore` keeps the last good rule set across reloads. Errors in rule files
are reported all at once as `RulesetError`, each `RuleError` as `path:line: reason`.
"""

from kvguard.ruleset.errors import RuleError, RulesetError
from kvguard.ruleset.evaluator import Counters, Ruleset
from kvguard.ruleset.loader import DEFAULT_RULES_DIR, load_ruleset
from kvguard.ruleset.rule import Rule, RuleException
from kvguard.ruleset.store import RuleStore

__all__ = [
    "DEFAULT_RULES_DIR",
    "Counters",
    "Rule",
    "RuleError",
    "RuleException",
    "RuleStore",
    "Ruleset",
    "RulesetError",
    "load_ruleset",
]
