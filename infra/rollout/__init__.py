"""Rollout arithmetic and tooling (ARCHITECTURE §4). `planner` is pure: no Pulumi import."""
