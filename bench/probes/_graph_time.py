"""What the probes here share: the median time of one CUDA-graph replay of fn's kernels, and a
flashinfer decode wrapper planned for one row."""

import torch


def graph_time(fn, reps: int = 20) -> float:
    """ms per replay of a graph holding one call of fn (warmed up twice on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def flashinfer_decode_one_row(num_pages: int, page_size: int, num_heads: int, num_kv_heads: int,
                              head_dim: int, tensor_cores: bool, workspace_mib: int, device):
    """flashinfer's bf16 decode wrapper in CUDA-graph mode, planned for one row over pages
    0..num_pages-1, every page full."""
    import flashinfer
    workspace = torch.empty(workspace_mib << 20, dtype=torch.uint8, device=device)
    indptr = torch.tensor([0, num_pages], dtype=torch.int32, device=device)
    indices = torch.arange(num_pages, dtype=torch.int32, device=device)
    last = torch.tensor([page_size], dtype=torch.int32, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last)
    wrapper.plan(indptr.cpu(), indices, last.cpu(), num_heads, num_kv_heads, head_dim, page_size,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return wrapper
