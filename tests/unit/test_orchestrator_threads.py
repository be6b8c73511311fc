"""Which threads the orchestrator's blocking calls run on. A response leaves from the event loop's thread,
never from a worker thread while the loop runs Python: Triton 24.10's stub, sending from other threads, corrupted
its heap after a client that stopped reading was killed (docs/results/2026-12-07-orchestrator-send-thread.md).
The orchestrator (`_Responses.round`) sends a round's streamed response once the request's coroutine next waits
(its next round's calls out); the cancellation check waits on an IPC thread. Its BLS calls (the stub's
async_exec, on the loop's default executor) run on its own pool, not asyncio's min(32, cores + 4) threads.
Fakes stand in for Triton's response sender and the adapter's metrics: this is the orchestrator's own logic."""

import asyncio
import concurrent.futures
import threading
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from specdec.serving.pairs import smollm2_tokenizer_dir
from specdec.triton.orchestrator import SpeculativeDecodingAdapter, _Responses


class Sender:
    """Triton's response sender as the orchestrator uses it: what it sent, and from which thread each call came."""

    def __init__(self):
        self.sent, self.checked = [], []

    def send(self, response, flags=0):
        self.sent.append((response, flags, threading.get_ident()))

    def is_cancelled(self):
        self.checked.append(threading.get_ident())
        return False


def adapter(ipc):
    metrics = SimpleNamespace(ttft=SimpleNamespace(observe=lambda seconds: None),
                              record_round=lambda *args: None, record_costs=lambda *args: None)
    return SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()), metrics=metrics,
                           costs=None, ipc=ipc, cancellations=SimpleNamespace(is_cancelled=lambda seq_id: False),
                           _response=lambda emission, *rest: ("response", tuple(emission.ids)))


def parsed():
    return SimpleNamespace(generation=SimpleNamespace(seq_id=7), stream=True, stop_words=(), include_stop=False,
                           skip_special=True, stream_interval_s=0.0, stream_interval_tokens=1, perf_metrics=False)


def a_round(tokens):
    return SimpleNamespace(finish_reason=None, prompt_log_probs=None, prompt_logits=None, log_probs=[], top=None,
                           ranks=None, logits=None, new_tokens=tokens, num_drafted=0, num_accepted=0, depth=None)


@pytest.fixture
def ipc():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-ipc")
    yield pool
    pool.shutdown(wait=True)


def test_a_streamed_response_leaves_from_the_loop_thread_after_the_next_round_went_out(ipc):
    sender = Sender()

    async def request():
        loop_thread = threading.get_ident()
        responses = _Responses(adapter(ipc), sender, parsed(), arrived=0.0)
        hello = responses.adapter.tokenizer.encode("Hello world", add_special_tokens=False)
        finish, emission = await responses.round(a_round(hello))
        assert finish is None and emission.ids == hello
        # not sent yet: it waits for the request's next await (its next round's calls going out)
        assert sender.sent == [] and sender.checked == []
        await asyncio.sleep(0)  # the request waits on its next round
        assert [(r, f, t == loop_thread) for r, f, t in sender.sent] == [(("response", tuple(hello)), 0, True)]
        more = responses.adapter.tokenizer.encode(" again", add_special_tokens=False)
        await responses.round(a_round(more))  # collects the previous round's send and check first
        assert len(sender.checked) == 1 and sender.checked[0] != loop_thread  # the check waited on an IPC thread
        await responses.settle()
        assert [t == loop_thread for *_, t in sender.sent] == [True, True]
        assert [r for r, *_ in sender.sent] == [("response", tuple(hello)), ("response", tuple(more))]
        assert len(sender.checked) == 2 and loop_thread not in sender.checked

    asyncio.run(request())


def test_bls_calls_run_on_the_orchestrators_own_threads():
    """async_exec runs its blocking call with run_in_executor(None, ...): after the first execute, the loop's
    default executor is the orchestrator's pool (sized by max_live_sequences), whatever the machine's cores."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=3, thread_name_prefix="specdec-bls")
    names = []

    async def beat():
        pass

    async def serve(request):
        names.append(await asyncio.get_running_loop().run_in_executor(None, lambda: threading.current_thread().name))

    instance = SimpleNamespace(heartbeat=None, bls_threads=pool, _beat=beat, _serve=serve)
    try:
        asyncio.run(SpeculativeDecodingAdapter.execute(instance, ["a", "b", "c"]))
    finally:
        pool.shutdown(wait=True)
    assert len(names) == 3 and all(name.startswith("specdec-bls") for name in names)
