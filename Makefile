# The two commands a new user runs (README):
#   make run     create .venv (pip, CPU torch 2.13.0) and run the main job
#   make test    create .venv and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Re-install whenever pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -e ".[dev]"
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

# The main job. Until the co-evolution loop lands (`crl run configs/tiny-minihack-room.yaml`), it is the backbone
# check: an embedded broker, every topic, every event kind through Kafka, SQL, the embedding model and NLE.
run: venv
	HF_HUB_OFFLINE=1 $(BIN)/crl doctor --embedded

test: venv
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
