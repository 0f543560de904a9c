"""Synchronisation pieces shared by the sm90 kernels (forward and backward)."""

from __future__ import annotations

import cutlass.pipeline as pipeline


def tma_pipeline(barriers, stages: int, tx_bytes: int, consumer_warps: int):
    """An mbarrier pipeline of ``stages`` whose stages one producer thread fills by TMA (the
    transaction bytes ``tx_bytes`` complete a stage) and ``consumer_warps`` warps release (one
    arrival each). ``barriers`` is the smem storage of its barriers. Created with
    ``defer_sync``: the kernel fences the mbarrier inits and syncs the CTA once after creating
    all of its pipelines."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes,
        defer_sync=True,
    )


def thread_pipeline(barriers, stages: int, producer_threads: int, consumer_threads: int):
    """An mbarrier pipeline of ``stages`` whose stages ``producer_threads`` threads fill with
    ordinary stores (each arrives on "full" after its stores; the arrive's release orders
    them) and ``consumer_threads`` threads release (one arrival each). ``defer_sync`` as in
    ``tma_pipeline``."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producer_threads),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads),
        defer_sync=True,
    )
