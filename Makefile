# One-command set-up and tests on a machine with no GPU (see README.md).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The package itself (editable), rebuilt when the native kernels' sources change.
PACKAGE := $(VENV)/.package
NATIVE_SOURCES := setup.py $(wildcard csrc/*.cpp csrc/*.h)

# CPU dependency set: torch's CPU build, fbgemm's CPU build, and torchrec
# without its pin on the CUDA fbgemm-gpu (installed with --no-deps, then its needs).
TORCH := torch==2.13.0
FBGEMM := fbgemm-gpu-cpu==1.8.0
TORCHREC := torchrec==1.9.2
TORCHREC_NEEDS := tensordict torchmetrics==1.0.3 tqdm pyre-extensions
TOOLS := triton==3.9.0 numpy pytest ruff matplotlib

.PHONY: install test lint format demo demo-seq bench clean gpu-wheels test-gpu bench-gpu

install: $(STAMP) $(PACKAGE)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q $(FBGEMM)
	$(BIN)/python -m pip install -q --no-deps $(TORCHREC)
	$(BIN)/python -m pip install -q $(TORCHREC_NEEDS) $(TOOLS)
	touch $(STAMP)

# Builds csrc/ into torchrec_kvemb/_kvemb_native*.so (setup.py; optional: without
# a C++ compiler the package installs and the torch path runs, docs/native.md).
$(PACKAGE): $(STAMP) pyproject.toml $(NATIVE_SOURCES)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m torchrec_kvemb.native_lib
	touch $(PACKAGE)

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The DLRM job on 2 processes (gloo), then the world-size-1 reload of its checkpoint
# (examples/train_dlrm.py; its flags scale it up).
DEMO_DIR ?= demo_out
DEMO_FLAGS ?=

demo: install
	@start=$$(date +%s); \
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 \
		examples/train_dlrm.py --workdir $(DEMO_DIR) $(DEMO_FLAGS) && \
	echo "make demo: done in $$(( $$(date +%s) - start )) s (outputs in $(DEMO_DIR)/)"

# The sequence model (KV EmbeddingCollection) on 2 processes, then its world-size-1
# reload (examples/train_sequence.py; e.g. DEMO_FLAGS="--weights-dtype float16").
SEQ_DEMO_DIR ?= demo_seq_out

demo-seq: install
	@start=$$(date +%s); \
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 \
		examples/train_sequence.py --workdir $(SEQ_DEMO_DIR) $(DEMO_FLAGS) && \
	echo "make demo-seq: done in $$(( $$(date +%s) - start )) s (outputs in $(SEQ_DEMO_DIR)/)"

bench: install
	OMP_NUM_THREADS=2 $(BIN)/python -m benchmarks.run

# GPU mode (docs/gpu.md), on a machine with a CUDA GPU and its own torch and triton
# (no .venv: the machine's $(GPU_PY) runs everything). TorchRec and FBGEMM's CPU
# build come from $(GPU_WHEELS)/ where they do not import (`make gpu-wheels`, run
# where PyPI is reachable, fills it); the package is installed editable into $(GPU_PY).
# Without a CUDA GPU both targets print why and exit 0.
GPU_PY ?= python3
GPU_WHEELS ?= gpu_wheels
BENCH_GPU_OUT ?= out/bench-gpu.md
BENCH_GPU_FLAGS ?=

define GPU_GUARD
ok=$$($(GPU_PY) -c 'import torch; print("ok" if torch.cuda.is_available() else "torch.cuda.is_available() is False")' 2>/dev/null | tail -n 1); \
if [ "$$ok" != ok ]; then \
	echo "make $@: no CUDA GPU here ($${ok:-no torch importable by $(GPU_PY)}): nothing to run"; \
	exit 0; \
fi
endef

define GPU_SETUP
GPU_WHEELS_DIR=$(GPU_WHEELS) scripts/gpu_wheels.sh install $(GPU_PY) && \
$(GPU_PY) -m pip install -q --no-deps --no-build-isolation -e . && \
$(GPU_PY) -c 'import torch, triton, fbgemm_gpu, torchrec.distributed, importlib.metadata as m; \
print("make $@:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", \
triton.__version__, "| torchrec", m.version("torchrec"), "| fbgemm_gpu", fbgemm_gpu.__version__)'
endef

gpu-wheels:
	GPU_WHEELS_DIR=$(GPU_WHEELS) scripts/gpu_wheels.sh download

# Every test that takes the `device` fixture, on cuda, the Triton kernels compiled
# (tests/conftest.py: KVEMB_TEST_DEVICE=cuda drops TRITON_INTERPRET).
test-gpu:
	@$(GPU_GUARD); \
	$(GPU_SETUP) && \
	env -u TRITON_INTERPRET KVEMB_TEST_DEVICE=cuda $(GPU_PY) -m pytest -q -m device tests

# benchmarks.gpu_kernels on cuda: Triton kernels and KV EBC against torch's
# EmbeddingBag, a stock EmbeddingBagCollection and the copy bandwidth (and FBGEMM's
# fused tables where its CUDA build imports); the report also goes to $(BENCH_GPU_OUT).
bench-gpu:
	@$(GPU_GUARD); \
	$(GPU_SETUP) && \
	mkdir -p $(dir $(BENCH_GPU_OUT)) && \
	env -u TRITON_INTERPRET $(GPU_PY) -m benchmarks.gpu_kernels --out $(BENCH_GPU_OUT) $(BENCH_GPU_FLAGS)

clean:
	rm -rf $(VENV) build *.egg-info torchrec_kvemb/_kvemb_native*.so
