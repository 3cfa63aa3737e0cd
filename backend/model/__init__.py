"""The model: the runner, the fused Llama forward, linear layers and their C++ kernels, paged attention, weight
formats and the CPU features that choose the fast paths at load."""
