"""`llm-serving rehearse`'s command line: its options and their choices. Imports nothing beyond the standard library,
so that `llm-serving rehearse --help` (and a refused option) is answered from any install of the wheel; the
rehearsal itself (run.py) needs the packages of the repository's .venv-serving."""

from __future__ import annotations

import argparse

DEFAULT_STACK = "dev-us-east-1"
SCENARIOS = ("red-black", "rollback", "rollback-errors", "versioned")  # the rollout scenarios, in the order they run
DESCRIPTION = "`make rehearse [STACK=<stack>]`: a stack's model pods on this machine, exactly as their rendered " \
              "Deployments say (docs/rehearsal.md)"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of one rehearsal; exits (argparse's way) on --help or a refused option."""
    parser = argparse.ArgumentParser(prog="llm-serving rehearse", description=DESCRIPTION)
    parser.add_argument("--stack", default=DEFAULT_STACK, help=f"a stack in stacks/ (default {DEFAULT_STACK})")
    parser.add_argument("--no-scenarios", action="store_true",
                        help="bring the stack up and drive traffic only, without the rollout scenarios")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, dest="scenarios",
                        help="run this rollout scenario only (repeat for several; default: all of them, in order)")
    args = parser.parse_args(argv)
    if args.no_scenarios and args.scenarios:
        parser.error("--no-scenarios and --scenario contradict each other")
    return args
