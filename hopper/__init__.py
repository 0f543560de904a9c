"""sm90 kernels (FA3 design): TMA, WGMMA, warp-specialized producer/consumer warpgroups.

No kernel here yet: on sm90 the dispatcher uses the sm80 kernels, which run on Hopper.
"""
