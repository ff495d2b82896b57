"""The adapters' KServe translation (serving_image/engine/vllm_backend_tensors.py): no engine, no sockets.

An GenerationRequest becomes the tensors Triton's vLLM backend takes, and the backend's response tensors become engine
deltas. The round trip goes through the server side that really runs: the stand-in backend's parser of
`sampling_parameters` into vLLM's SamplingParams (serving_image/triton_stub/stub_vllm.py, as NVIDIA's backend does it).
"""

from __future__ import annotations

import json

import pytest

from serving_image.engine.vllm_backend_tensors import (
    RETURN_FLAGS,
    ClientTranslationError,
    OutputReader,
    backend_logprobs,
    read_backend_logprobs,
    request_tensors,
    sampling_parameters_json,
)
from serving_image.served_model import (
    GenerationRequest,
    ModelInfo,
    ModelUnavailableError,
    SamplingSpec,
    StructuredOutput,
    TokenLogprob,
    TopLogprob,
    merge_outputs,
)

INFO = ModelInfo(name="demo", version="1.0.0", max_model_len=512, vocab_size=1000, eos_token_id=2)
KEY = "structured_outputs"


def backend_params(tensors):
    """What the backend makes of the adapter's tensors: vLLM SamplingParams (the stand-in's parser)."""
    from serving_image.triton_stub.stub_vllm import sampling_params_from_json

    by_name = {t.name: t for t in tensors}
    return sampling_params_from_json(by_name["sampling_parameters"].values[0].decode(), "sampling_parameters", INFO)


def test_adapter_requests_reach_the_backend_as_the_same_sampling_params():
    spec = SamplingSpec(max_tokens=20, temperature=0.3, top_p=0.8, top_k=5, n=2, stop=("x",), stop_token_ids=(9,),
                        seed=3, logit_bias={4: 1.0}, min_tokens=1, ignore_eos=True,
                        structured=StructuredOutput("json_schema", {"type": "object"}))
    tensors = request_tensors(GenerationRequest("id", "prompt text", spec), KEY)
    flags = {t.name: t.values for t in tensors if t.datatype == "BOOL"}
    assert flags == {"stream": (True,), "exclude_input_in_output": (True,), **{f: (True,) for f in RETURN_FLAGS}}
    assert [t.values for t in tensors if t.name == "text_input"] == [(b"prompt text",)]
    params = backend_params(tensors)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.n) == (20, 0.3, 0.8, 5, 2)
    assert (params.stop, params.stop_token_ids, params.seed, params.min_tokens, params.ignore_eos) == (
        ["x"], [9], 3, 1, True)
    assert params.logit_bias == {4: 1.0}
    assert params.structured_outputs.json == {"type": "object"}  # the silent drop this platform exists to prevent
    constrained = SamplingSpec(max_tokens=4, constraint='{"kind":"allowed_tokens","tokens":[5,7]}')
    body = json.loads(sampling_parameters_json(constrained, KEY))
    assert body["extra_args"] == {"constraint": json.loads(constrained.constraint)} and "constraint" not in body
    extra = backend_params(request_tensors(GenerationRequest("id", "p", constrained), KEY)).extra_args
    assert json.loads(extra["constraint"])["tokens"] == [5, 7]  # on to vLLM as JSON text, its cheap form


def test_adapter_refuses_what_kserve_cannot_carry():
    with pytest.raises(ClientTranslationError) as info:
        request_tensors(GenerationRequest("id", [1, 2, 3]), KEY)
    assert info.value.param == "prompt"


def test_logprobs_requested_and_read_back_in_the_backends_form():
    """The adapter asks for log-probabilities as NVIDIA's backend takes them (SamplingParams.logprobs plus
    return_logprobs) and reads its `logprobs` output (JSON per choice, token id -> logprob/rank/decoded_token, the
    sampled token first) back into the same TokenLogprobs the stand-in's in-stub engine wrote."""
    tensors = {t.name: t for t in request_tensors(GenerationRequest("id", "p", SamplingSpec(logprobs=2)), KEY)}
    assert tensors["return_logprobs"].values == (True,)
    assert json.loads(tensors["sampling_parameters"].values[0])["logprobs"] == 2
    assert "return_logprobs" not in {t.name for t in request_tensors(GenerationRequest("id", "p"), KEY)}
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


