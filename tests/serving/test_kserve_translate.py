"""The pure KServe translation (serving_image/kserve/translate.py, tensors.py): no engine, no sockets.

Server direction (tensors + sampling_parameters -> EngineRequest, deltas -> response tensors) and client direction
(EngineRequest -> tensors, response tensors -> deltas, used by the Triton adapters), and the round trip between
them: what a Triton adapter sends, the local server decodes to the same SamplingSpec.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from serving_image.engine.base import (
    ChoiceDelta,
    EngineOutput,
    EngineRequest,
    EngineUnavailableError,
    ModelInfo,
    SamplingSpec,
    StructuredOutput,
    TokenLogprob,
    TopLogprob,
)
from serving_image.kserve.tensors import (
    MAX_BYTES_ELEMENT,
    Tensor,
    TensorError,
    decode_grpc_input,
    decode_json_input,
    join_raw_bytes,
    split_raw_bytes,
)
from serving_image.kserve.translate import (
    DEFAULT_MAX_TOKENS,
    ClientTranslationError,
    KServeInputError,
    OutputReader,
    ResponseBuilder,
    backend_logprobs,
    parse_generate,
    read_backend_logprobs,
    request_tensors,
    sampling_parameters_json,
    sampling_spec_from_dict,
)

INFO = ModelInfo(name="demo", version="1.0.0", max_model_len=512, vocab_size=1000, eos_token_id=2)
KEY = "structured_outputs"


def text(value: str) -> Tensor:
    return Tensor("text_input", "BYTES", (1,), (value.encode(),))


def flag(name: str, value: bool) -> Tensor:
    return Tensor(name, "BOOL", (1,), (value,))


def params(value: dict | str) -> Tensor:
    raw = value if isinstance(value, str) else json.dumps(value)
    return Tensor("sampling_parameters", "BYTES", (1,), (raw.encode(),))


def parse(*tensors: Tensor, parameters: dict | None = None, outputs=()):
    return parse_generate(list(tensors), parameters or {}, info=INFO, request_id="r", structured_key=KEY,
                          output_names=outputs)


# -- inputs ------------------------------------------------------------------------------------------------------


def test_defaults_follow_the_vllm_backend():
    call = parse(text("hello"))
    assert call.request.prompt == "hello"
    assert call.stream is False and call.prepend_input is True  # non-streaming answers include the prompt
    assert call.request.sampling.max_tokens == DEFAULT_MAX_TOKENS  # SamplingParams' default, as in Triton
    assert call.outputs == ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
    streaming = parse(text("hello"), flag("stream", True))
    assert streaming.stream and not streaming.prepend_input
    assert not parse(text("hi"), flag("exclude_input_in_output", True)).prepend_input


def test_streaming_with_the_prompt_is_refused_as_the_backend_does():
    with pytest.raises(KServeInputError) as info:
        parse(text("hi"), flag("stream", True), flag("exclude_input_in_output", False))
    assert info.value.field == "exclude_input_in_output"


@pytest.mark.parametrize(("tensors", "field"), [
    ([], "text_input"),
    ([Tensor("text_input", "INT32", (1,), (1,))], "text_input"),
    ([Tensor("text_input", "BYTES", (2,), (b"a", b"b"))], "text_input"),
    ([Tensor("text_input", "BYTES", (1,), (b"",))], "text_input"),
    ([Tensor("text_input", "BYTES", (1,), (b"\xff",))], "text_input"),
    ([text("a"), Tensor("stream", "BYTES", (1,), (b"true",))], "stream"),
    ([text("a"), Tensor("image", "BYTES", (1,), (b"x",))], "image"),
    ([text("a"), Tensor("return_logprobs", "BOOL", (1,), (True,))], "return_logprobs"),
    ([text("a"), Tensor("prompt", "BYTES", (1,), (b"x",))], "prompt"),
    ([text("a"), text("b")], "text_input"),
])
def test_bad_tensors_are_named(tensors, field):
    with pytest.raises(KServeInputError) as info:
        parse(*tensors)
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)


def test_requested_outputs_and_return_flags():
    assert parse(text("a"), outputs=["num_output_tokens", "text_output"]).outputs == \
        ("text_output", "num_output_tokens")
    assert parse(text("a"), flag("return_finish_reason", False)).outputs == \
        ("text_output", "num_input_tokens", "num_output_tokens")
    assert len(parse(text("a"), flag("return_num_input_tokens", True)).outputs) == 4
    with pytest.raises(KServeInputError, match="output .logits."):
        parse(text("a"), outputs=["logits"])


# -- sampling_parameters -----------------------------------------------------------------------------------------


def test_every_field_maps_and_numbers_may_be_strings():
    spec = parse(text("a"), params({
        "max_tokens": "32", "temperature": "0.5", "top_p": 0.9, "top_k": 40, "min_p": 0.1, "n": 2, "seed": 7,
        "stop": "END", "stop_token_ids": [3, 4], "presence_penalty": 0.2, "frequency_penalty": 0.3,
        "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True, "logit_bias": {"5": -1.5},
        "top_k_unused": None,  # None means "the default", as in the backend (it drops None values)
    })).request.sampling
    assert spec == SamplingSpec(max_tokens=32, temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, n=2, seed=7,
                                stop=("END",), stop_token_ids=(3, 4), presence_penalty=0.2, frequency_penalty=0.3,
                                repetition_penalty=1.1, min_tokens=2, ignore_eos=True, logit_bias={5: -1.5})
    assert parse(text("a"), params({"top_k": -1})).request.sampling.top_k is None


def test_request_parameters_are_the_sampling_parameters_without_the_tensor():
    spec = parse(text("a"), parameters={"max_tokens": 3, "temperature": 0.0, "priority": 1,
                                        "triton_enable_empty_final_response": True}).request.sampling
    assert spec.max_tokens == 3 and spec.temperature == 0.0
    with pytest.raises(KServeInputError, match="parameters.bogus"):
        parse(text("a"), parameters={"bogus": 1})


@pytest.mark.parametrize(("value", "field"), [
    ("{", "sampling_parameters"),
    ("[1]", "sampling_parameters"),
    ({"max_token": 3}, "sampling_parameters.max_token"),
    ({"max_tokens": 0}, "sampling_parameters.max_tokens"),
    ({"max_tokens": 1.5}, "sampling_parameters.max_tokens"),
    ({"max_tokens": True}, "sampling_parameters.max_tokens"),
    ({"temperature": "hot"}, "sampling_parameters.temperature"),
    ({"temperature": -1}, "sampling_parameters.temperature"),
    ({"temperature": "nan"}, "sampling_parameters.temperature"),
    ({"top_p": 0}, "sampling_parameters.top_p"),
    ({"n": 0}, "sampling_parameters.n"),
    ({"ignore_eos": "false"}, "sampling_parameters.ignore_eos"),
    ({"stop": [1]}, "sampling_parameters.stop"),
    ({"stop_token_ids": [5000]}, "sampling_parameters.stop_token_ids[0]"),
    ({"logit_bias": {"x": 1}}, "sampling_parameters.logit_bias.x"),
    ({"logprobs": 2}, "sampling_parameters.logprobs"),
    ({"structured_outputs": {"json": {}}}, "sampling_parameters.structured_outputs"),
    ({"structured_outputs": "{"}, "sampling_parameters.structured_outputs"),
    ({"structured_outputs": json.dumps({"json": {}, "regex": "a"})}, "sampling_parameters.structured_outputs"),
    ({"structured_outputs": json.dumps({"ebnf": "x"})}, "sampling_parameters.structured_outputs.ebnf"),
    ({"structured_outputs": json.dumps({"choice": []})}, "sampling_parameters.structured_outputs.choice"),
    ({"guided_decoding": json.dumps({"regex": "a"})}, "sampling_parameters.guided_decoding"),
    ({"constraint": {"kind": "nope"}}, "sampling_parameters.constraint.kind"),
    ({"constraint": {"kind": "allowed_tokens", "tokens": [5000]}}, "sampling_parameters.constraint.tokens[0]"),
    ({"extra_args": {"constraint": {"kind": "allowed_tokens", "tokens": [-1]}}},
     "sampling_parameters.extra_args.constraint.tokens[0]"),
    ({"extra_args": {"other": 1}}, "sampling_parameters.extra_args"),
    ({"constraint": {"kind": "allowed_tokens", "tokens": [5]},
      "structured_outputs": json.dumps({"regex": "a"})}, "sampling_parameters.constraint"),
])
def test_bad_sampling_parameters_are_named(value, field):
    with pytest.raises(KServeInputError) as info:
        parse(text("a"), params(value))
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(field) or f"'{field}'" in str(info.value)


def test_structured_outputs_and_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = {
        json.dumps({"json": schema}): StructuredOutput("json_schema", schema),
        json.dumps({"json": json.dumps(schema)}): StructuredOutput("json_schema", schema),
        json.dumps({"json_object": True}): StructuredOutput("json_object"),
        json.dumps({"regex": "[a-z]+"}): StructuredOutput("regex", "[a-z]+"),
        json.dumps({"choice": ["x", "y"]}): StructuredOutput("choice", ["x", "y"]),
        json.dumps({"grammar": "root ::= \"a\""}): StructuredOutput("grammar", "root ::= \"a\""),
    }
    for raw, expected in cases.items():
        assert parse(text("a"), params({"structured_outputs": raw})).request.sampling.structured == expected
    # The key follows the pinned release: an older release reads guided_decoding.
    old = sampling_spec_from_dict({"guided_decoding": json.dumps({"regex": "a"})}, INFO, "guided_decoding")
    assert old.structured == StructuredOutput("regex", "a")
    both = [parse(text("a"), params({"constraint": {"kind": "allowed_tokens", "tokens": [5, 7]}})),
            parse(text("a"), params({"extra_args": {"constraint": {"kind": "allowed_tokens", "tokens": [5, 7]}}}))]
    assert both[0].request.sampling.constraint == both[1].request.sampling.constraint
    assert both[0].request.sampling.constraint["kind"] == "allowed_tokens"


# -- responses (server side) -------------------------------------------------------------------------------------


def delta(index: int, text_: str, n_tokens: int, finish=None) -> ChoiceDelta:
    return ChoiceDelta(index=index, text=text_, token_ids=tuple(range(n_tokens)), finish_reason=finish)


def test_streamed_responses_carry_deltas():
    call = parse(text("Hi"), flag("stream", True), params({"n": 2}))
    builder = ResponseBuilder(call)
    first = builder.add(EngineOutput("r", 3, (delta(0, "a", 1), delta(1, "b", 1)), False))
    second = builder.add(EngineOutput("r", 3, (delta(1, "cd", 2, "length"),), False))
    by_name = {t.name: t for t in second}
    assert {t.name: t.values for t in first}["text_output"] == (b"a", b"b")
    assert by_name["text_output"].values == (b"", b"cd") and by_name["text_output"].shape == (2,)
    assert by_name["finish_reason"].values == (b"None", b"length")
    assert by_name["num_output_tokens"].values == (0, 2)
    assert by_name["num_input_tokens"].values == (3,)


def test_whole_response_prepends_the_prompt_unless_excluded():
    for tensors, expected in (((text("Hi "),), b"Hi there"),
                              ((text("Hi "), flag("exclude_input_in_output", True)), b"there")):
        builder = ResponseBuilder(parse(*tensors))
        assert builder.add(EngineOutput("r", 2, (delta(0, "the", 1),), False)) is None
        builder.add(EngineOutput("r", 2, (delta(0, "re", 1, "stop"),), True))
        final = {t.name: t.values for t in builder.final()}
        assert final["text_output"] == (expected,)
        assert final["finish_reason"] == (b"stop",) and final["num_output_tokens"] == (2,)


# -- client side (the Triton adapters) and the round trip --------------------------------------------------------


def test_adapter_requests_decode_to_the_same_spec():
    spec = SamplingSpec(max_tokens=20, temperature=0.3, top_p=0.8, top_k=5, n=2, stop=("x",), stop_token_ids=(9,),
                        seed=3, logit_bias={4: 1.0}, min_tokens=1, ignore_eos=True,
                        structured=StructuredOutput("json_schema", {"type": "object"}))
    tensors = request_tensors(EngineRequest("id", "prompt text", spec), KEY)
    call = parse(*[t for t in tensors])
    assert call.request.sampling == spec
    assert call.stream and not call.prepend_input
    constrained = SamplingSpec(max_tokens=4, constraint={"kind": "allowed_tokens", "tokens": [5, 7]})
    body = json.loads(sampling_parameters_json(constrained, KEY))
    assert body["extra_args"] == {"constraint": constrained.constraint} and "constraint" not in body
    assert parse(*request_tensors(EngineRequest("id", "p", constrained), KEY)).request.sampling == constrained


def test_adapter_refuses_what_kserve_cannot_carry():
    with pytest.raises(ClientTranslationError) as info:
        request_tensors(EngineRequest("id", [1, 2, 3]), KEY)
    assert info.value.param == "prompt"


def test_logprobs_requested_and_read_back_in_the_backends_form():
    """The adapter asks for log-probabilities as NVIDIA's backend takes them (SamplingParams.logprobs plus
    return_logprobs) and reads its `logprobs` output (JSON per choice, token id -> logprob/rank/decoded_token, the
    sampled token first) back into the same TokenLogprobs the stand-in's engine process wrote."""
    tensors = {t.name: t for t in request_tensors(EngineRequest("id", "p", SamplingSpec(logprobs=2)), KEY)}
    assert tensors["return_logprobs"].values == (True,)
    assert json.loads(tensors["sampling_parameters"].values[0])["logprobs"] == 2
    assert "return_logprobs" not in {t.name for t in request_tensors(EngineRequest("id", "p"), KEY)}
    sampled_in_top = TokenLogprob("a", 5, -0.1, (TopLogprob("a", 5, -0.1), TopLogprob("b", 6, -2.5)), rank=1)
    sampled_outside = TokenLogprob("z", 9, -7.0, (TopLogprob("a", 5, -0.2), TopLogprob("b", 6, -1.9)), rank=40)
    text = json.dumps(backend_logprobs((sampled_in_top, sampled_outside)))
    assert list(json.loads(text)[1]) == ["9", "5", "6"]  # the sampled token first, then the top k by rank
    assert read_backend_logprobs(text, 2) == (sampled_in_top, sampled_outside)
    reader = OutputReader("r", n=1, logprobs=2)
    delta = reader.read({"text_output": [b"az"], "num_output_tokens": [2], "logprobs": [text.encode()]})
    assert delta.choices[0].logprobs == (sampled_in_top, sampled_outside) and delta.choices[0].token_ids == (5, 9)
    with pytest.raises(ValueError, match="null"):
        reader.read({"text_output": [b""], "num_output_tokens": [0], "logprobs": [b"null"]})
    with pytest.raises(ValueError, match="no logprobs output"):
        reader.read({"text_output": [b""], "num_output_tokens": [0]})


