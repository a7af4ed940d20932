"""How far Adam's variance moves after a freeze point: what a frozen variance misses.

Plain ``torch.optim.Adam`` in one process on a fidelity workload, each step on the mean loss of
``--ranks`` batches drawn as that many ranks would draw theirs (the averaged gradient of a data-
parallel step), for ``--steps`` steps; per tensor, the mean of ``sqrt(v_hat)`` (bias
corrected, as a frozen denominator is) at the last step against its mean at ``--freeze`` (what
1-bit Adam's ``"auto"`` freezes at on a 2,000-step run: its 20% ceiling) and at 0/1 Adam's
phase-A end (step 241 of 2,000), and the median over coordinates of the same ratio. A ratio
above 1: the gradients grew after the freeze, and a frozen denominator makes the steps larger
than Adam's (up to the step bound); below 1, smaller. Beside them, what a denominator that
follows could track per tensor (module ``onebit_plugin.core.variance_follow``; the sketch's
estimate is the only package code that runs), and what following per block of ``BLOCK`` values
leaves of each coordinate's ratio. Prints a table and appends one record to
``benchmarks/results/variance_drift.jsonl``.

    .venv/bin/python benchmarks/variance_drift.py --workload char_mlp   # about 2 min on 1 core
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import WORKLOADS  # noqa: E402
from record import append_run, shown  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from onebit_plugin.core.variance_follow import BLOCK, VarianceFollow  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="char_mlp", choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--freeze", type=int, default=400)
    p.add_argument("--phase-a-end", type=int, default=241)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    work = WORKLOADS[args.workload]()
    torch.manual_seed(args.seed)
    model = work.model()
    opt = torch.optim.Adam(model.parameters(), lr=work.lr)
    scheduler = (torch.optim.lr_scheduler.LambdaLR(opt, lambda t: work.schedule(t, args.steps))
                 if hasattr(work, "schedule") else None)
    gens = [torch.Generator().manual_seed(1000 * args.seed + r) for r in range(args.ranks)]
    marks = {args.phase_a_end, args.freeze, args.steps}
    roots: dict[int, dict[str, torch.Tensor]] = {}
    # Per tensor, what a following denominator could track (onebit_plugin.core.variance_follow),
    # each under Adam's average of its variance (b2, bias corrected): the averaged gradient's
    # mean square, exactly ("rms") and from the sketches ("sketch"), and the ranks' mean
    # |local gradient| ("l1", which each rank has alone).
    follow, b2 = VarianceFollow(), 0.999
    params = [q for q in model.parameters() if q.requires_grad]
    kinds = ("rms", "sketch", "l1")
    tracked = {k: [0.0] * len(params) for k in kinds}
    averages: dict[int, dict[str, list]] = {}
    for step in range(1, args.steps + 1):
        summed = [torch.zeros_like(q) for q in params]
        l1 = [0.0] * len(params)
        for g in gens:  # each rank's own gradient, then their mean, as DDP forms it
            opt.zero_grad()
            work.loss(model, work.batch_of(g)).backward()
            for i, q in enumerate(params):
                l1[i] += float(q.grad.abs().mean()) / args.ranks
                summed[i] += q.grad
        with torch.no_grad():
            for i, q in enumerate(params):
                q.grad = summed[i].div_(args.ranks)
                now = {"rms": float(q.grad.double().square().mean()),
                       "sketch": float(follow.summary(q.grad, step).square().sum())
                       / q.numel(), "l1": l1[i]}
                for k in kinds:
                    tracked[k][i] = (b2 * (1 - b2 ** (step - 1)) * tracked[k][i]
                                     + (1 - b2) * now[k]) / (1 - b2**step)
        if step in marks:
            averages[step] = {k: list(v) for k, v in tracked.items()}
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if step in marks:
            # Bias corrected, as the frozen denominator is (sqrt(v_hat)): uncorrected, step 400's
            # read sqrt(1 - b2**2000) / sqrt(1 - b2**400) = 1.62 times smaller than it acts.
            b2_now = opt.param_groups[0]["betas"][1]
            roots[step] = {n: (opt.state[q]["exp_avg_sq"] / (1 - b2_now**step)).sqrt()
                           for n, q in model.named_parameters() if q in opt.state}
    rows = []
    last = roots[args.steps]
    index = {n: i for i, n in enumerate(n for n, q in model.named_parameters()
                                        if q.requires_grad)}
    for name, now in last.items():
        row = {"tensor": name, "numel": now.numel()}
        for kind in ("rms", "sketch", "l1"):  # as a factor on sqrt(v): a root of the squares
            power = 1.0 if kind == "l1" else 0.5
            row[f"{kind}_ratio"] = (averages[args.steps][kind][index[name]]
                                    / averages[args.freeze][kind][index[name]]) ** power
        for label, at in (("freeze", args.freeze), ("phase_a_end", args.phase_a_end)):
            then = roots[at][name]
            row[f"mean_ratio_{label}"] = float(now.mean() / then.mean())
            seen = then > 0  # coordinates with no gradient by then have no ratio
            row[f"median_ratio_{label}"] = (float((now[seen] / then[seen]).median())
                                            if seen.any() else None)
        # What follow_variance (per block of BLOCK values) leaves: each coordinate's ratio over
        # its block's sqrt(mean v_hat) ratio, median over the coordinates seen at the freeze.
        then = roots[args.freeze][name].reshape(-1)
        flat_now = now.reshape(-1)
        blocks = [(i, min(i + BLOCK, then.numel())) for i in range(0, then.numel(), BLOCK)]
        left = torch.cat([(flat_now[a:b] / then[a:b]) / ((flat_now[a:b].square().mean()
                          / then[a:b].square().mean()).sqrt()) for a, b in blocks])
        seen = then > 0
        row["median_left_by_blocks"] = float(left[seen].median()) if seen.any() else None
        rows.append(row)
    lines = [f"{args.workload}, Adam, {args.ranks} batches a step, seed {args.seed}: sqrt(v) "
             f"at step {args.steps} against step {args.freeze} (and {args.phase_a_end})", "",
             "| tensor | values | mean ratio | median coordinate ratio | rms | sketch | l1 | "
             "median left by blocks |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        median = (f"{r['median_ratio_freeze']:.2f} ({r['median_ratio_phase_a_end']:.2f})"
                  if r["median_ratio_freeze"] is not None else "-")
        lines.append(f"| {r['tensor']} | {r['numel']:,} | {r['mean_ratio_freeze']:.2f} "
                     f"({r['mean_ratio_phase_a_end']:.2f}) | {median} | {r['rms_ratio']:.2f} | "
                     f"{r['sketch_ratio']:.2f} | {r['l1_ratio']:.2f} | "
                     f"{r['median_left_by_blocks'] or float('nan'):.2f} |")
    spread = [r["mean_ratio_freeze"] for r in rows]
    lines.append(f"\nmean ratios {min(spread):.2f}-{max(spread):.2f} "
                 f"(median over tensors {statistics.median(spread):.2f})")
    table = "\n".join(lines)
    print(table)
    path = append_run("variance_drift", None, {"workload": args.workload, "steps": args.steps,
                                               "freeze": args.freeze, "seed": args.seed,
                                               "ranks": args.ranks, "rows": rows,
                                               "table": table})
    print(f"appended the run to {shown(path)}")


if __name__ == "__main__":
    main()
