"""Python-backend models' dependencies are in the serving image (docs/architecture.md §3.4, "Python dependencies").

A stack names its packages by S3 URI only, so it states what their `model.py` imports (`models[].pythonDependencies`,
the packages' `[python] dependencies`); this policy checks each against the image's Python backend stub as
compat.toml pins it ([triton.stub]: the base image's distributions and the ones the Dockerfile installs), through
the same check packaging and the pod's startup use (llm_serving/python_deps.py). A model the image cannot run is
refused before it is deployed, naming the distribution, instead of failing at `import` inside Triton in the pod.
"""

from __future__ import annotations

from pathlib import Path

from pulumi_policy import EnforcementLevel, ReportViolation, StackValidationArgs, StackValidationPolicy

from llm_serving.python_deps import DependencyError, load_stub, parse_requirements

from ..compat import DEFAULT_PATH as DEFAULT_COMPAT
from ..context import PolicyContextError, stack_context
from ..models import model_configs


def _validate_dependencies(args: StackValidationArgs, report: ReportViolation) -> None:
    ctx = stack_context(args)
    try:
        models = model_configs(ctx)
    except PolicyContextError as err:
        report(str(err), None)
        return
    python_models = [m for m in models.values() if m.kind in ("python", "ensemble") and m.python_dependencies]
    if not python_models:
        return
    compat_file = Path(args.get_config().get("compatFile") or DEFAULT_COMPAT)
    try:
        stub = load_stub("triton", compat_file)
    except DependencyError as err:
        report(f"stack {ctx.stack!r}: {err}", None)
        return
    for model in python_models:
        # The schema parsed them already (infra/config.py); parsed again here for the Requirement objects.
        requirements = parse_requirements(model.python_dependencies, f"models[{model.id}].pythonDependencies")
        for problem in stub.unmet(requirements):
            report(f"model {model.id!r} (kind: {model.kind}) in stack {ctx.stack!r}: pythonDependencies {problem}; "
                   f"add the distribution to compat.toml [triton.stub] install (the image build installs it for "
                   f"the stub) or ship it in the package's execution_env", None)


python_dependencies_in_image = StackValidationPolicy(
    name="serving-python-dependencies-in-image",
    description="Every Python-backend model's declared dependencies are met by the serving image's stub pins.",
    validate=_validate_dependencies,
    enforcement_level=EnforcementLevel.MANDATORY,
)

POLICIES = [python_dependencies_in_image]
