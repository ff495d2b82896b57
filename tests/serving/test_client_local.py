"""The pieces of local discovery (llm_serving_client/local.py) that need no server: the result cache of a local server
read from its batch store (make up's by default, llm_serving/up_layout.py), and the consumer service's refusals of
flags that do not go together. Against a real server: test_client_remote.py."""

from __future__ import annotations

import pytest

from llm_serving.batch_cache import ResultCache
from llm_serving.object_store import DirectoryStore
from llm_serving.stack_outputs import StackOutputsError, parse_stack_outputs
from llm_serving.up_layout import up_batch_store, up_cache
from llm_serving_client import Client, LocalEndpoints
from llm_serving_client.local import LOCAL_BATCH, local_result_cache
from tests.serving.client_outputs import LLM, document

BODY = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "temperature": 0}
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "cached hello"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}}


def test_a_local_servers_cached_answer_is_read_from_its_batch_store(tmp_path):
    outputs = parse_stack_outputs({**document(), "batch": LOCAL_BATCH})
    ResultCache(DirectoryStore(tmp_path)).put(LLM, "1.0.0", "/v1/chat/completions", {"model": LLM, **BODY}, ANSWER)
    # Nothing listens at the local address: a hit is answered from the store, a miss would need the server.
    client = Client(outputs, local=LocalEndpoints("http://127.0.0.1:9/v1", "127.0.0.1:9"),
                    result_cache=local_result_cache(outputs, str(tmp_path)))
    answer = client.chat(LLM, cached=True, **BODY)
    assert (answer.cached, answer.text, answer.completion_tokens) == (True, "cached hello", 8)
    client.close()


def test_no_batch_block_or_a_bad_store_is_refused_naming_it(tmp_path):
    with pytest.raises(StackOutputsError, match="the local server runs no Batch API .*no result cache to read"):
        local_result_cache(parse_stack_outputs(document()), str(tmp_path))
    with pytest.raises(StackOutputsError, match="the local server's batch store 'ftp://x': .*unsupported store"):
        local_result_cache(parse_stack_outputs({**document(), "batch": LOCAL_BATCH}), "ftp://x")


def test_make_ups_batch_store_is_one_rule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert up_cache({}) == tmp_path / ".cache" / "llm-serving"
    assert up_batch_store({}) == str(tmp_path / ".cache" / "llm-serving" / "batch-store")
    assert up_batch_store({"LLM_SERVING_CACHE": "/c"}) == "/c/batch-store"
    assert up_batch_store({"LLM_SERVING_BATCH_STORE": "s3://b/p", "LLM_SERVING_CACHE": "/c"}) == "s3://b/p"


@pytest.mark.parametrize(("argv", "message"), [
    (["--local-openai", "http://x/v1", "--local-grpc", "x:1", "--read-cache"], "--read-cache runs a batch of chat "
                                                                              "requests: give --llm"),
    (["--outputs", "o.json", "--llm", "m", "--local-batch-store", "/s"], "--local-batch-store is a local server's: "
                                                                         "give --discover-local"),
])
def test_the_consumer_refuses_flags_that_do_not_go_together(argv, message, capsys):
    from examples.consumer import service

    with pytest.raises(SystemExit):
        service.main(argv)
    assert message in capsys.readouterr().err
