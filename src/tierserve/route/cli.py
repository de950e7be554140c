"""`tierserve route train|examples`: the learned router's command line."""

import json
import sys


def cmd_train(args) -> int:
    from tierserve.route.classifier import train

    r = train(args.data, args.out, folds=args.folds, seed=args.seed)
    print(f"route train: {r['examples']} examples ({r['hard']} hard), {r['folds']}-fold "
          f"accuracy {r['cv_accuracy']:.3f} +- {r['cv_accuracy_std']:.3f}, scoring "
          f"{r['score_ms'] * 1000:.0f} us per request; saved {r['out']}")
    return 0


def cmd_examples(args) -> int:
    from tierserve.route.conversations import workload

    out = open(args.out, "w") if args.out != "-" else sys.stdout
    for ex in workload(args.n, seed=args.seed, hard_share=args.hard_share):
        out.write(json.dumps(ex) + "\n")
    if out is not sys.stdout:
        out.close()
    return 0


def add_parsers(sub) -> None:
    route = sub.add_parser("route", help="the learned router of `routes:` rules (score_min): "
                           "train it from labelled examples")
    rsub = route.add_subparsers(dest="route_command", required=True)
    tr = rsub.add_parser("train", help="train the classifier from labelled JSON lines "
                         '({"text" or "messages", "label": "simple" | "hard"}); prints the '
                         "cross-validated accuracy")
    tr.add_argument("--data", required=True, help="labelled examples, JSON lines")
    tr.add_argument("--out", default="router.joblib", help="where to save the model "
                    "(default router.joblib; `route_classifier:` in the YAML loads it)")
    tr.add_argument("--folds", type=int, default=5, help="cross-validation folds (default 5)")
    tr.add_argument("--seed", type=int, default=0)
    tr.set_defaults(func=cmd_train)
    ex = rsub.add_parser("examples", help="write the seeded customer-service workload as "
                         "labelled examples (what benchmarks/hybrid.py serves)")
    ex.add_argument("--n", type=int, default=600)
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--hard-share", type=float, default=0.3)
    ex.add_argument("--out", default="-", help="file, or - for stdout (default)")
    ex.set_defaults(func=cmd_examples)
