"""The portable backend's Triton kernels: any CUDA GPU, and Triton's interpreter on the CPU."""
