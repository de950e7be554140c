"""Routes: a model alias that clients call, mapped to an ordered list of rules, each
sending the requests it matches to a model and a tier. First match wins; the last rule
matches everything (the default), so every request has a route.

    routes:
      assistant:
        - {name: greeting, when: {turns_max: 1, prompt_tokens_max: 120},
           model: small, tier: priority}
        - {name: ticket, when: {regex: "(?i)refund|broken|invoice"}, model: large,
           tier: default}
        - {name: learned, when: {score_min: 0.5}, model: large, tier: default}
        - {name: rest, model: small, tier: priority}

Conditions (all must hold; absent ones are not checked): `tiers` (the tier asked for),
`tenants`, `turns_min`/`turns_max` (user messages), `prompt_tokens_min`/`_max`,
`max_tokens_min`/`_max`, `tools` (true/false: tools present), `regex` (searched in the
last user message), `score_min`/`score_max` (the trained classifier's probability that
the request is hard; route/classifier.py). A rule's tier is optional: without one the
request keeps the tier it asked for.

A rule may escalate (a cascade): when its model's whole answer fails a check, the
request runs again on another model and both attempts are billed:

        - {name: greeting, when: {turns_max: 1}, model: small, tier: priority,
           escalate: {model: large, tier: default, min_mean_logprob: -1.5}}

Checks: an empty answer and one cut by `max_tokens` (`on_empty`, `on_length`, both on
unless set false), and the mean log-probability of its tokens under `min_mean_logprob`.
Only whole answers escalate: a stream's tokens are already with the client.
"""

import re
from dataclasses import dataclass, field

from tierserve.errors import ConfigError
from tierserve.tiers import TIER_NAMES, Tier

CONDITIONS = {"tiers", "tenants", "turns_min", "turns_max", "prompt_tokens_min",
              "prompt_tokens_max", "max_tokens_min", "max_tokens_max", "tools", "regex",
              "score_min", "score_max"}


@dataclass
class Features:
    """What rules look at, computed once per request at the edge."""

    tier: Tier = Tier.DEFAULT
    """The tier asked for."""
    tenant: str = "anonymous"
    turns: int = 1
    prompt_tokens: int = 0
    max_tokens: int | None = None
    tools: bool = False
    last_user_message: str = ""
    score: float | None = None
    """The classifier's P(hard); None until a rule needs it (scored lazily)."""


@dataclass
class Escalation:
    model: str
    tier: Tier | None = None
    on_empty: bool = True
    on_length: bool = True
    min_mean_logprob: float | None = None

    def fails(self, text: str, finish_reason: str | None, logprobs: list | None) -> str | None:
        """Why an answer fails the check (None: it passes)."""
        if self.on_empty and not text.strip():
            return "empty"
        if self.on_length and finish_reason == "length":
            return "length"
        if self.min_mean_logprob is not None and logprobs:
            mean = sum(lp for lp, _ in logprobs) / len(logprobs)
            if mean < self.min_mean_logprob:
                return f"mean logprob {mean:.2f}"
        return None


@dataclass
class Rule:
    name: str
    model: str
    tier: Tier | None = None
    when: dict = field(default_factory=dict)
    regex: re.Pattern | None = None
    escalate: Escalation | None = None

    @property
    def needs_score(self) -> bool:
        return "score_min" in self.when or "score_max" in self.when

    def matches(self, f: Features) -> bool:
        w = self.when
        if "tiers" in w and f.tier not in w["tiers"]:
            return False
        if "tenants" in w and f.tenant not in w["tenants"]:
            return False
        for key, value in (("turns", f.turns), ("prompt_tokens", f.prompt_tokens),
                           ("max_tokens", f.max_tokens)):
            low, high = w.get(f"{key}_min"), w.get(f"{key}_max")
            if (low is not None or high is not None) and value is None:
                return False
            if (low is not None and value < low) or (high is not None and value > high):
                return False
        if "tools" in w and bool(w["tools"]) != f.tools:
            return False
        if self.regex is not None and not self.regex.search(f.last_user_message):
            return False
        if self.needs_score:
            if f.score is None:
                raise ValueError("score the request before matching this rule")
            if ("score_min" in w and f.score < w["score_min"]) or \
                    ("score_max" in w and f.score > w["score_max"]):
                return False
        return True


