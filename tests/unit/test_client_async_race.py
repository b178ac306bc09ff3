"""The asyncio SDK when a request's whole reply (Accepted, its tokens, Done) is already queued on
the socket before generate() resumes: a real ZeroMQ ROUTER peer over inproc:// answers at once,
and the receiver task drains every queued frame in one turn of the loop (pyzmq resolves a recv
immediately when a frame is waiting). generate() must still return the finished stream."""
import asyncio

import zmq
import zmq.asyncio

from kvhold.client.aclient import AsyncClient
from kvhold.protocol import messages as m, wire


def _answer_in_one_burst(router: zmq.Socket, request_id: int) -> None:
    """Read one Generate and queue its complete reply before the client's loop runs again."""
    identity, frame = router.recv_multipart()
    msg = wire.decode(frame)
    assert isinstance(msg, m.Generate)
    replies = [m.Accepted(tag=msg.tag, request_id=request_id, prompt_tokens=len(msg.prompt_ids)),
               m.Tokens(request_id=request_id, start=0, ids=[7], texts=["x"]),
               m.Done(request_id=request_id, finish_reason="length", prompt_tokens=len(msg.prompt_ids),
                      completion_tokens=1, text="x")]
    for reply in replies:
        router.send_multipart([identity, wire.encode(reply)])


def test_generate_returns_a_stream_whose_done_came_with_its_accepted():
    async def main():
        actx = zmq.asyncio.Context()
        router = zmq.Context.shadow(actx.underlying).socket(zmq.ROUTER)   # a plain, blocking peer
        router.bind("inproc://kvhold-burst")
        client = AsyncClient("inproc://kvhold-burst", timeout=5, context=actx)
        try:
            results = []
            for request_id in range(1, 51):
                pending = asyncio.ensure_future(client.generate(prompt_ids=[3, 4], max_tokens=1))
                while not router.poll(0):          # generate() sends, then waits for its reply
                    await asyncio.sleep(0)
                _answer_in_one_burst(router, request_id)   # inproc: all three frames are queued now
                stream = await pending
                results.append((stream.request_id, await stream.result()))
            return results
        finally:
            await client.close()
            router.close(0)
            actx.term()

    results = asyncio.run(main())
    assert [rid for rid, _ in results] == list(range(1, 51))
    assert all(r.token_ids == [7] and r.finish_reason == "length" and r.text == "x" for _, r in results)
