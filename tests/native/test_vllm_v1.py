"""The V1 batch logits processor driven with vLLM's own BatchUpdate objects and a real VllmConfig (demo model),
outside a running engine, so every ordering case (removed, added, moved; one-way moves and swaps; re-adds with
shorter histories; -1 placeholders) is exercised deterministically. The engine end to end is
tests/serving/test_constraints_e2e.py."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from serving_image.constraints.reference import ReferenceState
from serving_image.constraints.spec import validate_constraint
from serving_image.constraints.vllm_processor import ConstraintLogitsProcessor

DFA = {"kind": "token_dfa", "start": 0, "accept": [2], "edges": [[0, 17, 1], [1, 42, 2], [1, 17, 1]]}
CHOICES = {"kind": "choice_sequence", "choices": [[5, 9], [5, 11, 12], [7]], "separator": [3],
           "min_items": 1, "max_items": 3, "unique": True}
ALLOWED = {"kind": "allowed_tokens", "tokens": [5, 7, 9]}




@pytest.fixture
def proc(vllm_config):
    return ConstraintLogitsProcessor(vllm_config, torch.device("cpu"), False)


def params(spec=None) -> SamplingParams:
    p = SamplingParams(max_tokens=32, extra_args=None if spec is None else {"constraint": spec})
    p._eos_token_id = 1  # what vLLM's input processor sets from the model before the request reaches the worker
    return p


def update(size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def finite(proc, rows, vocab) -> list[list[int]]:
    logits = torch.zeros(rows, vocab)
    proc.apply(logits)
    return [torch.isfinite(logits[r]).nonzero().flatten().tolist() for r in range(rows)]


def expected(spec, out, eos=1):
    known = out[: out.index(-1)] if -1 in out else out
    return sorted(ReferenceState.replay(validate_constraint(spec, None, None), eos, known).allowed())


def test_rows_follow_their_output_lists_through_every_batch_change(proc, vllm_config):
    vocab = vllm_config.model_config.get_vocab_size()
    everything = list(range(vocab))
    a, b, c = [], [], []  # the engine's own output lists, growing in place
    proc.update_state(update(3, added=[(0, params(DFA), [1, 2], a), (1, params(), [3], b),
                                       (2, params(CHOICES), [4], c)]))
    assert finite(proc, 3, vocab) == [expected(DFA, a), everything, expected(CHOICES, c)]

    # decode steps: the lists grow; apply() calls alone never advance a row
    a.append(17)
    c.append(5)
    proc.update_state(None)
    assert finite(proc, 3, vocab) == [expected(DFA, a), everything, expected(CHOICES, c)]
    assert finite(proc, 3, vocab) == [expected(DFA, a), everything, expected(CHOICES, c)]

    # removed, then added at the freed index, then moved: the order vLLM documents
    a.append(42)
    c.append(9)
    d = []
    proc.update_state(update(3, removed=[1], added=[(1, params(ALLOWED), [9], d)],
                             moved=[(0, 2, MoveDirectionality.SWAP)]))
    assert finite(proc, 3, vocab) == [expected(CHOICES, c), expected(ALLOWED, d), expected(DFA, a)]

    # one-way move into a hole left by a removal
    proc.update_state(update(2, removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert finite(proc, 2, vocab)[0] == expected(DFA, a) == [1]
    assert not proc.impl.constraint_rows.core.constrained(2)

    # preempted and re-added elsewhere with a shorter, new history list: replayed
    proc.update_state(update(1, removed=[0]))
    resumed = [17]
    proc.update_state(update(2, added=[(1, params(DFA), [1, 2], resumed)], moved=[(1, 0, MoveDirectionality.SWAP)]))
    assert finite(proc, 2, vocab)[0] == expected(DFA, resumed) == [17, 42]
    assert proc.impl.readded == 1

    # async scheduling: a -1 placeholder is not a token, until the engine writes the real one in place
    resumed.append(-1)
    proc.update_state(None)
    assert finite(proc, 2, vocab)[0] == [17, 42]
    resumed[-1] = 42
    proc.update_state(None)
    assert finite(proc, 2, vocab)[0] == [1]

    # the history shrank between steps (no batch update): detected and replayed
    del resumed[1:]
    proc.update_state(None)
    assert finite(proc, 2, vocab)[0] == [17, 42]
    assert proc.impl.constraint_rows.core.rebuilds >= 1


def test_counts_are_exported_as_metrics(proc, vllm_config):
    """The processor's counts reach prometheus_client as the llm_serving_constraint_* families (in a model pod they
    go to the multiprocess files the metrics proxy merges: tests/serving/test_constraints_e2e.py reads them so)."""
    from prometheus_client import REGISTRY

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(f"llm_serving_constraint_{name}") or 0.0

    names = ("requests_added_total", "requests_readded_total", "steps_total", "stalls_total", "rebuilds_total")
    before = {name: value(name) for name in names}
    vocab = vllm_config.model_config.get_vocab_size()
    a, c = [], [5]
    proc.update_state(update(3, added=[(0, params(DFA), [1], a), (1, params(), [1], []), (2, params(CHOICES), [1], c)]))
    finite(proc, 3, vocab)  # two constrained rows masked
    proc.update_state(None)  # and no token came for either: the engine threw both samples away
    finite(proc, 3, vocab)
    del c[:]  # a history that shrank: replayed
    proc.update_state(None)
    finite(proc, 3, vocab)
    delta = {name: value(name) - before[name] for name in names}
    assert delta["requests_added_total"] == 2 and delta["requests_readded_total"] == 1  # c came with a token
    assert delta["steps_total"] == 3
    assert delta["stalls_total"] >= 2 and delta["rebuilds_total"] >= 1
    assert value("max_rows") >= 2


def test_a_row_reused_by_an_unconstrained_request_is_released(proc, vllm_config):
    vocab = vllm_config.model_config.get_vocab_size()
    proc.update_state(update(1, added=[(0, params(ALLOWED), [1], [])]))
    assert finite(proc, 1, vocab)[0] == [1, 5, 7, 9]
    proc.update_state(update(1, added=[(0, params(), [1], [])]))  # replaced without a removal
    assert finite(proc, 1, vocab)[0] == list(range(vocab))


def test_bfloat16_logits(proc, vllm_config):
    vocab = vllm_config.model_config.get_vocab_size()
    proc.update_state(update(1, added=[(0, params(CHOICES), [1], [5])]))
    logits = torch.zeros(1, vocab, dtype=torch.bfloat16)
    proc.apply(logits)
    assert torch.isfinite(logits[0].float()).nonzero().flatten().tolist() == [9, 11]


def test_validate_params_names_the_field():
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    bad = params({"kind": "token_dfa", "start": 0, "accept": [1], "edges": [[0, 5, 1], [0, "x", 1]]})
    with pytest.raises(ValueError, match=r"constraint\.edges\[1\]\[1\]: must be an integer, got a string"):
        ConstraintLogitsProcessor.validate_params(bad)
    # the same through vLLM's own admission hook (what makes the API answer 400)
    with pytest.raises(VLLMValidationError, match=r"constraint\.edges\[1\]\[1\]"):
        validate_logits_processors_parameters([ConstraintLogitsProcessor], bad)
    ConstraintLogitsProcessor.validate_params(params(DFA))
    ConstraintLogitsProcessor.validate_params(params())


def test_worker_rejects_out_of_vocabulary_specs_by_ending_the_request(proc, vllm_config, caplog):
    """validate_params cannot know the vocabulary; the worker does: such a row allows only eos (and logs why)
    instead of killing the engine for every request."""
    vocab = vllm_config.model_config.get_vocab_size()
    proc.update_state(update(1, added=[(0, params({"kind": "allowed_tokens", "tokens": [vocab + 5]}), [1], [])]))
    assert finite(proc, 1, vocab)[0] == [1]
    assert f"constraint.tokens[0]: token id {vocab + 5} is outside the vocabulary" in caplog.text


def test_entry_point_is_accepted_by_both_model_runners_loaders():
    from vllm.v1.sample.logits_processor import _load_logitsprocs_plugins
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_plugins

    assert ConstraintLogitsProcessor in _load_logitsprocs_plugins()
    assert ConstraintLogitsProcessor in _load_v2_logitsprocs_plugins()


def test_usable_by_import_path_in_both_runners():
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    from serving_image.constraints.vllm_v1 import ConstraintLogitsProcessorV1
    from serving_image.constraints.vllm_v2 import ConstraintLogitsProcessorV2

    assert _load_logitsprocs_by_fqcns(["serving_image.constraints.vllm_v1:ConstraintLogitsProcessorV1"]) == [
        ConstraintLogitsProcessorV1]
    assert _load_v2_logitsprocs_by_fqcns(["serving_image.constraints.vllm_v2:ConstraintLogitsProcessorV2"]) == [
        ConstraintLogitsProcessorV2]
    path = "serving_image.constraints.vllm_processor:ConstraintLogitsProcessor"
    assert _load_logitsprocs_by_fqcns([path]) == _load_v2_logitsprocs_by_fqcns([path]) == [ConstraintLogitsProcessor]


def test_a_spec_given_as_json_text_is_the_same_constraint(proc, vllm_config):
    """extra_args["constraint"] may hold the spec's JSON text, which vLLM copies and serialises per request far
    more cheaply than a large object (bench/constraints_e2e.py measures both)."""
    import json

    vocab = vllm_config.model_config.get_vocab_size()
    ConstraintLogitsProcessor.validate_params(params(json.dumps(CHOICES)))
    out = [5]
    proc.update_state(update(2, added=[(0, params(json.dumps(CHOICES)), [1], out), (1, params(CHOICES), [1], [5])]))
    assert finite(proc, 2, vocab) == [expected(CHOICES, out)] * 2 == [[9, 11]] * 2


def test_json_text_that_is_not_a_spec_is_refused_at_admission_and_ends_the_request_in_the_worker(
        proc, vllm_config, caplog):
    vocab = vllm_config.model_config.get_vocab_size()
    with pytest.raises(ValueError, match=r"^constraint: is a string but not JSON"):
        ConstraintLogitsProcessor.validate_params(params("{not json"))
    with pytest.raises(ValueError, match=r"constraint\.tokens\[1\]: must be an integer"):
        ConstraintLogitsProcessor.validate_params(params('{"kind": "allowed_tokens", "tokens": [5, "x"]}'))
    # a caller that skipped admission: the worker ends that request (only eos), the engine lives on
    proc.update_state(update(1, added=[(0, params("{not json"), [1], [])]))
    assert finite(proc, 1, vocab)[0] == [1]
    assert "constraint rejected in the worker" in caplog.text


@pytest.mark.parametrize("text", [
    '{"kind":"allowed_tokens","tokens":[5,7,9]}',  # the plain form: compiled straight from the text
    '{"tokens": [9, 7, 5, 5], "kind": "allowed_tokens"}',
    '{"kind":"allowed_tokens","tokens":[5,7,9.0]}',  # not the plain form: parsed, then validated (9.0 is refused)
    '{"kind":"allowed_tokens","tokens":[5,7,99999]}',  # out of the vocabulary: parsed, validated, refused
])
def test_an_allowed_tokens_text_compiles_as_its_parsed_value(proc, vllm_config, caplog, text):
    """The worker compiles an allowed_tokens text in its plain form in one native pass, anything else after parsing
    it: both rows mask alike, and a bad spec ends its request (only eos) the same way from either form."""
    import json

    vocab = vllm_config.model_config.get_vocab_size()
    proc.update_state(update(2, added=[(0, params(text), [1], []), (1, params(json.loads(text)), [1], [])]))
    rows = finite(proc, 2, vocab)
    assert rows[0] == rows[1]
    refused = "9.0" in text or "99999" in text
    assert rows[0] == ([1] if refused else [1, 5, 7, 9])
    assert ("constraint rejected in the worker" in caplog.text) is refused


@pytest.mark.parametrize(("text", "refused"), [
    ('{"kind":"token_dfa","start":0,"accept":[2],"edges":[[0,17,1],[1,42,2],[1,17,1]]}', False),  # plain: native
    ('{"edges": [[1, 17, 1], [0, 17, 1], [1, 42, 2]], "start": 0, "accept": [2], "kind": "token_dfa"}', False),
    ('{"kind":"token_dfa","start":0,"accept":[2],"edges":[[0,17,1],[1,42,2],[1,17,1.5]]}', True),  # parsed, refused
    # not deterministic
    ('{"kind":"token_dfa","start":0,"accept":[2],"edges":[[0,17,1],[1,42,2],[1,17,1],[1,17,2]]}', True),
    ('{"kind":"token_dfa","start":0,"accept":[2],"edges":[[0,17,1],[1,1,2]]}', True),  # eos on an edge
])
def test_a_token_dfa_text_compiles_as_its_parsed_value(proc, vllm_config, caplog, text, refused):
    """The same for token_dfa: a plain text compiles in one native pass (its states, edge tokens and determinism
    checked there), anything else is parsed and validated; after each prefix both rows mask alike."""
    import json

    vocab = vllm_config.model_config.get_vocab_size()
    for out in ([], [17], [17, 17]):
        proc.update_state(update(2, added=[(0, params(text), [1], list(out)), (1, params(json.loads(text)), [1],
                                                                                  list(out))]))
        rows = finite(proc, 2, vocab)
        assert rows[0] == rows[1]
        if not refused:
            assert rows[0] == expected(json.loads(text), list(out))
    assert rows[0] == ([1] if refused else [17, 42])
    assert ("constraint rejected in the worker" in caplog.text) is refused


def test_admission_reads_a_plain_text_natively_and_names_the_field_of_any_other():
    import json

    ConstraintLogitsProcessor.validate_params(params(json.dumps(DFA)))  # plain: one native pass
    ConstraintLogitsProcessor.validate_params(params(json.dumps(ALLOWED)))
    nondeterministic = {**DFA, "edges": [*DFA["edges"], [1, 17, 2]]}
    with pytest.raises(ValueError, match=r"^constraint\.edges\[3\]\[2\]: state 1 already goes to state 1"):
        ConstraintLogitsProcessor.validate_params(params(json.dumps(nondeterministic)))
    with pytest.raises(ValueError, match=r"^constraint\.start: state 1048576 is outside"):
        ConstraintLogitsProcessor.validate_params(params(json.dumps({**DFA, "start": 1 << 20})))
