"""tcp: the pages travel as one zero-copy zmq frame after the chunk header. Works anywhere."""

from __future__ import annotations

import warnings

import torch

from kernels.kv_copy import gather_pages, scatter_pages
from pd_serve.protocol import KVChunk
from pd_serve.transfer.base import (ReceiverPlane, SenderPlane, head_range, on_stream,
                                    staging_shape)


class TcpSenderPlane(SenderPlane):
    def prepare(self, peer: str, chunk: KVChunk, src_page_ids: list[int],
                ready: torch.cuda.Event | None) -> list:
        buf = self.pool.buffer
        if not src_page_ids:
            return [b""]  # a request without pages: an empty frame
        with on_stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            index = self.page_ids.to_device(src_page_ids)
            staging = gather_pages(buf, index, chunk.layer_start, chunk.layer_end,
                                   heads=head_range(chunk.src_heads))
            if staging.is_cuda:
                staging = staging.cpu()  # waits for the gather
        # zmq keeps the memoryview (and so the tensor) alive until the frame is sent.
        return [memoryview(staging.view(torch.uint8).numpy()).cast("B")]


class TcpReceiverPlane(ReceiverPlane):
    def __init__(self, pool, timeout_s: float, host: str):
        super().__init__(pool, timeout_s)

    def receive(self, sender_id: str, chunk: KVChunk, frames: list,
                dst_page_ids: list[int] | None) -> None:
        if len(frames) != 1 or len(frames[0].buffer) != chunk.nbytes:
            got = [len(f.buffer) for f in frames]
            raise ValueError(f"chunk of {chunk.request_id} carries frames {got}, expected [{chunk.nbytes}]")
        if dst_page_ids is None or not chunk.nbytes:
            return  # the frame is consumed already, or carries nothing
        with warnings.catch_warnings():  # the frame is read-only; we only read it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(frames[0].buffer, dtype=torch.uint8)
        heads = head_range(chunk.dst_heads)
        shape = staging_shape(self.pool.layout, len(dst_page_ids), chunk.layer_start,
                              chunk.layer_end, heads)
        with on_stream(self.stream):
            # From pageable memory .to() returns once the frame is read, so the frame may go.
            staging = flat.view(self.pool.buffer.dtype).view(shape).to(self.device)
            scatter_pages(self.pool.buffer, self.page_ids.to_device(dst_page_ids), staging,
                          chunk.layer_start, chunk.layer_end, heads)
