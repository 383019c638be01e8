# Two commands matter (see README): `make demo` and `make test`. Both create .venv if needed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch pinned for these machines. GPU users: install your CUDA torch into the venv first
# (e.g. `$(BIN)/pip install torch --index-url https://download.pytorch.org/whl/cu128`), then `make install TORCH=`.
TORCH  ?= torch==2.13.0

.PHONY: install demo test lint bench clean

$(BIN)/paratrain: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH),$(BIN)/pip install -q "$(TORCH)")
	$(BIN)/pip install -q -e ".[dev]"
	touch $(BIN)/paratrain

install: $(BIN)/paratrain

demo: install
	rm -rf runs/demo  # the demo is a fresh run each time (training resumes automatically otherwise)
	OMP_NUM_THREADS=2 $(BIN)/paratrain data prepare --config configs/tiny.toml
	OMP_NUM_THREADS=2 $(BIN)/paratrain train --config configs/tiny.toml --set train.progress=true

test: install
	$(BIN)/ruff check src tests benchmarks
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: install
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf runs data .pytest_cache