def test_output_reader_rebuilds_deltas():
    reader = OutputReader("r", n=1)
    out = reader.read({"text_output": [b"ab"], "finish_reason": [b"None"], "num_input_tokens": [4],
                       "num_output_tokens": [2]})
    assert out.prompt_tokens == 4 and not out.finished
    assert out.choices[0].text == "ab" and len(out.choices[0].token_ids) == 2
    last = reader.read({"text_output": [b"c"], "finish_reason": [b"length"], "num_output_tokens": [1]})
    assert last.finished and last.choices[0].finish_reason == "length" and last.prompt_tokens == 4
    assert reader.read({}, final=True).finished


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_output_reader_raises_on_a_choice_the_engine_cut_short(reason):
    """Triton's vLLM backend passes vLLM's finish reason on: "abort" or "error" means the text is incomplete, and a
    front-end must not hand it on as a normal finish."""
    reader = OutputReader("r7", n=1)
    reader.read({"text_output": [b"ab"], "finish_reason": [b"None"], "num_output_tokens": [2]})
    with pytest.raises(EngineUnavailableError, match=f"{'aborted' if reason == 'abort' else 'failed'} request r7"):
        reader.read({"text_output": [b""], "finish_reason": [reason.encode()], "num_output_tokens": [0]})


# -- tensors ------------------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=50), min_size=0, max_size=6))
def test_raw_bytes_round_trip(values):
    assert split_raw_bytes("t", join_raw_bytes(values), len(values)) == tuple(values)


