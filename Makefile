# Two commands: `make demo` (the main job) and `make test`. Each creates .venv when missing and
# installs what it needs. torch is pinned to 2.13.0: that CPU build lies on this machine's disk,
# while an unpinned torch would download a CUDA build of several GB.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
DEMO_DIR ?= demo_out

.PHONY: install demo test test-quick lint mutants bench fidelity fidelity-long soak clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The main job: Trainer(strategy="onebit_adam") on NPROC CPU processes next to DDP + Adam, then
# with its warm-up sent as int8 (warmup_bits=8).
demo: $(STAMP)
	$(PY) examples/train_lightning.py --devices $(NPROC) --out $(DEMO_DIR)/onebit
	$(PY) examples/train_lightning.py --devices $(NPROC) --optimizer adam --out $(DEMO_DIR)/adam
	$(PY) examples/train_lightning.py --devices $(NPROC) --warmup-bits 8 --out $(DEMO_DIR)/onebit_w8
	$(PY) examples/summarize.py $(DEMO_DIR)/adam/summary.json $(DEMO_DIR)/onebit/summary.json \
		$(DEMO_DIR)/onebit_w8/summary.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Two workers, one test file each (--dist loadfile keeps a file's module fixtures in one process):
# most of the suite's time is single-core imports of torch and Lightning in launched ranks, so two
# files at a time on 2 cores took the suite from 601 s to 340 s (453 s with the 220 tests added
# since). TEST_WORKERS=0: serially.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10

# The single-process tests (-m "not multiprocess": 500 of 615, 2026-12-02; conftest.py marks every
# test that starts processes, and fails an unmarked one that does): 13 s on this 2-core machine
# (21 s on a cold file cache), in one process: -n 2 took as long (14 s), its two workers'
# start and imports cost what the second core saves. `make test` still runs all of them.
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not multiprocess" --durations=5

# Mutation check (not part of `make test`): each mutant of tests/mutants.py (a deliberate defect)
# applied alone to a temporary copy of the tree, with the tests that must fail under it; the
# tests run unmutated first. Prints the table; exits non-zero unless every mutant is killed.
# ARGS="NAME ..." runs some of them; ARGS=--list lists them.
mutants: $(STAMP)
	$(PY) tests/mutants.py $(ARGS)

# Benchmarks (about an hour on 2 cores): kernel throughput, the optimizer step against
# Adam's, the compressed allreduce's collectives, the emulated 4-host 1 Gbit/s cluster
# (network namespaces: run as root; otherwise loopback, and it says so) for a
# communication-bound and a compute-bound workload (three round-robin rounds: its differences
# are within one run's drift), the same paths' steps interleaved step by step in one job (what
# tells a few per cent apart here), the accuracy ablations, and peak memory per rank against
# Adam's (docs/memory.md).
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) benchmarks/compression_throughput.py
	$(PY) benchmarks/quantized_warmup.py
	$(PY) benchmarks/step_cost.py
	$(PY) benchmarks/collective_patterns.py
	$(PY) benchmarks/cluster.py --workload comm
	$(PY) benchmarks/cluster.py --workload compute --repeats 3
	$(PY) benchmarks/paired_steps.py --workload comm
	$(PY) benchmarks/paired_steps.py --workload compute
	benchmarks/accuracy.sh
	$(PY) benchmarks/memory.py

# Accuracy against bytes (about 40 minutes on 2 cores): Adam, 1-bit Adam (fixed freeze and
# freeze_step="auto"), fp16 and PowerSGD on a char-level GPT, a word-embedding model and
# scikit-learn's digits, 3 seeds, 2 gloo ranks, and 1-bit with clipping, with bf16 parameters
# and with bf16 errors; then 1-bit LAMB against LAMB and Adam at a global batch of 4,096
# (1,047 s on 2 cores, 2026-12-03), and against LAMB at LAMB's better lr, 0.005, with its two
# ablations (1,108 s); then warmup_bits 16 and 8 beside 32 for 1-bit Adam and 1-bit LAMB on the
# three workloads and 1-bit LAMB at 8 on the large batch; tables and plots in docs/benchmarks.md.
fidelity: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) benchmarks/fidelity.py
	$(PY) benchmarks/fidelity.py --workloads large_batch --plot docs/fidelity_lamb_loss_vs_bytes.png \
		--variants lamb,onebit_lamb,adam_lr1e-3,adam_lr3e-3,adam_lr1e-2
	$(PY) benchmarks/fidelity.py --workloads large_batch --lr 0.005 \
		--plot docs/fidelity_lamb_lr005_loss_vs_bytes.png \
		--variants lamb,onebit_lamb,onebit_lamb_exact,onebit_lamb_unbounded
	$(PY) benchmarks/fidelity.py --plot docs/fidelity_warmup_bits_loss_vs_bytes.png \
		--variants adam,onebit_auto,onebit_auto_w16,onebit_auto_w8,lamb,onebit_lamb,onebit_lamb_w16,onebit_lamb_w8
	$(PY) benchmarks/fidelity.py --workloads large_batch --lr 0.005 \
		--plot docs/fidelity_lamb_w8_loss_vs_bytes.png --variants lamb,onebit_lamb,onebit_lamb_w16,onebit_lamb_w8

# 0/1 Adam against Adam and 1-bit Adam over 2,000 steps (about 35 minutes on 2 cores, estimated
# from its runs' times): the same three workloads, 3 seeds, 2 gloo ranks; defaults, syncs every
# step, intervals of 16 early and up to 64; then the defaults at warmup_bits=8 (about 12 minutes);
# then the wider workloads at the defaults (1,169 s on 2 cores, 2026-12-06) and 0/1 Adam's
# ablations on char_mlp (830 s); tables and plots in docs/benchmarks.md.
fidelity-long: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) benchmarks/fidelity.py --steps 2000 --variants adam,onebit_auto,zero_one,zero_one_sync_every_step,zero_one_local16_early,zero_one_local64 --plot docs/fidelity_zero_one_loss_vs_bytes.png
	$(PY) benchmarks/fidelity.py --steps 2000 --variants adam,zero_one,zero_one_w16,zero_one_w8 \
		--plot docs/fidelity_zero_one_w8_loss_vs_bytes.png
	$(PY) benchmarks/fidelity.py --steps 2000 --workloads wider --variants adam,zero_one,onebit_auto \
		--plot docs/fidelity_wider_loss_vs_bytes.png
	$(PY) benchmarks/fidelity.py --steps 2000 --workloads char_mlp \
		--variants adam,zero_one_exact_sync,zero_one_freeze400,zero_one_unbounded,zero_one_adam_phase_a,zero_one_local4,zero_one_phase_a_only,onebit_auto_exact \
		--plot docs/fidelity_char_mlp_ablations.png

soak: $(STAMP)
	$(VENV)/bin/torchrun --nproc_per_node 2 benchmarks/soak.py --steps 3000

clean:
	rm -rf $(DEMO_DIR) .pytest_cache build *.egg-info cli_out accelerate_out hf_out
