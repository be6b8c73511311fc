"""Background responses' streams (gateway/background.py): kept in the store as they are generated and followed
from any position, by this process or another sharing the store; their ends. The generation is a stand-in
(the served tests: tests/integration/test_openai_api.py)."""

import asyncio

import pytest

from specdec.gateway import background, responses
from specdec.gateway.background import BackgroundResponses
from specdec.gateway.protocol import ApiError, parse_chat
from specdec.gateway.response_store import ResponseStore, SharedResponseStore

BODY = {"model": "m", "input": "Say hi.", "background": True}


def request():
    return parse_chat(responses.chat_body(BODY), ("m",)), BODY


class Generation:
    """An answer that sends a delta each time the test lets it (`step`), then ends as told."""

    def __init__(self, deltas: int, refuse: bool = False):
        self.deltas, self.refuse, self.go = deltas, refuse, asyncio.Semaphore(0)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.go.release()

    async def __call__(self, gen, body, started, send) -> dict:
        for i in range(self.deltas):
            await self.go.acquire()
            await send("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0, delta=f"w{i} ")
        if self.refuse:
            raise ApiError(400, "max_tokens is over the context", "max_tokens")
        text = "".join(f"w{i} " for i in range(self.deltas))
        return responses.response_object(gen, body, "completed", responses.output_items(text, []), stored=True)


async def collect(stream, into: list) -> list:
    async for event in stream:
        into.append(event)
    return into


def replicas(tmp_path, answer):
    """Two replicas over one shared store's directory: a generates with `answer`; (a, b, b's store)."""
    a = BackgroundResponses(SharedResponseStore(tmp_path, 1 << 20), answer, drain_timeout_s=1)
    store = SharedResponseStore(tmp_path, 1 << 20)
    return a, BackgroundResponses(store, Generation(0), drain_timeout_s=1), store


def kinds(events) -> list[str]:
    return [event["type"] for event in events]


@pytest.mark.parametrize("shared", [False, True])
def test_a_stream_is_followed_from_any_event_and_ends_with_the_response(tmp_path, shared):
    async def main():
        store = SharedResponseStore(tmp_path, 1 << 20) if shared else ResponseStore(1 << 20)
        answer = Generation(3)
        jobs = BackgroundResponses(store, answer, drain_timeout_s=1)
        started = await jobs.start(*request())
        first = asyncio.create_task(collect(jobs.follow(started["id"], -1), []))
        answer.step()
        await asyncio.sleep(0.05)
        late = asyncio.create_task(collect(jobs.follow(started["id"], 2), []))  # after created, in_progress, w0
        answer.step(2)
        everything, rest = await asyncio.wait_for(asyncio.gather(first, late), 10)
        assert kinds(everything) == ["response.created", "response.in_progress"] + [
            "response.output_text.delta"] * 3 + ["response.completed"]
        assert [event["sequence_number"] for event in everything] == list(range(6))
        assert rest == everything[3:]
        assert everything[-1]["response"]["status"] == "completed" == store.get(started["id"])["status"]
        # once ended, a stream is its events replayed
        assert await collect(jobs.follow(started["id"], 4), []) == everything[5:]
        assert len(jobs) == 0
    asyncio.run(main())


def test_a_cancelled_stream_ends_without_an_end_event_and_a_refused_one_with_failed():
    async def main():
        store = ResponseStore(1 << 20)
        answer = Generation(100)
        jobs = BackgroundResponses(store, answer, drain_timeout_s=1)
        started = await jobs.start(*request())
        follower = asyncio.create_task(collect(jobs.follow(started["id"], -1), []))
        answer.step(2)
        await asyncio.sleep(0.05)
        assert (await jobs.cancel(store.get(started["id"])))["status"] == "cancelled"
        events = await asyncio.wait_for(follower, 10)
        assert kinds(events)[-1] == "response.output_text.delta" and len(events) == 4
        assert store.get(started["id"])["status"] == "cancelled"

        refused = Generation(1, refuse=True)
        jobs = BackgroundResponses(store, refused, drain_timeout_s=1)
        started = await jobs.start(*request())
        refused.step()
        events = await asyncio.wait_for(collect(jobs.follow(started["id"], -1), []), 10)
        assert kinds(events)[-1] == "response.failed" and events[-1]["response"]["error"]["code"]
        assert store.get(started["id"])["status"] == "failed"
        # a deleted response's stream ends
        deleted = Generation(100)
        jobs = BackgroundResponses(store, deleted, drain_timeout_s=1)
        started = await jobs.start(*request())
        follower = asyncio.create_task(collect(jobs.follow(started["id"], -1), []))
        await asyncio.sleep(0.05)
        store.delete(started["id"])
        jobs.stop(started["id"])
        assert kinds(await asyncio.wait_for(follower, 10)) == ["response.created", "response.in_progress"]
    asyncio.run(main())


def test_another_process_follows_a_response_generated_here_through_a_shared_store(tmp_path, monkeypatch):
    """Replica B follows what replica A generates (polling the directory), to A's end event; B's cancel of
    another stops A's generation and B's stream of it."""
    monkeypatch.setattr(background, "WATCH_S", 0.05)

    async def main():
        answer = Generation(4)
        a, b, b_store = replicas(tmp_path, answer)
        started = await a.start(*request())
        follower = asyncio.create_task(collect(b.follow(started["id"], 0), []))
        answer.step(4)
        events = await asyncio.wait_for(follower, 10)
        assert kinds(events) == ["response.in_progress"] + ["response.output_text.delta"] * 4 + ["response.completed"]

        endless = Generation(100)
        a.answer = endless
        started = await a.start(*request())
        follower = asyncio.create_task(collect(b.follow(started["id"], -1), []))
        endless.step(1)
        await asyncio.sleep(0.3)
        await b.cancel(b_store.get(started["id"]))
        events = await asyncio.wait_for(follower, 10)
        assert kinds(events) == ["response.created", "response.in_progress", "response.output_text.delta"]
        await asyncio.sleep(0.2)
        assert len(a) == 0 and b_store.get(started["id"])["status"] == "cancelled"
    asyncio.run(main())


def test_a_response_whose_generating_replica_died_is_failed_once_its_beats_stop(tmp_path, monkeypatch):
    """With a shared store the replica generating a background response beats (`<id>.alive`) every WATCH_S;
    another replica reads it in_progress while the beats go on, and failed once they have stopped for ORPHAN_S
    (stored so, its stream ended with response.failed): that replica died without storing its end. A
    response that ended stops its beats and stays as it ended."""
    monkeypatch.setattr(background, "WATCH_S", 0.05)
    monkeypatch.setattr(background, "ORPHAN_S", 0.4)

    async def main():
        answer = Generation(100)
        a, b, store = replicas(tmp_path, answer)
        started = await a.start(*request())
        await asyncio.sleep(0.8)  # twice ORPHAN_S: a's beats keep it alive
        assert (await b.current(store.get(started["id"])))["status"] == "in_progress"
        answer.step(100)
        await asyncio.sleep(0.2)
        assert store.beat_age(started["id"]) is None  # its end stored: no beats
        await asyncio.sleep(0.5)
        assert (await b.current(store.get(started["id"])))["status"] == "completed"

        # what a replica that died leaves: the response stored in_progress, its first events, its last beat
        gen, body = request()
        dead = responses.response_object(gen, body, "in_progress", [], stored=True)
        store.beat(dead["id"])
        store.put(dead, [], None)
        store.add_events(dead["id"], [responses.event("response.created", 0, response=dead),
                                      responses.event("response.in_progress", 1, response=dead)])
        assert (await b.current(store.get(dead["id"])))["status"] == "in_progress"
        follower = asyncio.create_task(collect(b.follow(dead["id"], -1), []))
        await asyncio.sleep(0.6)
        ended = await b.current(store.get(dead["id"]))
        assert ended["status"] == "failed" and ended["error"]["code"] == "server_error"
        assert store.get(dead["id"])["status"] == "failed" and store.beat_age(dead["id"]) is None
        events = await asyncio.wait_for(follower, 2)  # its stream ends with the failure
        assert kinds(events) == ["response.created", "response.in_progress", "response.failed"]
        assert events[-1]["sequence_number"] == 2
        store.delete(dead["id"])
        assert not list(tmp_path.glob(dead["id"] + "*"))  # its events and beats go with it
    asyncio.run(main())


def test_a_cancel_stored_by_another_replica_before_the_end_stays(tmp_path, monkeypatch):
    """Replica B cancels while A's generation is finishing, before A's next look (WATCH_S): A reads the
    stored status before storing its end, and the response stays cancelled, its stream with no end event."""
    monkeypatch.setattr(background, "WATCH_S", 60.0)

    async def main():
        answer = Generation(2)
        a, b, store = replicas(tmp_path, answer)
        started = await a.start(*request())
        answer.step()
        await asyncio.sleep(0.05)
        assert (await b.cancel(store.get(started["id"])))["status"] == "cancelled"
        answer.step()  # the generation ends: its answer is whole, the cancel came first
        await asyncio.sleep(0.2)
        assert len(a) == 0 and store.get(started["id"])["status"] == "cancelled"
        events = await asyncio.wait_for(collect(b.follow(started["id"], -1), []), 2)
        assert "response.completed" not in kinds(events)
    asyncio.run(main())