def test_raw_and_typed_grpc_contents():
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1])
    assert decode_grpc_input(tensor, join_raw_bytes([b"hi"])).values == (b"hi",)
    tensor.contents.bytes_contents.append(b"typed")
    assert decode_grpc_input(tensor, None).values == (b"typed",)
    counts = service_pb2.ModelInferRequest.InferInputTensor(name="n", datatype="UINT32", shape=[2])
    assert decode_grpc_input(counts, struct.pack("<2I", 3, 4)).values == (3, 4)
    with pytest.raises(TensorError, match="'n'"):
        decode_grpc_input(counts, b"\x00" * 7)
    huge = service_pb2.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[1])
    with pytest.raises(TensorError, match="exceeds the limit"):
        decode_grpc_input(huge, join_raw_bytes([b"x" * (MAX_BYTES_ELEMENT + 1)]))
    fp = service_pb2.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1])
    with pytest.raises(TensorError, match="datatype FP32"):
        decode_grpc_input(fp, b"\x00" * 4)


def test_json_inputs():
    assert decode_json_input({"name": "stream", "shape": [1], "datatype": "BOOL", "data": [True]}, 0).values == \
        (True,)
    assert decode_json_input({"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [["a"]]},
                             0).shape == (1, 1)
    for bad in ({"name": "stream", "shape": [1], "datatype": "BOOL", "data": [1]},
                {"name": "text_input", "shape": "1", "datatype": "BYTES", "data": ["a"]},
                {"name": "text_input", "shape": [2], "datatype": "BYTES", "data": ["a"]}):
        with pytest.raises(TensorError):
            decode_json_input(bad, 0)


def test_triton_prompt_decodes_ids_and_avoids_a_second_bos():
    from serving_image.kserve.translate import triton_prompt

    vocab = {1: "<s>", 5: "Hi", 6: " there"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    rendered = EngineRequest("id", [1, 5, 6], add_special_tokens=False)
    assert triton_prompt(rendered, decode, "<s>", tokenizer_adds_bos=True) == "Hi there"
    assert triton_prompt(rendered, decode, "<s>", tokenizer_adds_bos=False) == "<s>Hi there"
    chat_text = EngineRequest("id", "<s>Hi", add_special_tokens=False)
    assert triton_prompt(chat_text, decode, "<s>", tokenizer_adds_bos=True) == "Hi"
    plain = EngineRequest("id", "<s>Hi", add_special_tokens=True)
    assert triton_prompt(plain, decode, "<s>", tokenizer_adds_bos=True) == "<s>Hi"
