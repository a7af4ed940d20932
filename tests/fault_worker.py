"""One rank of a 2-rank job whose rank 1 dies or hangs in the compression stage (test_faults).

    python -m tests.fault_worker {hook,plain} {die,hang} TIMEOUT FAULT_STEP   (env: RANK, ...)

Rank 0 does not catch the error: the test checks that the process itself ends, non-zero."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit_plugin import OneBitAdam, register_onebit_hook


def main(path: str, fault: str, timeout: float, fault_step: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if path == "hook":
        model = DDP(model)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_timeout=timeout)
    if path == "hook":
        register_onebit_hook(model, opt)
    for step in range(8):
        if step == fault_step and rank == 1:
            print("FAULT", flush=True)
            if fault == "die":
                os._exit(1)
            time.sleep(3600)  # hang: the test kills this process
        start = time.monotonic()
        try:
            opt.zero_grad()
            # Each rank its own data: identical gradients on every rank would be reported
            # as averaged elsewhere.
            gen = torch.Generator().manual_seed(10 * step + rank)
            model(torch.randn(4, 8, generator=gen)).sum().backward()
            opt.step()
        except RuntimeError as exc:  # DDP re-raises a hook's CommunicationError as RuntimeError
            print(f"RAISED step={step} after={time.monotonic() - start:.2f}", flush=True)
            raise SystemExit(f"{type(exc).__name__}: {exc}") from exc
    print("FINISHED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