def test_deltas_that_arrived_together_merge_into_the_stream_a_client_would_have_read():
    """What one drain brings for a request leaves as one delta (one SSE chunk): the same text, token count,
    finish reason and log-probabilities per choice as the deltas one by one, in order."""
    first_lp = TokenLogprob("a", 5, -0.1, (TopLogprob("a", 5, -0.1),), rank=1)
    second_lp = TokenLogprob("b", 6, -0.3, (TopLogprob("b", 6, -0.3),), rank=1)
    reader = OutputReader("r", n=2, logprobs=1)
    one = reader.read({"text_output": [b"a", b"x"], "finish_reason": [b"None", b"None"], "num_input_tokens": [3],
                       "num_output_tokens": [1, 1],
                       "logprobs": [json.dumps(backend_logprobs((first_lp,))).encode(),
                                    json.dumps(backend_logprobs((first_lp,))).encode()]})
    two = reader.read({"text_output": [b"b", b""], "finish_reason": [b"length", b"None"],
                       "num_output_tokens": [1, 0],
                       "logprobs": [json.dumps(backend_logprobs((second_lp,))).encode(), b"[]"]})
    merged = merge_outputs(one, two)
    assert [c.text for c in merged.choices] == ["ab", "x"]
    assert [len(c.token_ids) for c in merged.choices] == [2, 1]
    assert merged.choices[0].logprobs == (first_lp, second_lp) and merged.choices[1].logprobs == (first_lp,)
    assert [c.finish_reason for c in merged.choices] == ["length", None]
    assert merged.prompt_tokens == 3 and not merged.finished
    assert merge_outputs(merged, reader.read({}, final=True)).finished


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_output_reader_raises_on_a_choice_the_engine_cut_short(reason):
    """Triton's vLLM backend passes vLLM's finish reason on: "abort" or "error" means the text is incomplete, and a
    front-end must not hand it on as a normal finish."""
    reader = OutputReader("r7", n=1)
    reader.read({"text_output": [b"ab"], "finish_reason": [b"None"], "num_output_tokens": [2]})
    with pytest.raises(ModelUnavailableError, match=f"{'aborted' if reason == 'abort' else 'failed'} request r7"):
        reader.read({"text_output": [b""], "finish_reason": [reason.encode()], "num_output_tokens": [0]})


def test_triton_prompt_decodes_ids_and_avoids_a_second_bos():
    from serving_image.engine.vllm_backend_tensors import triton_prompt

    vocab = {1: "<s>", 5: "Hi", 6: " there"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    rendered = GenerationRequest("id", [1, 5, 6], add_special_tokens=False)
    assert triton_prompt(rendered, decode, "<s>", tokenizer_adds_bos=True) == "Hi there"
    assert triton_prompt(rendered, decode, "<s>", tokenizer_adds_bos=False) == "<s>Hi there"
    chat_text = GenerationRequest("id", "<s>Hi", add_special_tokens=False)
    assert triton_prompt(chat_text, decode, "<s>", tokenizer_adds_bos=True) == "Hi"
    plain = GenerationRequest("id", "<s>Hi", add_special_tokens=True)
    assert triton_prompt(plain, decode, "<s>", tokenizer_adds_bos=True) == "<s>Hi"


def test_triton_prompt_sends_the_text_the_front_end_tokenized_without_decoding():
    """Ids the front-end tokenized from text go as that text (`source`): no decode. A completion's text was
    tokenized with special tokens, as the backend will; a chat rendering holds its BOS, which is dropped where the
    tokenizer adds one."""
    from serving_image.engine.vllm_backend_tensors import triton_prompt
    from serving_image.served_model import PromptText

    def decode(ids):
        raise AssertionError(f"decoded {ids}")

    completion = GenerationRequest("id", [1, 5, 6], add_special_tokens=False, source=PromptText("Hi  there", True))
    assert triton_prompt(completion, decode, "<s>", tokenizer_adds_bos=True) == "Hi  there"
    chat = GenerationRequest("id", [1, 5], add_special_tokens=False, source=PromptText("<s>Hi", False))
    assert triton_prompt(chat, decode, "<s>", tokenizer_adds_bos=True) == "Hi"
    assert triton_prompt(chat, decode, "<s>", tokenizer_adds_bos=False) == "<s>Hi"
    assert triton_prompt(chat, None, None, tokenizer_adds_bos=False) == "<s>Hi"  # no tokenizer needed either


def test_the_backend_tokenizes_the_sent_text_into_the_ids_the_front_end_counted(demo_model_dir):
    """The seam with the real tokenizer: what the OpenAI front-end renders (generation_requests: a completion's text, a
    chat's template), sent as text_input and tokenized as Triton's vLLM backend does (with special tokens), gives
    exactly the ids the front-end counted, and the context window was checked on."""
    from transformers import AutoTokenizer

    from serving_image.engine.vllm_backend_tensors import triton_prompt
    from serving_image.openai_api.generation import generation_requests
    from serving_image.openai_api.protocol import ChatCompletionRequest, CompletionRequest
    from serving_image.served_model import HFTokenizerMixin, ModelInfo

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir))

    class Tokenizing(HFTokenizerMixin):
        info = ModelInfo(name="demo-tiny", version="1", max_model_len=2048, vocab_size=len(tokenizer),
                         eos_token_id=tokenizer.eos_token_id)
        _tokenizer = tokenizer

    adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
    bodies = [CompletionRequest(model="demo-tiny", prompt="Hello  world ,  again !", max_tokens=4),
              CompletionRequest(model="demo-tiny", prompt=["one  two", " three"], max_tokens=4),
              CompletionRequest(model="demo-tiny", prompt=[5, 6, 7], max_tokens=4),
              ChatCompletionRequest(model="demo-tiny", messages=[{"role": "user", "content": "Hi  there"}])]
    sent = 0
    for body in bodies:
        for request in generation_requests(Tokenizing(), body, "r"):
            if request.source is None:  # token ids from the client: no text to send, decoded as before
                assert request.prompt == [5, 6, 7]
                continue
            text = triton_prompt(request, None, tokenizer.bos_token, adds_bos)
            assert tokenizer.encode(text, add_special_tokens=True) == list(request.prompt), (body, text)
            sent += 1
    assert sent == 4
