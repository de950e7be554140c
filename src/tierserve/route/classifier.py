"""A small learned router: P(hard) of a request from its last user message and its length
in turns, trained from labelled examples with `tierserve route train`.

scikit-learn's TF-IDF (word and character n-grams) and logistic regression: a linear
model over sparse n-grams is what RouteLLM-style routers start from, it trains in seconds
on a CPU from a few hundred examples, and scoring one request is a sparse dot product.
scikit-learn is the well-kept library for exactly this; a neural router would need a GPU
budget per request that the small model is there to save.

Examples are JSON lines: `{"text": "...", "label": "hard"}` or `{"messages": [...],
"label": "simple"}`; labels are `hard` (send to the large model) or `simple`.
The model is saved with joblib (scikit-learn's own format): load only files you trust.
"""

import json
import math
import time
from pathlib import Path

from tierserve.errors import ConfigError

LABELS = ("simple", "hard")


def as_text(turns: int, last_user_message: str) -> str:
    """The classifier's input: the turn count as a token of its own, then the message."""
    return f"__turns_{min(turns, 8)}__ {last_user_message}"


def example_text(example: dict) -> str:
    if "messages" in example:
        users = [m for m in example["messages"] if m.get("role") == "user"]
        last = users[-1].get("content", "") if users else ""
        if isinstance(last, list):  # content parts
            last = " ".join(p.get("text", "") for p in last if isinstance(p, dict))
        return as_text(len(users), str(last))
    return as_text(int(example.get("turns", 1)), str(example["text"]))


def read_examples(path: str) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    if not Path(path).is_file():
        raise ConfigError(f"no examples file {path!r}")
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not JSON: {exc.msg}") from None
            if not isinstance(ex, dict) or ex.get("label") not in LABELS or \
                    not ("text" in ex or "messages" in ex):
                raise ConfigError(f"{path}:{n}: expected {{\"text\" or \"messages\", "
                                  f"\"label\": \"simple\" | \"hard\"}}")
            texts.append(example_text(ex))
            labels.append(LABELS.index(ex["label"]))
    if len(set(labels)) < 2:
        raise ConfigError(f"{path}: needs examples of both labels (simple and hard)")
    return texts, labels


def build():
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline, make_union

    features = make_union(
        TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1),
        TfidfVectorizer(analyzer="char_wb", ngram_range=(3, 5), sublinear_tf=True, min_df=2))
    return make_pipeline(features, LogisticRegression(C=4.0, max_iter=1000))


def train(path: str, out: str, folds: int = 5, seed: int = 0) -> dict:
    """Fit on every example, after a `folds`-fold cross-validated accuracy; save to `out`."""
    import joblib
    from sklearn.model_selection import StratifiedKFold, cross_val_score

    texts, labels = read_examples(path)
    folds = max(2, min(folds, min(labels.count(0), labels.count(1))))
    cv = StratifiedKFold(folds, shuffle=True, random_state=seed)
    scores = cross_val_score(build(), texts, labels, cv=cv)
    model = build().fit(texts, labels)
    joblib.dump(model, out)
    router = Classifier(model)
    start = time.perf_counter()
    for text in texts[:200]:
        router.score_text(text)
    per = (time.perf_counter() - start) / min(len(texts), 200)
    return {"examples": len(texts), "hard": sum(labels), "folds": folds,
            "cv_accuracy": float(scores.mean()), "cv_accuracy_std": float(scores.std()),
            "score_ms": 1000 * per, "out": out}


class Classifier:
    def __init__(self, model):
        self.model = model
        union, lr = model.steps[0][1], model.steps[-1][1]
        coef, offset = lr.coef_.ravel(), 0
        self._bias = float(lr.intercept_[0])
        self._parts = []
        for _, vec in union.transformer_list:
            size = len(vec.vocabulary_)
            # per n-gram: idf x its coefficient, and idf alone (for the l2 norm)
            table = {term: (float(vec.idf_[i]) * float(coef[offset + i]), float(vec.idf_[i]))
                     for term, i in vec.vocabulary_.items()}
            self._parts.append((vec.build_analyzer(), table))
            offset += size

    @classmethod
    def load(cls, path: str) -> "Classifier":
        import joblib

        if not Path(path).is_file():
            raise ConfigError(f"route classifier {path!r} not found (train one with "
                              "`tierserve route train`)")
        return cls(joblib.load(path))

    def score_text(self, text: str) -> float:
        """P(hard), computed as the pipeline would (sublinear TF x IDF, l2 per vectorizer,
        then the linear model) from plain dicts: scikit-learn's own transform of a single
        document costs over a millisecond in sparse-matrix set-up; this costs a tenth."""
        z = self._bias
        for analyze, table in self._parts:
            counts: dict = {}
            for term in analyze(text):
                if term in table:
                    counts[term] = counts.get(term, 0) + 1
            dot = norm = 0.0
            for term, n in counts.items():
                tf = 1.0 + math.log(n)
                weighted, idf = table[term]
                dot += tf * weighted
                norm += (tf * idf) ** 2
            if norm:
                z += dot / math.sqrt(norm)
        return 1.0 / (1.0 + math.exp(-z))

    def score(self, features) -> float:
        return self.score_text(as_text(features.turns, features.last_user_message))
