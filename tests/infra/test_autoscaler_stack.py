"""The seam between the program and the rehearsal's autoscaler (rehearsal/autoscaler.py): every ScaledObject a shipped
stack renders builds the emulation, which refuses a field it does not model, so a new field in the render fails here
until the emulation models it. tests/serving/test_autoscaler.py checks the emulation's rules."""

from __future__ import annotations

from infra.serving import FALLBACK_FAILURES
from rehearsal.autoscaler import Autoscaler

SCALED_OBJECT = "kubernetes:keda.sh/v1alpha1:ScaledObject"


def test_every_rendered_scaled_object_is_modelled_and_no_data_never_scales_it_down(stack):
    run, _ = stack
    scaled = run.of_type(SCALED_OBJECT)
    assert scaled, f"{run.stack}: no ScaledObject rendered"
    for so in scaled:
        spec = so.inputs["spec"]
        bounds = Autoscaler.from_scaled_object(spec)
        for current in (bounds.min_replicas, bounds.max_replicas):
            scaler = Autoscaler.from_scaled_object(spec)
            decisions = [scaler.poll(i * scaler.polling_interval_s, None, current)
                         for i in range(FALLBACK_FAILURES + 2)]
            assert [d.replicas for d in decisions] == [current] * len(decisions), (so.name, decisions)
            assert decisions[-1].reason.startswith("fallback: currentReplicas"), (so.name, decisions)
