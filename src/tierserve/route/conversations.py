"""A seeded customer-service workload: first turns and simple questions (label `simple`)
and multi-turn hard problems and ticket summaries (label `hard`), as chat requests.

The story in docs/design.md: a support assistant for a shop. Simple turns are greetings,
thanks, opening hours, where an order is; hard ones are troubleshooting over several
turns, disputed refunds and summaries of long tickets. The phrasing is drawn from
templates with random slots, so a router cannot learn one sentence per class; some simple
questions mention words hard ones use (a refund policy question is simple), so keyword
rules alone do not reach perfect accuracy.
"""

import random

PRODUCTS = ["road bike", "e-bike battery", "helmet", "rear derailleur", "tubeless tyre",
            "bike light", "disc brake", "kids' bike", "chain", "saddle"]
NAMES = ["Ana", "Ben", "Chen", "Dana", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jo"]

SIMPLE = [
    "Hi!", "Hello there", "Good morning :)", "Thanks, that's all.", "Thank you so much!",
    "What are your opening hours on {day}?", "Do you ship to {country}?",
    "Where is my order {order}?", "Is the {product} in stock?",
    "What's your refund policy?", "How long does delivery take?",
    "Can I pick up my {product} in store?", "Do you sell gift cards?",
    "What's the price of the {product}?", "Hey, quick question: do you have a {product}?",
    "Is order {order} shipped yet?", "Bye!", "ok great", "Which payment methods do you take?",
    "My order {order} hasn't arrived yet and it's been {weeks} weeks, can you check where "
    "it is and when it will get here?",
    "Could you tell me whether the {product} and the {product2} fit the same bike?",
]
HARD_FIRST = [
    "My {product} stopped working after {weeks} weeks. I already tried resetting it and "
    "charging it overnight, but it still {symptom}. What should I do?",
    "I was charged twice for order {order} and the second charge is still pending after "
    "{weeks} weeks. Your chat bot said it would be refunded but nothing happened.",
    "Please summarise this ticket for the repair team: customer {name} reports that the "
    "{product} {symptom}; replaced once under warranty in {month}; now the same fault "
    "again, wants a full refund instead of another repair, and is unhappy about the "
    "{weeks}-week wait.",
    "The {product} I received is not the model I ordered, the box was damaged, and the "
    "invoice shows a different price than the checkout page. How do we sort all of this?",
    "I need to compare the {product} and the {product2} for a {km} km daily commute in "
    "the rain, with a budget of {budget} euros. Which one and why?",
]
HARD_SHORT = ["It's broken again.", "Refund. Now.", "Same problem as last time with the {product}.",
              "Why was I charged for order {order}?"]
"""Hard problems stated in a few words: what keyword rules and length limits miss."""
HARD_FOLLOW = [
    "I tried that, it still {symptom}.", "That didn't help. What else can I check?",
    "The warranty says {months} months but you are telling me it's expired?",
    "Can you explain step by step how to adjust it myself?",
    "And what if the replacement also {symptom}? I don't want a third repair.",
]
SYMPTOMS = ["makes a grinding noise", "won't hold a charge", "slips under load",
            "flickers at night", "loses pressure overnight", "shows error E{code}"]
DAYS = ["Saturday", "Sunday", "a public holiday", "Monday"]
COUNTRIES = ["Portugal", "Norway", "Canada", "Japan"]
MONTHS = ["March", "June", "October"]


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        day=rng.choice(DAYS), country=rng.choice(COUNTRIES), product=rng.choice(PRODUCTS),
        product2=rng.choice(PRODUCTS), order=f"#{rng.randint(10000, 99999)}",
        weeks=rng.randint(2, 9), symptom=rng.choice(SYMPTOMS).format(code=rng.randint(1, 40)),
        name=rng.choice(NAMES), month=rng.choice(MONTHS), km=rng.randint(5, 40),
        budget=rng.randint(4, 30) * 100, months=rng.choice([12, 24, 36]))


def conversation(rng: random.Random, hard: bool) -> list[dict]:
    """The messages of one request (a whole conversation so far, ending in a user turn)."""
    system = {"role": "system", "content": "You are the support assistant of a bike shop. "
                                           "Answer briefly and politely."}
    if not hard:
        turns = 1 if rng.random() < 0.7 else 2
        msgs = [system]
        for _ in range(turns - 1):
            msgs += [{"role": "user", "content": _fill(rng.choice(SIMPLE), rng)},
                     {"role": "assistant", "content": "Happy to help!"}]
        return msgs + [{"role": "user", "content": _fill(rng.choice(SIMPLE), rng)}]
    first = HARD_SHORT if rng.random() < 0.15 else HARD_FIRST
    msgs = [system, {"role": "user", "content": _fill(rng.choice(first), rng)}]
    for _ in range(rng.choice([0, 1, 2, 3])):
        msgs += [{"role": "assistant", "content": "Could you try the following: check the "
                  "connections, update the firmware, and tell me what you see."},
                 {"role": "user", "content": _fill(rng.choice(HARD_FOLLOW), rng)}]
    return msgs


def workload(n: int, seed: int = 0, hard_share: float = 0.3,
             label_noise: float = 0.03) -> list[dict]:
    """`n` labelled requests: {"messages": [...], "label": "simple" | "hard"}. A share
    `label_noise` of labels is flipped, as when annotators disagree."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hard = rng.random() < hard_share
        msgs = conversation(rng, hard)
        if rng.random() < label_noise:
            hard = not hard
        out.append({"messages": msgs, "label": "hard" if hard else "simple"})
    return out
