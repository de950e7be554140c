"""Which served model, in which tier, answers a request: the model it names in the tier
it asks for, or, for an alias of `routes:`, the model and tier of the first rule that
matches it (route/rules.py). The tier is parsed here, once, at the edge (`Tier`), and
resolved against what the tenant may use (tiers.py's rule); below this every layer
takes a `Tier`.

The features rules look at are computed here, once, at the edge: the tier asked for, the
tenant, the user turns, the prompt's tokens (counted with the tokenizer of the model the
route's default rule names), `max_tokens`, whether tools are given, and the last user
message. The classifier is scored only when a rule needs it.
"""

from dataclasses import dataclass, replace

from tierserve.route.rules import Features, Route
from tierserve.router.backend import Chat
from tierserve.server import tools
from tierserve.server.protocol import ChatCompletionRequest
from tierserve.tiers import Tier, resolve


@dataclass
class Choice:
    served: "object"
    """app.Served: the model's name, backend and admission."""
    tier: Tier
    """The tier it runs in: asked for or the rule's, as the tenant may use it (batch for
    a batch line)."""
    route: str | None = None
    """`alias/rule` when an alias was called; None when a model was named."""
    score: float | None = None
    """The classifier's P(hard), where a rule needed it."""
    escalate: object = None
    """route.rules.Escalation: the cascade's check and where a failed answer goes."""
    escalated_from: str | None = None
    """On the second attempt of a cascade: the model whose answer failed, and why."""
    asked: Tier = Tier.DEFAULT
    """The tier the request asked for (parsed, not yet resolved for the tenant)."""
    fallback_from: str | None = None
    """The model that could not take it (YAML `fallbacks:`), and why: `name (down)`."""

    @property
    def header(self) -> str | None:
        if self.route is None:
            return None
        out = f"route={self.route}; model={self.served.name}"
        return out + f"; escalated_from={self.escalated_from}" if self.escalated_from else out


def choose(state, body, tenant, batch: bool = False) -> Choice:
    """`batch`: a line of a batch job, which runs in the batch tier whatever it asks."""
    asked = Tier.from_wire(body.service_tier)
    route = state.routes.get(body.model)
    if route is None:
        return fall_back(state, Choice(
            state.target(body.model), Tier.BATCH if batch else state.tier_for(asked, tenant),
            asked=asked))
    f = features(state, route, body, tenant, asked)
    scorer = state.classifier.score if state.classifier is not None else None
    rule = route.choose(f, scorer)
    return fall_back(state, Choice(
        state.target(rule.model), Tier.BATCH if batch else rule_tier(state, rule.tier, asked,
                                                                     tenant),
        f"{route.alias}/{rule.name}", f.score, rule.escalate, asked=asked))


def fall_back(state, choice: Choice) -> Choice:
    """The choice, sent to the first of its model's YAML `fallbacks:` that can take it,
    where that model's pool cannot now (no healthy replica, or its tier's queue full);
    else as it was (and it fails clearly if it must)."""
    why = _unable(choice.served, choice.tier)
    if why is None:
        return choice
    for name in state.settings.fallbacks.get(choice.served.name, ()):
        other = state.served.get(name)
        if other is not None and _unable(other, choice.tier) is None:
            state.metrics.fallbacks.labels(choice.served.name, name, why).inc()
            return replace(choice, served=other,
                           fallback_from=f"{choice.served.name} ({why})")
    return choice


def _unable(served, tier: Tier) -> str | None:
    if served.backend.errored is not None:
        return "down"
    if served.admission.full(served.backend.tier_map[tier]):
        return "queue_full"
    return None


def rule_tier(state, tier: Tier | None, asked: Tier, tenant) -> Tier:
    """A rule's tier as the tenant may use it (the nearest allowed, else the rule's);
    a rule without one keeps the tier asked for."""
    if tier is None:
        return state.tier_for(asked, tenant)
    return resolve(tier, tenant.allowed) or tier


def escalation(state, choice: Choice, why: str, tenant) -> Choice:
    """The second attempt of a cascade."""
    esc = choice.escalate
    tier = Tier.BATCH if choice.tier == Tier.BATCH else \
        rule_tier(state, esc.tier, choice.asked, tenant)
    return fall_back(state, Choice(state.target(esc.model), tier, choice.route, choice.score,
                                   None, f"{choice.served.name} ({why})", choice.asked))


def features(state, route: Route, body, tenant, asked: Tier) -> Features:
    counter = state.target(route.rules[-1].model).backend
    if isinstance(body, ChatCompletionRequest):
        users = [m for m in body.messages if m.role == "user"]
        last = users[-1].text() if users else ""
        prompt = counter.prepare(Chat(tools.render(body)))
        turns, has_tools = max(1, len(users)), bool(body.tools)
    else:
        p = body.prompt
        last = p if isinstance(p, str) else ""
        prompt = counter.prepare(p) if isinstance(p, str) else p
        turns, has_tools = 1, False
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        n = len(prompt)
    else:  # no tokenizer (a gateway without the model's files): about 4 bytes a token
        n = len(str(prompt).encode()) // 4
    return Features(tier=asked, tenant=tenant.name, turns=turns, prompt_tokens=n,
                    max_tokens=body.max_completion_tokens if hasattr(
                        body, "max_completion_tokens") and body.max_completion_tokens
                    else body.max_tokens, tools=has_tools, last_user_message=last)
