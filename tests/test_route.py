"""Routes from the YAML (first match wins, a default ends every list) and the learned
router (`tierserve route train`): what issue 17's hybrid serving chooses with."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.cli import main
from tierserve.errors import ConfigError
from tierserve.route.classifier import Classifier, example_text
from tierserve.route.conversations import workload
from tierserve.route.rules import Features, parse_routes
from tierserve.tiers import Tier

MODELS = {"small", "large"}
ROUTES = {"assistant": [
    {"name": "greeting", "when": {"turns_max": 1, "prompt_tokens_max": 40},
     "model": "small", "tier": "priority"},
    {"name": "ticket", "when": {"regex": "(?i)refund|invoice"}, "model": "large",
     "tier": "default"},
    {"name": "tools", "when": {"tools": True}, "model": "large"},
    {"name": "vip", "when": {"tenants": "acme", "tiers": ["priority"]}, "model": "large",
     "tier": "priority"},
    {"name": "rest", "model": "small", "tier": "default"},
]}


def test_the_first_matching_rule_wins_and_the_default_ends_the_list():
    route = parse_routes(ROUTES, MODELS)["assistant"]
    assert route.choose(Features(turns=1, prompt_tokens=10)).name == "greeting"
    assert route.choose(Features(turns=3, last_user_message="My REFUND?")).name == "ticket"
    assert route.choose(Features(turns=3, tools=True)).name == "tools"
    assert route.choose(Features(turns=3, tenant="acme", tier=Tier.PRIORITY)).name == "vip"
    assert route.choose(Features(turns=3, tenant="acme", tier=Tier.DEFAULT)).name == "rest"
    rule = route.choose(Features(turns=2, prompt_tokens=500))
    assert (rule.name, rule.model, rule.tier) == ("rest", "small", Tier.DEFAULT)


features = st.builds(Features, tier=st.sampled_from([Tier.PRIORITY, Tier.DEFAULT, Tier.FLEX]),
                     tenant=st.sampled_from(["acme", "other"]), turns=st.integers(1, 6),
                     prompt_tokens=st.integers(0, 400),
                     max_tokens=st.none() | st.integers(1, 2000), tools=st.booleans(),
                     last_user_message=st.sampled_from(["hi", "refund please", "invoice",
                                                        "it broke"]))


@settings(max_examples=300, deadline=None)
@given(features)
def test_the_chosen_rule_matches_and_no_earlier_rule_does(f):
    route = parse_routes(ROUTES, MODELS)["assistant"]
    chosen = route.choose(f)
    i = route.rules.index(chosen)
    assert chosen.matches(f)
    assert not any(r.matches(f) for r in route.rules[:i])


@pytest.mark.parametrize("routes, message", [
    ({"a": [{"model": "small", "when": {"turns_max": 1}}]}, "must have no `when`"),
    ({"a": [{"model": "medium"}]}, "is not served here"),
    ({"a": [{"model": "small", "tier": "gold"}]}, "tier must be one of"),
    ({"a": [{"model": "small", "when": {"colour": 1}}, {"model": "large"}]},
     "unknown condition 'colour'"),
    ({"a": [{"model": "small", "when": {"regex": "("}}, {"model": "large"}]}, "bad regex"),
    ({"small": [{"model": "small"}]}, "also a model's name"),
    ({"a": []}, "non-empty list"),
    ({"a": [{"model": "small", "escalate": {"model": "small"}}]}, "same model"),
    ({"a": [{"model": "small", "escalate": {"model": "huge"}}]}, "escalate: expected"),
    ({"a": [{"model": "small", "escalate": {"model": "large", "when": 1}}]},
     "unknown field 'when'"),
])
def test_bad_routes_are_refused_with_a_message_naming_the_problem(routes, message):
    with pytest.raises(ConfigError, match=message):
        parse_routes(routes, MODELS)


def test_a_score_rule_without_a_classifier_says_so():
    route = parse_routes({"a": [{"model": "large", "when": {"score_min": 0.5}},
                                {"model": "small"}]}, MODELS)["a"]
    with pytest.raises(ConfigError, match="needs a classifier"):
        route.choose(Features())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("route")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in workload(400, seed=1)))
    assert main(["route", "train", "--data", str(data), "--out", str(root / "r.joblib")]) == 0
    return Classifier.load(str(root / "r.joblib"))


def test_the_trained_router_agrees_with_scikit_learn_and_routes_held_out_requests(trained):
    held_out = workload(300, seed=7, label_noise=0.0)
    texts = [example_text(x) for x in held_out]
    reference = trained.model.predict_proba(texts)[:, 1]
    ours = [trained.score_text(t) for t in texts]
    assert max(abs(a - b) for a, b in zip(reference, ours)) < 1e-9
    right = sum((p >= 0.5) == (x["label"] == "hard") for p, x in zip(ours, held_out))
    assert right / len(held_out) > 0.9


def test_score_rules_route_by_the_classifier(trained):
    route = parse_routes({"a": [{"name": "hard", "model": "large", "when": {"score_min": 0.5}},
                                {"name": "easy", "model": "small"}]}, MODELS)["a"]
    hard = Features(turns=3, last_user_message="I tried that, it still slips under load.")
    easy = Features(turns=1, last_user_message="What are your opening hours on Sunday?")
    assert route.choose(hard, trained.score).name == "hard"
    assert route.choose(easy, trained.score).name == "easy"


def test_route_train_refuses_examples_with_one_label(tmp_path, capsys):
    data = tmp_path / "one.jsonl"
    data.write_text('{"text": "hi", "label": "simple"}\n' * 5)
    assert main(["route", "train", "--data", str(data), "--out", str(tmp_path / "x")]) == 1
    assert "both labels" in capsys.readouterr().err
