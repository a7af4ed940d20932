"""Side-by-side summary of two runs (the summary.json of train_lightning.py, or the --json of
train_torchrun.py): `make demo` prints it."""

import json
import sys


def _ms(run: dict, stage: str) -> str:
    seconds = run["mean_step_s"].get(stage)
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def main(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    rows = [
        ("final validation loss", lambda r: f"{r['final_val_loss']:.4f}"),
        ("bytes sent per rank (MiB)", lambda r: f"{r['bytes_sent'] / 2**20:.2f}"),
        ("fp32 allreduce would send (MiB)", lambda r: f"{r['dense_bytes'] / 2**20:.2f}"),
        ("compression-stage reduction", lambda r: (
            f"{1 - r['compression_stage_bytes'] / r['compression_stage_dense_bytes']:.2%}"
            if r["compression_stage_dense_bytes"] else "-")),
        ("mean step time, warm-up (ms)", lambda r: _ms(r, "warmup")),
        ("mean step time, compression (ms)", lambda r: _ms(r, "compression")),
    ]
    names = [r["optimizer"] + (f" w{r['warmup_bits']}" if r.get("warmup_bits", 32) != 32 else "")
             for r in runs]
    print()
    print(f"{'':34s}" + "".join(f"{n:>14s}" for n in names))
    for label, fmt in rows:
        print(f"{label:34s}" + "".join(f"{fmt(r):>14s}" for r in runs))
    base = runs[0]
    for r in runs:
        if r.get("strategy") == "ddp":
            print(f"({r['optimizer']}: bytes computed for DDP's fp32 ring allreduce of "
                  f"{r['parameters']:,} gradients per step; DDP does not count them)")
    print()
    for name, other in zip(names[1:], runs[1:], strict=True):
        print(f"{name} vs {names[0]}: validation loss "
              f"{other['final_val_loss'] / base['final_val_loss'] - 1:+.2%}, bytes sent "
              f"{base['bytes_sent'] / other['bytes_sent']:.2f}x less")


if __name__ == "__main__":
    main(sys.argv[1:])
