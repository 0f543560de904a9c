"""sm100 kernels (FA4 design): tcgen05 MMA, TMEM, softmax and correction warpgroups.

No kernel here yet: on sm100 the dispatcher uses the sm80 kernels, which run on Blackwell.
"""
