# The README's two commands: `make demo` and `make test`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# uv resolves and installs the project's 170 pinned packages in about 10 s where pip takes over
# two minutes (measured on a fresh clone, no cache); torch stays pip's: only pip looks on the
# disk that holds its CPU wheel. --compile-bytecode writes the .pyc files pip writes by default
# and uv does not: where PYTHONDONTWRITEBYTECODE is set (this machine's image), every process
# compiled jax, flax and orbax from source again (importing them with grpc and ray: 5.5 s, not
# 2 s; benchmarks/NOTES.md, "Bytecode compiled at install").
UV := $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY)
STAMP := $(VENV)/.installed

.PHONY: install test demo lint protos bench clean

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv==0.13.9
	# torch only for the tests that compare against PyTorch peers; 2.13.0 is the CPU wheel on disk.
	$(PY) -m pip install -q torch==2.13.0
	# all includes video (PyAV: a binary wheel, no compiler)
	$(UV) -c constraints.txt -e '.[all,video,dev,compare]'
	# timm's own model code for the import parity tests. --no-deps: its torchvision does not load
	# beside this torch; tests/peers.py runs timm without it.
	$(UV) --no-deps timm==1.0.31
	# open_clip's own CLIP for the OpenCLIP parity tests; --no-deps for the same torchvision.
	$(UV) --no-deps open_clip_torch==3.3.0
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers, a test file each (their module fixtures start one server per file): most
# tests wait on processes they start, so two share two cores well (benchmarks/NOTES.md, "The
# suite on two workers"). Files go out slowest first (tests/conftest.py's SLOWEST_FILES, kept
# by --no-loadscope-reorder). TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2

test: $(STAMP)
	# the project's own modules too, for the hundreds of processes the tests start (stale ones
	# are recompiled in memory, as without them)
	$(PY) -m compileall -q model server clients probes protos
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP)
	$(PY) -m vit22b.probes.demo

protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos protos/vit22b/v1/features.proto

bench: $(STAMP)
	# the runtimes the forward benchmark compares with, and the serving profiler
	$(UV) -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
