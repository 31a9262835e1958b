# `make demo` and `make test` each bootstrap .venv from nothing (python3 -m venv + pip),
# then run the main job / the whole suite. `make proto` regenerates the protobuf code.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint proto bench shim engines clean

SHIM := cuda_hooks/shim/libkvguard_shim.so
LABEL := cuda_hooks/shim/libkvguard_label.so

# setup.py builds the C extensions (proto/_wire.c; ledger/_pages.c with runs.c and tags.c; daemon/_rows.c)
# into the tree (pip install -e).
EXTENSIONS := proto/wire.h proto/_wire.c ledger/pages.h ledger/_pages.c ledger/runs.c ledger/tags.c daemon/_rows.c
$(STAMP): pyproject.toml setup.py $(EXTENSIONS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

# `make demo TOP=1`: the same, watched on the dashboard (kvguard top) until it is quit.
demo: $(STAMP) shim
	$(BIN)/kvguard demo $(if $(TOP),--top)

# The rule fixtures (`kvguard rules test`) run inside pytest (tests/ruleset/). Two workers,
# each taking whole test files (a file's fixtures and services stay in one process): most
# tests wait on real processes and sockets, so two overlap well even on two cores.
test: lint shim engines
	$(BIN)/python -m pytest -n 2 --dist loadfile

# The real engines the adapters' tests drive: SGLang and vLLM from PyPI at pinned versions,
# each in its own venv beside the local CPU torch, with this checkout of kvguard linked in
# (.ci/engines/README.md). A few minutes the first time; nothing to do after.
ENGINES := .engines
ENGINE_STAMP := $(ENGINES)/.installed-stamp
engines: $(ENGINE_STAMP)

$(ENGINE_STAMP): $(STAMP) .ci/engines/install-engines.sh .ci/engines/link-kvguard.sh $(wildcard .ci/engines/*.txt .ci/engines/*_stub*.py)
	.ci/engines/install-engines.sh $(ENGINES) .ci/engines
	.ci/engines/link-kvguard.sh $(ENGINES) .
	touch $@

# Style, formatting, the layers of the parts (import-linter contracts in pyproject.toml), and
# types (mypy, [tool.mypy] in pyproject.toml), checked by package name: the repository root is
# the package kvguard, which mypy finds through the link build/mypy/kvguard (its mypy_path).
MYPY_PACKAGES := kvguard.proto kvguard.ledger kvguard.agents.guard kvguard.sinks
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	mkdir -p build/mypy && ln -sfn ../.. build/mypy/kvguard
	$(BIN)/mypy $(addprefix -p ,$(MYPY_PACKAGES))

# The LD_PRELOAD shim that counts an engine's CUDA copies and witnesses its allocations and
# kernel launches (cuda_hooks/shim/kvguard_*.c), and
# the transfer-naming library whose calls the eBPF witness probes (kvguard_label.c).
shim: $(SHIM) $(LABEL)

SHIM_SOURCES := $(wildcard cuda_hooks/shim/kvguard_*.c)
$(SHIM): $(filter-out cuda_hooks/shim/kvguard_label.c,$(SHIM_SOURCES)) cuda_hooks/shim/record.h cuda_hooks/shim/shim.h
	$(CC) -O2 -Wall -Wextra -Werror -fPIC -shared -o $@ $(filter %.c,$^) -ldl -lpthread

$(LABEL): cuda_hooks/shim/kvguard_label.c
	$(CC) -O2 -Wall -Wextra -Werror -fPIC -shared -o $@ $<

proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP)
	$(BIN)/python bench/ledger.py
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) $(ENGINES) .pytest_cache .ruff_cache .mypy_cache .hypothesis $(SHIM) $(LABEL) proto/_wire*.so ledger/_pages*.so daemon/_rows*.so build