@dataclass
class Route:
    alias: str
    rules: list[Rule]

    def choose(self, f: Features, score=None) -> Rule:
        """The first rule that matches. `score(features) -> float` is called at most once,
        only when a rule needing the classifier is reached."""
        for rule in self.rules:
            if rule.needs_score and f.score is None:
                if score is None:
                    raise ConfigError(f"route {self.alias!r}: rule {rule.name!r} needs a "
                                      "classifier (route_classifier: PATH)")
                f.score = float(score(f))
            if rule.matches(f):
                return rule
        return self.rules[-1]  # unreachable: parse() makes the last rule match everything

    @property
    def models(self) -> set[str]:
        return {r.model for r in self.rules}


def parse_routes(raw, models: set[str]) -> dict[str, Route]:
    """YAML `routes:` -> alias -> Route, checked against the served `models`."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("routes: expected a mapping of alias -> list of rules")
    routes = {}
    for alias, rules in raw.items():
        alias = str(alias)
        if alias in models:
            raise ConfigError(f"routes: alias {alias!r} is also a model's name")
        if not isinstance(rules, list) or not rules:
            raise ConfigError(f"routes.{alias}: expected a non-empty list of rules")
        parsed = [_rule(alias, i, spec, models) for i, spec in enumerate(rules)]
        if parsed[-1].when:
            raise ConfigError(f"routes.{alias}: the last rule ({parsed[-1].name!r}) must have "
                              "no `when`, so that every request has a route")
        names = [r.name for r in parsed]
        if len(set(names)) != len(names):
            raise ConfigError(f"routes.{alias}: rule names must be unique, got {names}")
        routes[alias] = Route(alias, parsed)
    return routes


def _rule(alias: str, i: int, spec, models: set[str]) -> Rule:
    where = f"routes.{alias}[{i}]"
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: expected a mapping with model, tier, when, name")
    unknown = set(spec) - {"name", "model", "tier", "when", "escalate"}
    if unknown:
        raise ConfigError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    model = spec.get("model")
    if model not in models:
        raise ConfigError(f"{where}: model {model!r} is not served here (models: "
                          f"{', '.join(sorted(models))})")
    tier = _tier(where, spec.get("tier"))
    when = dict(spec.get("when") or {})
    bad = set(when) - CONDITIONS
    if bad:
        raise ConfigError(f"{where}: unknown condition {sorted(bad)[0]!r} (conditions: "
                          f"{', '.join(sorted(CONDITIONS))})")
    for key in ("tiers", "tenants"):
        if key in when:
            if isinstance(when[key], str):
                when[key] = [when[key]]
            when[key] = [str(x) for x in when[key]]
    if "tiers" in when:
        when["tiers"] = frozenset(_tier(f"{where}.when", t) for t in when["tiers"])
    for key in CONDITIONS - {"tiers", "tenants", "tools", "regex"}:
        if key in when and not isinstance(when[key], (int, float)):
            raise ConfigError(f"{where}: {key} must be a number, got {when[key]!r}")
    regex = None
    if "regex" in when:
        try:
            regex = re.compile(str(when["regex"]))
        except re.error as exc:
            raise ConfigError(f"{where}: bad regex {when['regex']!r}: {exc}") from None
    return Rule(str(spec.get("name") or f"rule{i}"), model, tier, when, regex,
                _escalation(where, spec.get("escalate"), models, model))


def _escalation(where: str, spec, models: set[str], model: str) -> Escalation | None:
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("model") not in models:
        raise ConfigError(f"{where}.escalate: expected {{model: one of "
                          f"{', '.join(sorted(models))}, tier, min_mean_logprob, on_empty, "
                          f"on_length}}, got {spec!r}")
    unknown = set(spec) - set(Escalation.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"{where}.escalate: unknown field {sorted(unknown)[0]!r}")
    if spec["model"] == model:
        raise ConfigError(f"{where}.escalate: escalating to the same model ({model}) "
                          "would only run the request twice")
    tier = _tier(f"{where}.escalate", spec.get("tier"))
    low = spec.get("min_mean_logprob")
    if low is not None and not isinstance(low, (int, float)):
        raise ConfigError(f"{where}.escalate: min_mean_logprob must be a number")
    return Escalation(spec["model"], tier, bool(spec.get("on_empty", True)),
                      bool(spec.get("on_length", True)),
                      None if low is None else float(low))


def _tier(where: str, name) -> Tier | None:
    if name is None:
        return None
    if name not in TIER_NAMES:
        raise ConfigError(f"{where}: tier must be one of {', '.join(TIER_NAMES)}, got {name!r}")
    return Tier.parse(name)
