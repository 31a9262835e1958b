# `make demo` and `make test` each bootstrap .venv from nothing (python3 -m venv + pip),
# then run the main job / the whole suite. `make proto` regenerates the protobuf code.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint proto bench shim clean

SHIM := cuda_hooks/shim/libkvguard_shim.so
LABEL := cuda_hooks/shim/libkvguard_label.so

# setup.py builds the C extensions (proto/_wire.c; ledger/_pages.c with runs.c and tags.c; daemon/_rows.c)
# into the tree (pip install -e).
EXTENSIONS := proto/wire.h proto/_wire.c ledger/pages.h ledger/_pages.c ledger/runs.c ledger/tags.c daemon/_rows.c
$(STAMP): pyproject.toml setup.py $(EXTENSIONS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/kvguard demo

# The rule fixtures (`kvguard rules test`) run inside pytest (tests/ruleset/).
test: lint shim
	$(BIN)/python -m pytest

# Style, formatting, and the layers of the parts (import-linter contracts in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# The LD_PRELOAD shim that counts an engine's CUDA copies (cuda_hooks/shim/kvguard_shim.c), and
# the transfer-naming library whose calls the eBPF witness probes (kvguard_label.c).
shim: $(SHIM) $(LABEL)

$(SHIM): cuda_hooks/shim/kvguard_shim.c cuda_hooks/shim/record.h
	$(CC) -O2 -Wall -Wextra -Werror -fPIC -shared -o $@ $< -ldl -lpthread

$(LABEL): cuda_hooks/shim/kvguard_label.c
	$(CC) -O2 -Wall -Wextra -Werror -fPIC -shared -o $@ $<

proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench: $(STAMP)
	$(BIN)/python bench/ledger.py
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis $(SHIM) $(LABEL) proto/_wire*.so ledger/_pages*.so daemon/_rows*.so build
