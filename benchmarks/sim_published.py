"""The simulator's step times against published vLLM sweeps of an 8B Llama (issue 13, item 6).

    python benchmarks/sim_published.py [--data benchmarks/data/published_vllm_sweeps.csv]
                                       [--max-num-seqs 256] [--max-num-batched-tokens 2048]
                                       [--verbose]

Each row of --data is one published `benchmark_serving.py` run on one GPU: N ShareGPT prompts
sent at once (request rate inf, so N is the concurrency the server starts with and drains
from), their output throughput and median TPOT. The simulator replays the same N requests:
all arriving at t=0, with the prompt and output lengths of lambda_sharegpt_lengths.csv (the
lengths those runs logged; the first N of them, as the benchmark samples the same prompts in
the same order for every N), on the hardware profile named in the row, llama-3-8b shape,
vLLM's default scheduler limits (fcfs, 256 sequences, 2048 tokens a step). Prints one line:
median and max absolute percentage error of output throughput and of median TPOT, apart for
the `fit` and `holdout` rows (the holdout rows were chosen before any error was seen: the two
largest bursts on each GPU). --verbose adds a per-row table. Deterministic: no sampling.
"""

import argparse
import csv
import sys
from pathlib import Path

from tierserve.config import SchedulerConfig
from tierserve.model.metadata import resolve
from tierserve.sim.fleet import machine_for
from tierserve.sim.loop import Simulator
from tierserve.sim.report import summarize
from tierserve.tables import table
from tierserve.sim.workload import SimRequest

DATA = Path(__file__).resolve().parent / "data"
MODEL = "llama-3-8b"


def load_lengths(path: Path) -> list[tuple[int, int]]:
    with open(path, newline="") as f:
        return [(int(r["input_len"]), int(r["output_len"])) for r in csv.DictReader(f)]


def simulate(row: dict, lengths: list[tuple[int, int]], max_num_seqs: int,
             max_num_batched_tokens: int) -> tuple[float, float]:
    """(output tok/s, median TPOT s) of the row's burst, simulated."""
    m = machine_for(resolve(MODEL), row["hardware"])
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, policy="fcfs")
    sim = Simulator(config, m.num_blocks, m.block_size, m.max_model_len, m.model,
                    m.price_per_hour)
    # A logged output of 0 tokens still ran a prefill and sampled one token.
    burst = [SimRequest(0.0, "default", max(1, p), max(1, o))
             for p, o in lengths[:int(row["num_prompts"])]]
    s = summarize(sim.run(burst))
    return s["throughput_tok_s"], s["tiers"]["default"]["tpot_p50_s"]


def ape(predicted: float, published: float) -> float:
    return abs(predicted - published) / published


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DATA / "published_vllm_sweeps.csv")
    p.add_argument("--lengths", type=Path, default=DATA / "lambda_sharegpt_lengths.csv")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--verbose", action="store_true", help="also print a per-row table")
    args = p.parse_args(argv)
    lengths = load_lengths(args.lengths)
    with open(args.data, newline="") as f:
        rows = list(csv.DictReader(f))
    errors = {"fit": {"tput": [], "tpot": []}, "holdout": {"tput": [], "tpot": []}}
    lines = []
    for row in rows:
        tput, tpot = simulate(row, lengths, args.max_num_seqs, args.max_num_batched_tokens)
        pub_tput, pub_tpot = float(row["output_tok_s"]), float(row["median_tpot_ms"]) / 1e3
        e_tput, e_tpot = ape(tput, pub_tput), ape(tpot, pub_tpot)
        errors[row["split"]]["tput"].append(e_tput)
        errors[row["split"]]["tpot"].append(e_tpot)
        lines.append((row["hardware"], row["num_prompts"], row["split"], f"{pub_tput:.0f}",
                      f"{tput:.0f}", f"{(tput - pub_tput) / pub_tput:+.1%}",
                      f"{pub_tpot * 1e3:.1f}", f"{tpot * 1e3:.1f}",
                      f"{(tpot - pub_tpot) / pub_tpot:+.1%}"))
    cells = []
    for split, errs in errors.items():
        for metric, es in errs.items():
            if es:
                es = sorted(es)
                cells.append(f"{split} {metric} median {es[len(es) // 2]:.1%} max {es[-1]:.1%}")
    print(f"sim_published data={args.data.name} rows={len(rows)} model={MODEL} "
          f"max_num_seqs={args.max_num_seqs} max_num_batched_tokens="
          f"{args.max_num_batched_tokens} metric=APE of output tok/s and median TPOT vs "
          f"published vLLM | " + " | ".join(cells), flush=True)
    if args.verbose:
        head = ("hardware", "N", "split", "pub tok/s", "sim tok/s", "err", "pub TPOT ms",
                "sim TPOT ms", "err")
        print("\n".join(table(head, lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
