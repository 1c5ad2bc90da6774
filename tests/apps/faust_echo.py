"""A minimal Faust worker for the interop test: copies each event from one topic to another.

Run as ``python -m tests.apps.faust_echo`` with ECHO_BOOTSTRAP, ECHO_IN, ECHO_OUT, ECHO_DATADIR and
ECHO_APP_ID in the environment. It declares no topic of its own (the test creates them).
"""

from __future__ import annotations

import os
import sys

import faust

app = faust.App(
    os.environ["ECHO_APP_ID"],
    broker=f"kafka://{os.environ['ECHO_BOOTSTRAP']}",
    topic_allow_declare=False,
    topic_disable_leader=True,
    web_enabled=False,
    store="memory://",
    datadir=os.environ["ECHO_DATADIR"],
)
source = app.topic(os.environ["ECHO_IN"], partitions=1, value_serializer="raw",
                   key_serializer="raw", internal=False)
sink = app.topic(os.environ["ECHO_OUT"], partitions=1, value_serializer="raw",
                 key_serializer="raw", internal=False)


@app.agent(source)
async def echo(stream: faust.StreamT) -> None:
    async for event in stream.events():
        fut = await sink.send(key=event.key, value=b"faust:" + event.value,
                              headers=[("via", b"faust")])
        await fut  # broker-acknowledged before the source event is acked


if __name__ == "__main__":
    sys.argv = [sys.argv[0], "worker", "--loglevel=warn", "--without-web"]
    app.main()
