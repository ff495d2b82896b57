"""No import cycle between modules: for every import a -> b in the repository's packages, no chain of imports leads
from b back to a. Imports inside functions count (a lazy import still ties the two modules together). The layers and
the forbidden imports are the import-linter contracts' ([tool.importlinter] in pyproject.toml, `lint-imports`);
this is the one rule they do not state at the level of modules.

grimp (import-linter's graph) sees only Python source: an import of a compiled module (`_response_path`, `_native`)
is left out, so `from package._native import name` inside the package ties no module to the package's __init__."""

from __future__ import annotations

import grimp

from llm_serving.repository import REPO_ROOT

PACKAGES = ("llm_serving", "llm_serving_cli", "llm_serving_client", "serving_image", "infra", "policies", "bench",
            "tests")


def test_no_module_is_part_of_an_import_cycle(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # bench and tests are found through the checkout, as lint-imports does
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    cycles = set()
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)  # imported -> ... -> importer
            if back is not None:
                start = back.index(min(back))
                cycles.add(back[start:] + back[:start])  # one cycle, whichever of its imports found it
    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + " -> ".join([*cycle, cycle[0]]) for cycle in sorted(cycles))
