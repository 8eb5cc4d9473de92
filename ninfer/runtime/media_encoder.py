"""Media encoding beside the worker's cycles (issue 29 item 2).

A request with images or video needs the vision tower's output before its prefill. Encoding it in
`Program.bind`, on the worker thread, stopped every other request's decode for as long as the
tower ran (seconds per image on the host). Here the waiting request's media are encoded on a
thread of their own while the worker keeps cycling: the request stays first in the queue (FIFO
admission is kept) and is bound, with the encoded media, once they are ready; the encode's end
wakes the worker. The tower is numpy (BLAS releases the GIL), so the two threads overlap.

    ready(req)   True once req's media are encoded (the first call starts the encode)
    take(req)    the encoded media, or the encode's exception; the job is forgotten
    forget(req)  a request that ends while encoding (cancel, deadline): its result is dropped
    close()      at shutdown: queued encodes are cancelled, a running one finishes unseen
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional


class MediaEncoder:
    def __init__(self, encode: Callable, notify: Callable[[], None]):
        # encode(prompt_ids, media, positions) -> the Program's encoded media (the vision tower)
        self._encode, self._notify = encode, notify
        self._pool: Optional[ThreadPoolExecutor] = None
        self._jobs: dict = {}            # request ticket -> Future

    def ready(self, req) -> bool:
        job = self._jobs.get(req.ticket)
        if job is None:
            if self._pool is None:       # one thread: the tower's own GEMMs use the cores
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ninfer-media")
            job = self._pool.submit(self._encode, req.prompt_ids, *req.media)
            job.add_done_callback(lambda _: self._notify())
            self._jobs[req.ticket] = job
        return job.done()

    def take(self, req):
        job: Future = self._jobs.pop(req.ticket)
        return job.result()

    def forget(self, req) -> None:
        job = self._jobs.pop(req.ticket, None)
        if job is not None:
            job.cancel()

    @property
    def num_encoding(self) -> int:
        return sum(not job.done() for job in self._jobs.values())

    def close(self) -> None:
        for job in self._jobs.values():
            job.cancel()
        self._jobs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
