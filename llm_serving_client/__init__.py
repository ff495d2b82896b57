"""The callers' client library (docs/clients.md): discovery from the stack outputs, one call per kind of work,
experiments, per-stage logs and OpenTelemetry spans. It imports only the shared contracts (llm_serving) of this
repository; the serving side never imports it (the import-linter contracts in pyproject.toml)."""

from llm_serving_client.assignment import assign
from llm_serving_client.client import ChatResult, ChatStream, Client
from llm_serving_client.discovery import ENV_OUTPUTS, LocalEndpoints, load_outputs
from llm_serving_client.errors import (
    CallError,
    DeadlineExceeded,
    ExperimentError,
    InvalidRequest,
    Overloaded,
    ServerError,
    Unavailable,
)
from llm_serving_client.experiments import HEADER as EXPERIMENT_HEADER
from llm_serving_client.gateway import GatewayEndpoints, GatewayError
from llm_serving_client.retry import RetryPolicy

__all__ = ["ENV_OUTPUTS", "EXPERIMENT_HEADER", "CallError", "ChatResult", "ChatStream", "Client", "DeadlineExceeded",
           "ExperimentError", "GatewayEndpoints", "GatewayError", "InvalidRequest", "LocalEndpoints", "Overloaded",
           "RetryPolicy", "ServerError", "Unavailable", "assign", "load_outputs"]
