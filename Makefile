# The two set-up commands of README.md:
#   make demo   creates .venv if missing, installs torch and the package, runs the main job
#   make test   the same set-up, then pytest and the GoogleTest suite (ctest)
# and CI's check of the oldest supported torch:
#   make compat builds a copy of the tree against torch COMPAT_TORCH (in its own venv) and runs the
#               op tests and one main-job run there
# and, for maintainers (not in CI: it takes about 12 minutes on 2 cores):
#   make asan   builds a copy of the tree with AddressSanitizer (TDX_SANITIZE=address) and runs the
#               op, layer and pipeline tests under it
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.14.1
COMPAT_TORCH := 2.13.0
COMPAT_DIR := build/compat-torch$(COMPAT_TORCH)
ASAN_DIR := build/asan
NPROC ?= 4
MAX_JOBS ?= 2

.PHONY: demo test pytest ctest install bench compat asan clean

$(VENV)/.installed-deps: requirements-dev.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==$(TORCH_VERSION) -r requirements-dev.txt
	touch $@

# Incremental: ninja rebuilds only the translation units that changed.
install: $(VENV)/.installed-deps
	MAX_JOBS=$(MAX_JOBS) $(PY) -m pip install --no-build-isolation --no-deps -e .

demo: install
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) examples/train_llama.py

test: pytest ctest

pytest: install
	$(PY) -m pytest -q --durations=15

# GoogleTest comes from Debian's libgtest-dev (installed here when missing and we are root).
ctest: $(VENV)/.installed-deps
	@dpkg -s libgtest-dev >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq libgtest-dev; } \
		|| { echo "libgtest-dev is missing: apt-get install libgtest-dev" >&2; exit 1; }
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH cmake -S tests/cpp -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH cmake --build build/cpp
	ctest --test-dir build/cpp --output-on-failure

# The copy keeps this tree's extension (built against $(TORCH_VERSION)) apart from the one built here. It builds
# without CUDA: the CUDA sources include no torch headers (the main build compiles them for every architecture);
# what the older torch can break is the host code, built in full.
compat:
	mkdir -p $(COMPAT_DIR)
	find $(COMPAT_DIR) -mindepth 1 -maxdepth 1 ! -name .venv -exec rm -rf {} +
	git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C $(COMPAT_DIR)
	test -x $(COMPAT_DIR)/.venv/bin/python || $(PYTHON) -m venv $(COMPAT_DIR)/.venv
	$(COMPAT_DIR)/.venv/bin/python -m pip install torch==$(COMPAT_TORCH) -r requirements-dev.txt
	cd $(COMPAT_DIR) && MAX_JOBS=$(MAX_JOBS) TDX_CUDA=0 .venv/bin/python -m pip install --no-build-isolation --no-deps -e .
	cd $(COMPAT_DIR) && .venv/bin/python -c 'import torch; assert torch.__version__.startswith("$(COMPAT_TORCH)"), torch.__version__'
	cd $(COMPAT_DIR) && .venv/bin/python -m pytest -q tests/ops tests/test_cpu_isa.py \
		"tests/examples/test_train_llama.py::test_ledger_counts_what_the_planner_predicts_for_context_parallelism[cp2-ring-tp2]"

# torch is not built with ASan: the runtime is preloaded (with libstdc++, whose __cxa_throw it intercepts),
# Python allocates with malloc so that ASan sees every block, and leaks are not reported (Python's are many).
asan: $(VENV)/.installed-deps
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR)
	git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C $(ASAN_DIR)
	cd $(ASAN_DIR) && TDX_CUDA=0 TDX_SANITIZE=address MAX_JOBS=$(MAX_JOBS) $(CURDIR)/$(PY) setup.py -q build_ext --inplace
	cd $(ASAN_DIR) && LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libstdc++.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 PYTHONMALLOC=malloc \
		$(CURDIR)/$(PY) -m pytest -q tests/ops tests/fp8 tests/parallel tests/pipeline tests/integrations tests/test_*.py

bench: install
	$(PY) -m benchmarks.bench_tp

clean:
	rm -rf build torchdist_ext/_C*.so *.egg-info
