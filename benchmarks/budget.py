"""Budget overshoot under concurrency: see tierserve.bench.budget.

    python benchmarks/budget.py [--concurrency 64] [--budget-usd 0.0001] [--max-tokens 64]
"""

from tierserve.bench.budget import main

if __name__ == "__main__":
    main()
